#!/usr/bin/env python3
"""The ckptfs demo: mount a real sharded checkpoint and load it with transformers.

1. Real torch saves a small random Llama-style model as DTensors over 2 gloo
   ranks on CPU with torch's HuggingFaceStorageWriter (sharded safetensors,
   shard-0000R-model-00001-of-00001.safetensors, some weights split on dim 0,
   some on dim 1).
2. `ckptfs index` builds the RocksDB index; `ckptfs mount` serves the tree.
3. transformers loads MNT/consolidated/ and its logits are compared with the
   original model's.

    python3 tools/demo.py [--workdir DIR] [--keep-mounted]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def run(*args: str) -> None:
    print("$ " + " ".join(args), flush=True)
    subprocess.run(args, check=True)


def unmount(mnt: Path) -> None:
    """fusermount3 -u, retried while the last mmaps are being released."""
    import gc
    gc.collect()
    for _ in range(20):
        if subprocess.run(["fusermount3", "-u", "-q", str(mnt)], check=False).returncode == 0:
            return
        time.sleep(0.25)
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where to write the demo checkpoint (default: a new temp dir)")
    ap.add_argument("--keep-mounted", action="store_true", help="leave the mount up for exploring")
    args = ap.parse_args()

    ckptfs = os.environ.get("CKPTFS_BIN", str(ROOT / "build" / "ckptfs"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptfs-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, mnt = work / "step_100", work / "mnt"
    os.environ.setdefault("CKPTFS_INDEX_DIR", str(work / "index"))

    import ckpt_gen  # noqa: E402  (tests/e2e/ckpt_gen.py)
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    step("1. real torch writes a sharded checkpoint (2 gloo ranks, HuggingFaceStorageWriter)")
    if not any(ckpt.glob("*.safetensors")):
        ckpt_gen.write_llama_sharded(str(ckpt), world_size=2)
    for f in sorted(ckpt.iterdir()):
        print(f"   {f.name:50s} {f.stat().st_size:>10,d} bytes")

    step("2. ckptfs index + mount")
    t0 = time.perf_counter()
    run(ckptfs, "index", str(ckpt))
    mnt.mkdir(exist_ok=True)
    subprocess.run(["fusermount3", "-u", "-q", str(mnt)], check=False)
    t1 = time.perf_counter()
    run(ckptfs, "mount", str(ckpt), str(mnt), "--log-file", str(work / "ckptfs.log"))
    print(f"   indexed + mounted in {time.perf_counter() - t0:.2f} s (mount alone {time.perf_counter() - t1:.2f} s)")
    try:
        run("ls", "-l", str(mnt / "consolidated"))

        step("3. transformers loads MNT/consolidated/ and reproduces the logits")
        ref = torch.load(ckpt.parent / f"{ckpt.name}-logits.pt")
        expected = torch.load(ckpt.parent / f"{ckpt.name}-expected.pt")
        model = AutoModelForCausalLM.from_pretrained(str(mnt / "consolidated"))
        with torch.no_grad():
            logits = model(ref["input_ids"]).logits
        same_logits = torch.equal(logits, ref["logits"])
        print(f"   logits {tuple(logits.shape)} equal to the original model's: {same_logits}")

        checked = 0
        with safe_open(str(mnt / "consolidated" / "model.safetensors"), "pt") as f:
            meta = f.metadata()
            for name in f.keys():
                assert torch.equal(f.get_tensor(name), expected[name]), name
                checked += 1
        print(f"   {checked} tensors read with safetensors equal the originals; __metadata__ = {meta}")
        del model  # releases its mmaps of the mounted files
        if not same_logits or checked != len(expected):
            print("DEMO FAILED", file=sys.stderr)
            return 1
        print("\nDemo passed." + (f" Mounted at {mnt}; unmount with: fusermount3 -u {mnt}" if args.keep_mounted else ""))
        return 0
    finally:
        if not args.keep_mounted:
            unmount(mnt)


if __name__ == "__main__":
    sys.exit(main())
