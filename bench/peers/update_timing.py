"""What the training-step peers share: time an update the way bench/bench_train_step does (two warm-up
updates, then the mean over `steps`) and print its JSON line."""
import json
import time


def time_updates(update, method, T, B, steps, threads, dtype, device="cpu"):
    """update() runs one optimizer update and returns its loss (read on the host: on a GPU that waits for the
    update, so the clock times it)."""
    for _ in range(2):
        update()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = update()
    seconds = (time.perf_counter() - t0) / steps
    print(json.dumps({"impl": "pytorch", "method": method, "T": T, "B": B, "device": device, "threads": threads,
                      "dtype": dtype,
                      "ms_per_update": round(seconds * 1e3, 1), "tok_s": round(B * T / seconds, 1),
                      "loss": round(loss, 4)}))
