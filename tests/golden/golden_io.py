"""Writes golden tensors for the C++ tests: NAME.f32 (raw little-endian float32) + NAME.json (shape, ids)."""
import json
import os

import numpy as np


def write_tensor(out_dir, name, array, **extra):
    os.makedirs(out_dir, exist_ok=True)
    array = np.ascontiguousarray(array, dtype="<f4")
    tmp = os.path.join(out_dir, name + ".f32.part")
    array.tofile(tmp)
    os.replace(tmp, os.path.join(out_dir, name + ".f32"))
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"shape": list(array.shape), **extra}, f)
