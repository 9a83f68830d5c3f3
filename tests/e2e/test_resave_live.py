"""A step saved again into the same directory by another writer, on a live
mount (docs/SEMANTICS.md, "Live mounts").

A step saved by ckptfs's StorageWriter (2 ranks: two .distcp files and a
commit record) is saved again with torch's own FileSystemWriter (1 rank:
one .distcp file; the writer's second file and its commit record stay
behind), and the other way round. Readers read every tensor of the step
through ``tensors/<fqn>.npy`` all along. Each read must give the old values,
the new ones or EIO (or, while the new save runs, ENOENT: ckptfs's writer
removes the commit point first, and a step without one is not served),
never anything else; once the new save has been
complete for a few rescans no read may give the old values; and every
tensor must read the new values soon after.

Expected values are the state dicts torch saved (writer_gen's oracles).
"""

from __future__ import annotations

import errno
import io
import os
import threading
import time

import numpy as np
import pytest
import torch

from harness import Mounted, spawn_ranks

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")
RESCAN_MS = 300
SETTLE_S = 3.0      # after the new save returned: ten rescans, then no old value may be served
NEW_WITHIN_S = 30.0  # every tensor reads the new values by then


def _save(kind: str, world: int, seed: int, directory: str, oracle: str) -> dict:
    job = {"kind": kind, "seed": seed, "dir": directory, "oracle": oracle}
    spawn_ranks(GEN, world, job, name=f"{kind} save (seed {seed})")
    full = torch.load(oracle, weights_only=False)
    # tensors/ shows bf16 as f32 (NumPy has no bf16)
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy()
            for k, v in full.items() if isinstance(v, torch.Tensor)}


def _read(path: str):
    """The array at `path`, or the reason it could not be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()  # I/O errors here, parse errors below
    except OSError as e:
        if e.errno == errno.ENOENT:
            return "gone"  # the new save removed the commit point first (ckptfs's writer does)
        return "eio" if e.errno == errno.EIO else f"errno {e.errno}"
    try:
        return np.load(io.BytesIO(data))
    except ValueError as e:  # a file that is no .npy at all
        return f"not npy ({e})"


def _classify(got, old: np.ndarray, new: np.ndarray) -> str:
    if isinstance(got, str):
        return got
    if got.shape == new.shape and np.array_equal(got, new):
        return "new"
    if got.shape == old.shape and np.array_equal(got, old):
        return "old"
    return "other"


class Readers(threading.Thread):
    """Reads every tensor of step_7 in turn until stopped, keeping
    (start time, fqn, array or reason): judged once both saves are known."""

    def __init__(self, mnt: str, fqns: list[str]):
        super().__init__(daemon=True)
        self.mnt, self.fqns = mnt, fqns
        self.stop = threading.Event()
        self.seen: list[tuple[float, str, object]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for fqn in self.fqns:
                t = time.monotonic()
                self.seen.append((t, fqn, _read(os.path.join(self.mnt, "step_7", "tensors", fqn + ".npy"))))


def _wait_all_new(m: Mounted, new: dict, deadline: float) -> None:
    pending = set(new)
    while pending and time.monotonic() < deadline:
        for fqn in sorted(pending):
            if _classify(_read(m.p("step_7", "tensors", fqn + ".npy")), new[fqn], new[fqn]) == "new":
                pending.discard(fqn)
        time.sleep(0.1)
    assert not pending, f"{sorted(pending)[:5]} never read the new values\n{m.log()[-3000:]}"


@pytest.mark.parametrize("first,second", [(("save", 2), ("stock", 1)), (("stock", 1), ("save", 2))],
                         ids=["writer-then-stock", "stock-then-writer"])
def test_resave_serves_the_new_step_never_the_old(tmp_path, first, second):
    root = tmp_path / "run"
    root.mkdir()
    step = str(root / "step_7")
    with Mounted(str(root), "--rescan-ms", str(RESCAN_MS), base_dir=str(tmp_path)) as m:
        old = _save(first[0], first[1], 1, step, str(tmp_path / "old.pt"))
        _wait_all_new(m, old, time.monotonic() + NEW_WITHIN_S)
        readers = Readers(m.path, sorted(old))
        readers.start()
        try:
            new = _save(second[0], second[1], 2, step, str(tmp_path / "new.pt"))
            done = time.monotonic()
            assert set(new) == set(old)
            _wait_all_new(m, new, done + NEW_WITHIN_S)
            time.sleep(1.0)
        finally:
            readers.stop.set()
            readers.join()
        seen = [(t, f, _classify(got, old[f], new[f])) for t, f, got in readers.seen]
        assert any(o == "old" for _, _, o in seen), "the readers never saw the first save"
        late = [(t - done, f, o) for t, f, o in seen if t > done + SETTLE_S and o != "new"]
        assert not late, f"after the re-save settled: {late[:5]}\n{m.log()[-3000:]}"
        # While the new save runs, a writer that removes the commit point
        # first (ckptfs's) makes the step no checkpoint: ENOENT, never later.
        bad = [(f, o) for t, f, o in seen if o not in ("old", "new", "eio") and not (o == "gone" and t <= done)]
        assert not bad, f"reads that were neither old, new, EIO nor (during the save) ENOENT: {bad[:5]}"
