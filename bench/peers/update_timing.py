"""What the training-step peers share: time an update the way bench/bench_train_step does (two warm-up
updates, then the median of `steps`: on a shared machine a neighbour's burst stretches one update, not the
typical one) and print its JSON line."""
import json
import statistics
import time


def time_updates(update, method, T, B, steps, threads, dtype, device="cpu"):
    """update() runs one optimizer update and returns its loss (read on the host: on a GPU that waits for the
    update, so the clock times it)."""
    for _ in range(2):
        update()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = update()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    print(json.dumps({"impl": "pytorch", "method": method, "T": T, "B": B, "device": device, "threads": threads,
                      "dtype": dtype,
                      "ms_per_update": round(seconds * 1e3, 1), "tok_s": round(B * T / seconds, 1),
                      "loss": round(loss, 4)}))
