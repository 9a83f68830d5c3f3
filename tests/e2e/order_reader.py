#!/usr/bin/env python3
"""Reads a consolidated/ folder of the mount the way one loader does and
compares every tensor with the expected ones (torch.save'd by the test),
in a process of its own so that no mapping of the mount outlives it.

    python3 order_reader.py MODE FOLDER EXPECTED_PT

MODE: read (sequential 1 MiB read() calls, parsed by safetensors),
load_file (safetensors.torch.load_file), from_pretrained (transformers),
safe_open_reverse / safe_open_random (safe_open, get_tensor in reverse or
in a shuffled order). Prints "ok N" (N tensors compared) or exits 1 naming
the first tensor that differs.
"""

from __future__ import annotations

import os
import random
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _load(mode: str, folder: str) -> dict:
    path = os.path.join(folder, "model.safetensors")
    if mode == "read":
        from safetensors.torch import load
        with open(path, "rb", buffering=0) as f:
            data = b"".join(iter(lambda: f.read(1 << 20), b""))
        return load(data)
    if mode == "load_file":
        from safetensors.torch import load_file
        return load_file(path)
    if mode == "from_pretrained":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(folder)
        return {k: v.detach() for k, v in model.state_dict().items()}
    if mode.startswith("safe_open_"):
        from safetensors import safe_open
        out = {}
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            if mode == "safe_open_reverse":
                keys.reverse()
            else:
                random.Random(5).shuffle(keys)
            for k in keys:
                out[k] = f.get_tensor(k).clone()
        return out
    raise SystemExit(f"unknown mode {mode}")


def main() -> int:
    mode, folder, expected_path = sys.argv[1:4]
    expected = torch.load(expected_path)
    got = _load(mode, folder)
    if sorted(got) != sorted(expected):
        print(f"tensor names differ: {sorted(set(got) ^ set(expected))}")
        return 1
    for k, v in expected.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v):
            print(f"{k}: differs from the expected tensor")
            return 1
    print(f"ok {len(expected)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
