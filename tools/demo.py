#!/usr/bin/env python3
"""The ckptfs demo: train, save, and evaluate each step through a live mount.

1. A local S3 server (SeaweedFS) starts; ckptfs mounts an empty training
   root and the prefix s3://ckpts/run1 (a README only); both mounts watch.
2. A small Llama trains data-parallel on 2 gloo ranks (tools/demo_train.py)
   and saves a checkpoint every few steps with torch.distributed.checkpoint
   through ckptfs's writer (ckptfs.torch.StorageWriter): weights as
   DTensors sharded tensor-parallel style, plus AdamW state; each step into
   the local root, then the same step straight to object storage with
   StorageWriter("s3://ckpts/run1/step_N") (one multipart upload per rank,
   committed once every rank's upload completed).
3. As soon as each step's save commits (the writer's commit record lands
   last: every chunk's place and CRC32C, checked against the files), the
   mount shows MNT/step_N/consolidated/; the eval loop here loads it with
   transformers and checks its logits equal the trained model's at that
   step, bit for bit. No conversion, no second copy. The same step in
   bf16, cast on read: MNT/step_N/consolidated.bf16/ gives the logits
   transformers gets when it casts the fp32 folder to bf16 as it loads it.
   Then the step as the S3 mount shows it once its upload commits (its
   .metadata in the bucket, checked with boto3 when it appears), loaded by
   transformers from s3://ckpts/run1/step_N/consolidated/ with ranged GETs:
   the same logits.
4. `ckptfs verify` re-reads every chunk of the last step, local and in the
   bucket, against the CRC32C its writer recorded.

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


def train_in_background(root: Path, s3: "ObjectStorage", refs: Path, steps: int, save_every: int) -> threading.Thread:
    import ranks  # tools/ranks.py: the rank spawner
    job = {"root": str(root), "s3_root": s3.url, "refs": str(refs), "steps": steps, "save_every": save_every}
    errors: list[BaseException] = []

    def run_ranks() -> None:
        try:
            ranks.spawn_ranks(str(ROOT / "tools" / "demo_train.py"), 2, job, name="demo-train",
                                env={"HF_HUB_OFFLINE": "1", **s3.env}, timeout=900)
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


class ObjectStorage:
    """A local S3 server (SeaweedFS) with an empty bucket, and
    `ckptfs mount s3://ckpts/run1` on it; ``close()`` unmounts and stops it."""

    def __init__(self, ckptfs: str, work: Path):
        import s3_server  # tools/s3_server.py: SeaweedFS with one identity
        (work / "seaweedfs").mkdir(exist_ok=True)
        self.server = s3_server.Server(work / "seaweedfs")
        self.prefix = "run1"
        self.url = f"s3://{s3_server.BUCKET}/{self.prefix}"
        self.bucket, self.client = s3_server.BUCKET, self.server.client
        self.env = {"AWS_ACCESS_KEY_ID": s3_server.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3_server.SECRET_KEY,
                    "AWS_ENDPOINT_URL": self.server.endpoint, "AWS_REGION": "us-east-1"}
        os.environ.update(self.env)  # the mount's credentials and endpoint, as the trainer's
        self.mnt = work / "mnt-s3"
        self.mnt.mkdir(exist_ok=True)
        # The mount refuses a prefix with no object under it (a mistyped
        # prefix looks just like that), so the run's prefix gets a README.
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/README", Body=b"demo training run\n")
        print(f"   S3 server at {self.server.endpoint}; s3://{self.bucket}/{self.prefix}/ holds only a README",
              flush=True)
        try:
            run(ckptfs, "mount", self.url, str(self.mnt), "--rescan-ms", "500", "--log-file", str(work / "ckptfs-s3.log"))
        except BaseException:
            self.server.stop()
            raise

    def watch(self, wanted: list[int]) -> None:
        """From now on, a thread notes when each wanted step first shows in
        the mount (its consolidated/ weights), and whether boto3 then finds
        its .metadata in the bucket: ``self.seen[n] = (time, committed)``.
        Asked after the step showed, so False means it showed before its
        commit (.metadata is never taken away once a save put it there)."""
        self.seen: dict[int, tuple[float, bool]] = {}
        self.stop = threading.Event()

        def poll() -> None:
            while not self.stop.is_set() and len(self.seen) < len(wanted):
                for n in wanted:
                    if n not in self.seen and (self.mnt / f"step_{n}" / "consolidated" / "model.safetensors").exists():
                        seen = time.time()
                        self.seen[n] = (seen, self.committed(n))
                self.stop.wait(0.02)

        threading.Thread(target=poll, daemon=True).start()

    def committed(self, step_no: int) -> bool:
        """Whether the step's .metadata (the DCP commit point) is in the bucket, asked with boto3."""
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}/step_{step_no}/.metadata")
        return any(o["Key"].endswith("/.metadata") for o in listed.get("Contents", []))

    def close(self) -> None:
        if hasattr(self, "stop"):
            self.stop.set()
        unmount(self.mnt)
        self.server.stop()


def wait_for(view: Path, trainer: threading.Thread, what: str) -> bool:
    """Polls until ``view`` exists; False (said why) if training ended first."""
    while not view.exists():
        if not trainer.is_alive() and not view.exists():
            print(f"   {what}: the trainer stopped before it appeared: {trainer.errors}", file=sys.stderr)
            return False
        time.sleep(0.02)
    return True


def appeared(refs: Path, saved: str, seen: float, waited: bool) -> str:
    saved_file = refs / saved
    if waited and saved_file.exists():
        return f"appeared {max(0.0, seen - float(saved_file.read_text())):.2f} s after its save returned"
    return "was already there when the eval got to it"


def eval_local(mnt: Path, refs: Path, trainer: threading.Thread, n: int) -> int | None:
    """The step from the local mount: fp32 and bf16; failures, or None if it never came."""
    view = mnt / f"step_{n}" / "consolidated" / "model.safetensors"
    waited = not view.exists()
    if not wait_for(view, trainer, f"step_{n}"):
        return None
    when = appeared(refs, f"step_{n}.saved", time.time(), waited)
    same = evaluate(mnt, refs, n)
    print(f"   eval: step_{n}/consolidated/ {when}; transformers logits equal the trained model's: {same}",
          flush=True)
    same_bf16 = evaluate_bf16(mnt, refs, n)
    print(f"   eval: step_{n}/consolidated.bf16/ (cast on read) gives transformers' own bf16 logits: {same_bf16}",
          flush=True)
    return (not same) + (not same_bf16)


def eval_s3(s3: ObjectStorage, refs: Path, trainer: threading.Thread, n: int) -> int | None:
    """The step from the S3 mount, once its save to s3:// committed: when it
    showed (s3.watch) against when its save returned, whether its .metadata
    was in the bucket then, and the logits transformers gets from it."""
    saved_file = refs / f"step_{n}.s3saved"  # written once the save returned
    ended = None
    while n not in s3.seen or not saved_file.exists():
        if ended is None and not trainer.is_alive():
            ended = time.monotonic()
        if ended is not None and time.monotonic() - ended > 2:  # the mount rescans every 0.5 s
            print(f"   s3 step_{n}: the trainer stopped before it appeared: {trainer.errors}", file=sys.stderr)
            return None
        time.sleep(0.02)
    seen, committed = s3.seen[n]
    saved = float(saved_file.read_text())
    lag = seen - saved
    when = f"appeared {abs(lag):.2f} s {'after' if lag >= 0 else 'before'} its save returned"
    same = evaluate(s3.mnt, refs, n)
    print(f"   eval: {s3.url}/step_{n}/consolidated/ {when}; its .metadata was in the bucket when it "
          f"appeared (boto3): {committed}; transformers logits equal the trained model's: {same}", flush=True)
    return (not committed) + (not same)


def eval_loop(mnt: Path, s3: ObjectStorage, refs: Path, trainer: threading.Thread, wanted: list[int]) -> int:
    failures = 0
    for n in wanted:
        for evaluate_step in (lambda: eval_local(mnt, refs, trainer, n), lambda: eval_s3(s3, refs, trainer, n)):
            failed = evaluate_step()
            if failed is None:
                return failures + 1
            failures += failed
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="where the training root goes (default: a new temp dir)")
    ap.add_argument("--steps", type=int, default=9, help="training steps (default 9)")
    ap.add_argument("--save-every", type=int, default=3, help="save a checkpoint every K steps (default 3)")
    ap.add_argument("--keep-mounted", action="store_true",
                    help="leave the local mount up for exploring (the S3 server and its mount stop at the end)")
    args = ap.parse_args()

    ckptfs = os.environ.get("CKPTFS_BIN", str(ROOT / "build" / "ckptfs"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptfs-demo-"))
    root, mnt, refs = work / "run1", work / "mnt", work / "refs"
    for d in (root, mnt, refs):
        d.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CKPTFS_INDEX_DIR", str(work / "index"))

    step("1. a local S3 server starts; ckptfs mounts the (empty) training root and the run's prefix in the "
         "bucket; both watch for new steps")
    subprocess.run(["fusermount3", "-u", "-q", str(mnt)], check=False)
    s3 = ObjectStorage(ckptfs, work)
    try:
        run(ckptfs, "mount", str(root), str(mnt), "--log-file", str(work / "ckptfs.log"))
    except BaseException:
        s3.close()
        raise
    try:
        step(f"2. training on 2 gloo ranks, a checkpoint every {args.save_every} steps into {root}, "
             f"then the same step straight to {s3.url}/step_N with StorageWriter(\"s3://...\")")
        wanted = list(range(args.save_every, args.steps + 1, args.save_every))
        s3.watch(wanted)
        trainer = train_in_background(root, s3, refs, args.steps, args.save_every)
        step("3. eval loads each new step from MNT/step_N/consolidated/ as it appears, "
             "then from the S3 mount once its upload commits")
        failures = eval_loop(mnt, s3, refs, trainer, wanted)
        trainer.join()
        if trainer.errors:
            print(f"training failed: {trainer.errors[0]}", file=sys.stderr)
            failures += 1
        run("ls", "-l", str(mnt / f"step_{wanted[-1]}" / "consolidated"))
        step("4. every chunk of the last step, local and in the bucket, re-read against the CRC32C its "
             "writer recorded")
        run(ckptfs, "verify", str(root / f"step_{wanted[-1]}"))
        run(ckptfs, "verify", f"{s3.url}/step_{wanted[-1]}")
        print(f"\n   the mounts' logs: {work / 'ckptfs.log'}, {work / 'ckptfs-s3.log'}")
        if failures:
            print("DEMO FAILED", file=sys.stderr)
            return 1
        print("\nDemo passed." + (f" Mounted at {mnt}; unmount with: fusermount3 -u {mnt}" if args.keep_mounted else ""))
        return 0
    finally:
        s3.close()
        if not args.keep_mounted:
            unmount(mnt)


if __name__ == "__main__":
    sys.exit(main())
