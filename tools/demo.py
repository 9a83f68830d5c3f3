#!/usr/bin/env python3
"""The ckptfs demo: train, save, and evaluate each step through a live mount.

1. ckptfs mounts an empty training root; the mount watches it.
2. A small Llama trains data-parallel on 2 gloo ranks (tools/demo_train.py)
   and saves a checkpoint every few steps with torch.distributed.checkpoint
   through ckptfs's writer (ckptfs.torch.StorageWriter): weights as
   DTensors sharded tensor-parallel style, plus AdamW state.
3. As soon as each step's save commits (the writer's commit record lands
   last: every chunk's place and CRC32C, checked against the files), the
   mount shows MNT/step_N/consolidated/; the eval loop here loads it with
   transformers and checks its logits equal the trained model's at that
   step, bit for bit. No conversion, no second copy.
4. The same step in bf16, cast on read: MNT/step_N/consolidated.bf16/
   gives the logits transformers gets when it casts the fp32 folder to
   bf16 as it loads it.
5. The last step in object storage: uploaded with boto3 to a local S3
   server (SeaweedFS), mounted as s3://ckpts/run1, and loaded by
   transformers from its consolidated/ with ranged GETs: the same logits.

    python3 tools/demo.py [--workdir DIR] [--steps N] [--save-every K] [--keep-mounted]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
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


def train_in_background(work: Path, root: Path, refs: Path, steps: int, save_every: int) -> threading.Thread:
    import harness  # tests/e2e/harness.py: the rank spawner
    job = {"root": str(root), "refs": str(refs), "steps": steps, "save_every": save_every}
    errors: list[BaseException] = []

    def run_ranks() -> None:
        try:
            harness.spawn_ranks(str(ROOT / "tools" / "demo_train.py"), 2, job, name="demo-train",
                                env={"HF_HUB_OFFLINE": "1"}, timeout=900)
        except BaseException as e:  # reported by the eval loop
            errors.append(e)

    t = threading.Thread(target=run_ranks, daemon=True)
    t.errors = errors
    t.start()
    return t


def evaluate(mnt: Path, refs: Path, step_no: int) -> bool:
    """Loads MNT/step_N/consolidated/ with transformers; compares logits."""
    import torch
    from transformers import AutoModelForCausalLM
    ref = torch.load(refs / f"step_{step_no}.pt")
    model = AutoModelForCausalLM.from_pretrained(str(mnt / f"step_{step_no}" / "consolidated"))
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits
    del model  # releases its mmaps of the mounted files
    return torch.equal(logits, ref["logits"])


def evaluate_bf16(mnt: Path, refs: Path, step_no: int) -> bool:
    """consolidated.bf16/ (cast by ckptfs on read) against transformers
    casting consolidated/ to bf16 as it loads it."""
    import torch
    from transformers import AutoModelForCausalLM
    ids = torch.load(refs / f"step_{step_no}.pt")["input_ids"]
    out = []
    for folder, dtype in (("consolidated.bf16", None), ("consolidated", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(str(mnt / f"step_{step_no}" / folder), dtype=dtype)
        with torch.no_grad():
            out.append(model(input_ids=ids).logits)
        del model
    return out[0].dtype == torch.bfloat16 and torch.equal(out[0], out[1])


def from_object_storage(ckptfs: str, work: Path, root: Path, refs: Path, step_no: int) -> bool:
    """Uploads step_N to a local S3 server, mounts the bucket's prefix and
    evaluates the step from there."""
    import s3_server  # tools/s3_server.py: SeaweedFS, requests signed and checked
    (work / "seaweedfs").mkdir(exist_ok=True)
    server = s3_server.Server(work / "seaweedfs")
    s3mnt = work / "mnt-s3"
    s3mnt.mkdir(exist_ok=True)
    try:
        keys = s3_server.upload_tree(server.client, str(root / f"step_{step_no}"), f"run1/step_{step_no}/")
        print(f"   uploaded step_{step_no} ({len(keys)} objects) to s3://{s3_server.BUCKET}/run1/ at {server.endpoint}")
        os.environ.update(AWS_ACCESS_KEY_ID=s3_server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3_server.SECRET_KEY)
        run(ckptfs, "mount", f"s3://{s3_server.BUCKET}/run1", str(s3mnt), "--endpoint-url", server.endpoint,
            "--log-file", str(work / "ckptfs-s3.log"))
        try:
            return evaluate(s3mnt, refs, step_no)
        finally:
            unmount(s3mnt)
    finally:
        server.stop()


def eval_loop(mnt: Path, refs: Path, trainer: threading.Thread, wanted: list[int]) -> int:
    failures = 0
    for n in wanted:
        view = mnt / f"step_{n}" / "consolidated" / "model.safetensors"
        waited = False
        while not view.exists():
            waited = True
            if not trainer.is_alive() and not view.exists():
                print(f"   step_{n}: the trainer stopped before it appeared: {trainer.errors}", file=sys.stderr)
                return failures + 1
            time.sleep(0.02)
        seen = time.time()
        saved_file = refs / f"step_{n}.saved"
        when = "was already there when the eval got to it"
        if waited and saved_file.exists():
            when = f"appeared {max(0.0, seen - float(saved_file.read_text())):.2f} s after its save returned"
        same = evaluate(mnt, refs, n)
        failures += not same
        print(f"   eval: step_{n}/consolidated/ {when}; transformers logits equal the trained model's: {same}",
              flush=True)
        same = evaluate_bf16(mnt, refs, n)
        failures += not same
        print(f"   eval: step_{n}/consolidated.bf16/ (cast on read) gives transformers' own bf16 logits: {same}",
              flush=True)
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where the training root goes (default: a new temp dir)")
    ap.add_argument("--steps", type=int, default=9, help="training steps (default 9)")
    ap.add_argument("--save-every", type=int, default=3, help="save a checkpoint every K steps (default 3)")
    ap.add_argument("--keep-mounted", action="store_true", help="leave the mount up for exploring")
    args = ap.parse_args()

    ckptfs = os.environ.get("CKPTFS_BIN", str(ROOT / "build" / "ckptfs"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptfs-demo-"))
    root, mnt, refs = work / "run1", work / "mnt", work / "refs"
    for d in (root, mnt, refs):
        d.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CKPTFS_INDEX_DIR", str(work / "index"))

    step("1. ckptfs mounts the (empty) training root; it watches for new steps")
    subprocess.run(["fusermount3", "-u", "-q", str(mnt)], check=False)
    run(ckptfs, "mount", str(root), str(mnt), "--log-file", str(work / "ckptfs.log"))
    try:
        step(f"2. training on 2 gloo ranks, a checkpoint every {args.save_every} steps into {root}")
        trainer = train_in_background(work, root, refs, args.steps, args.save_every)
        step("3. eval loads each new step from MNT/step_N/consolidated/ as it appears")
        wanted = list(range(args.save_every, args.steps + 1, args.save_every))
        failures = eval_loop(mnt, refs, trainer, wanted)
        trainer.join()
        if trainer.errors:
            print(f"training failed: {trainer.errors[0]}", file=sys.stderr)
            failures += 1
        run("ls", "-l", str(mnt / f"step_{wanted[-1]}" / "consolidated"))
        step("4. every chunk of the last step re-read against the CRC32C its writer recorded")
        run(ckptfs, "verify", str(root / f"step_{wanted[-1]}"))
        step(f"5. step_{wanted[-1]} read back from object storage (a local S3 server)")
        same = from_object_storage(ckptfs, work, root, refs, wanted[-1])
        failures += not same
        print(f"   eval: s3://.../step_{wanted[-1]}/consolidated/ gives the trained model's logits: {same}", flush=True)
        print(f"\n   the mount's log: {work / 'ckptfs.log'}")
        if failures:
            print("DEMO FAILED", file=sys.stderr)
            return 1
        print("\nDemo passed." + (f" Mounted at {mnt}; unmount with: fusermount3 -u {mnt}" if args.keep_mounted else ""))
        return 0
    finally:
        if not args.keep_mounted:
            unmount(mnt)


if __name__ == "__main__":
    sys.exit(main())
