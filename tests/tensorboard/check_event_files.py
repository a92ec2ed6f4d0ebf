"""Reads a kvbound run's TensorBoard event files back with the real `tensorboard` package and checks them
against the run's metrics.jsonl.

    check_event_files.py RUN_DIR

Every number of every metrics.jsonl line must be a scalar "<type>/<name>" (per-layer lists:
"<type>/<name>/layer_<i>") with exactly the lines' steps and values (float32), nothing more; every eval line's
histograms ("hist") must be there per layer at its step with the same count, min and max. Prints what it
checked; exits 1 on the first difference.
"""
import json
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
import numpy as np


def fail(what):
    print(f"FAIL: {what}")
    sys.exit(1)


def main(run_dir):
    want_scalars, want_hists = {}, {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            step, kind = j["step"], j["type"]
            for name, value in j.items():
                if name in ("type", "step"):
                    continue
                if isinstance(value, (int, float)):
                    want_scalars.setdefault(f"{kind}/{name}", []).append((step, value))
                elif isinstance(value, list):
                    for layer, v in enumerate(value):
                        want_scalars.setdefault(f"{kind}/{name}/layer_{layer}", []).append((step, v))
                elif name == "hist":
                    for hist, layers in value.items():
                        for layer, h in enumerate(layers):
                            want_hists.setdefault(f"{hist}/layer_{layer}", []).append((step, h))
    ea = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    tags = ea.Tags()
    if set(tags["scalars"]) != set(want_scalars):
        fail(f"scalar tags differ: missing {sorted(set(want_scalars) - set(tags['scalars']))[:5]}, "
             f"extra {sorted(set(tags['scalars']) - set(want_scalars))[:5]}")
    points = 0
    for tag, want in want_scalars.items():
        got = [(e.step, e.value) for e in ea.Scalars(tag)]
        if [s for s, _ in got] != [s for s, _ in want]:
            fail(f"{tag}: steps {[s for s, _ in got]} != {[s for s, _ in want]}")
        for (step, g), (_, w) in zip(got, want):
            if g != np.float32(w):
                fail(f"{tag} at step {step}: {g} != {w}")
        points += len(got)
    if set(tags["histograms"]) != set(want_hists):
        fail(f"histogram tags differ: {sorted(tags['histograms'])[:5]} vs {sorted(want_hists)[:5]}")
    for tag, want in want_hists.items():
        got = ea.Histograms(tag)
        if [e.step for e in got] != [s for s, _ in want]:
            fail(f"{tag}: histogram steps differ")
        for e, (step, h) in zip(got, want):
            v = e.histogram_value
            if (v.num, v.min, v.max) != (h["num"], h["min"], h["max"]) or sum(v.bucket) != h["num"]:
                fail(f"{tag} at step {step}: num/min/max {v.num, v.min, v.max} != {h['num'], h['min'], h['max']}")
    print(f"tensorboard: {len(want_scalars)} scalar tags ({points} points) and {len(want_hists)} histogram tags "
          f"match metrics.jsonl")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    main(sys.argv[1])
