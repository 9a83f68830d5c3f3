"""Source faults under concurrent reads: no wrong byte, ever.

A sharded safetensors checkpoint (np_ckpt.FAULT_SPECS over 4 rank files,
random bytes without zeros) is mounted; 8 threads pread random ranges of
``consolidated/model.safetensors`` and every ``tensors/*.npy`` (plus a child
reading through mmap) while a mutator cycles over the shard files with one
kind of fault. Each kind runs on its own fresh copy and mount (a changed
source reads as EIO until re-indexed, so one kind would mask the next),
with reads before the first fault and during the faults.

The oracle of each virtual file is its bytes read once before any fault,
checked against the original tensors with the safetensors package / numpy
(np_ckpt.check_virtual). Every successful read must equal the oracle; a
failed one must be EIO (fault_harness.judge).

Sizes (env): CKPTFS_FAULT_READS preads per fault kind (default 20000, so
the 5 kinds make 10^5), CKPTFS_FAULT_THREADS readers (default 8),
CKPTFS_FAULT_ROUNDS fresh mounts per kind (default 3; the reads are split
over them). A shard's first fault in a mount is the one that can race with
reads in flight (later reads of it fail before reaching the file), so each
round adds one such window per shard.
"""

from __future__ import annotations

import abc
import errno
import os
import random
import shutil
import threading
import time

import pytest

import fault_harness as fh
import harness
import np_ckpt
from _util import read_pages, run_ckptfs, describe

READS = int(os.environ.get("CKPTFS_FAULT_READS", "20000"))
THREADS = int(os.environ.get("CKPTFS_FAULT_THREADS", "8"))
ROUNDS = int(os.environ.get("CKPTFS_FAULT_ROUNDS", "3"))
BEFORE_SHARE = 0.25  # of each round's reads, done before the first fault


# ---------------------------------------------------------------------------
# the pristine checkpoint and its oracle
# ---------------------------------------------------------------------------


def _read_whole(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(Synth, {rel: oracle bytes}): written once; the oracle is read through
    one mount and checked against the original tensors."""
    base = tmp_path_factory.mktemp("faults")
    synth = np_ckpt.write(str(base / "pristine"), world_size=4, seed=11)
    oracle = {}
    with harness.Mounted(synth.path, base_dir=str(base)) as m:
        for rel in np_ckpt.virtual_files(synth):
            data = _read_whole(m.p(rel))
            np_ckpt.check_virtual(rel, data, synth)
            oracle[rel] = data
    return synth, oracle


# ---------------------------------------------------------------------------
# the faults: each changes one shard file, waits, and restores it
# ---------------------------------------------------------------------------


def _write_at(path: str, off: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


class Fault(abc.ABC):
    """One kind of fault on a shard file: ``apply`` breaks it, ``undo``
    gives it back its original bytes (its identity may stay changed).
    ``orig`` is the file's bytes, ``st0`` its stat before; ``spare`` is a
    directory on the same file system, outside the checkpoint."""

    @abc.abstractmethod
    def apply(self, path: str, orig: bytes, st0, spare: str) -> None:
        """Breaks the file."""

    @abc.abstractmethod
    def undo(self, path: str, orig: bytes, st0, spare: str) -> None:
        """Gives it its original bytes back."""


class Truncate(Fault):
    """Truncated to half; undone by writing the missing half back."""

    def apply(self, path, orig, st0, spare):
        os.truncate(path, len(orig) // 2)

    def undo(self, path, orig, st0, spare):
        half = len(orig) // 2
        _write_at(path, half, orig[half:])


class RewriteSameMtime(Fault):
    """Same size, every data byte changed, mtime set back (as rsync or a
    restore tool does); undone with the original bytes and mtime."""

    def apply(self, path, orig, st0, spare):
        start = np_ckpt.data_start(path)
        _write_at(path, start, np_ckpt.rewritten(orig, start)[start:])
        os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns))

    def undo(self, path, orig, st0, spare):
        start = np_ckpt.data_start(path)
        _write_at(path, start, orig[start:])
        os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns))


class RewriteNewMtime(Fault):
    def apply(self, path, orig, st0, spare):
        start = np_ckpt.data_start(path)
        _write_at(path, start, np_ckpt.rewritten(orig, start)[start:])

    def undo(self, path, orig, st0, spare):
        start = np_ckpt.data_start(path)
        _write_at(path, start, orig[start:])


class RenameOver(Fault):
    """A same-size file with other data bytes and the original's mtime is
    renamed over the shard (atomically: the original stays linked aside);
    undone by renaming the original back."""

    def apply(self, path, orig, st0, spare):
        decoy = os.path.join(spare, "decoy")
        with open(decoy, "wb") as f:
            f.write(np_ckpt.rewritten(orig, np_ckpt.data_start(path)))
        os.utime(decoy, ns=(st0.st_atime_ns, st0.st_mtime_ns))
        os.link(path, os.path.join(spare, "aside"))
        os.rename(decoy, path)

    def undo(self, path, orig, st0, spare):
        os.rename(os.path.join(spare, "aside"), path)


class DeleteRestore(Fault):
    """Deleted; undone by writing it again byte for byte with its mode and
    mtime (a new inode)."""

    def apply(self, path, orig, st0, spare):
        os.unlink(path)

    def undo(self, path, orig, st0, spare):
        with open(path, "wb") as f:
            f.write(orig)
        os.chmod(path, st0.st_mode & 0o7777)
        os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns))


FAULTS = {
    "truncate": Truncate(),
    "rewrite_same_mtime": RewriteSameMtime(),
    "rewrite_new_mtime": RewriteNewMtime(),
    "rename_over": RenameOver(),
    "delete_restore": DeleteRestore(),
}
# Every kind changes the shard's bytes at its path or its identity (size,
# mtime, ctime, inode) from what was indexed, so some reads must fail. A
# kind whose reads all succeed would mean the fault went unnoticed.


class Mutator(threading.Thread):
    """Cycles ``fault`` over the shard files of ``synth`` until stopped;
    every fault is undone before the next starts and before the thread ends."""

    def __init__(self, synth: np_ckpt.Synth, fault, spare: str, seed: int):
        super().__init__()
        self.synth, self.fault, self.spare = synth, fault, spare
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.applied = threading.Event()  # set once the first fault is in place
        self.done = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            paths = [self.synth.shard(r) for r in range(self.synth.world_size)]
            orig = [_read_whole(p) for p in paths]
            st0 = [os.stat(p) for p in paths]
            r = 0
            self.stop.wait(self.rng.uniform(0.05, 0.2))  # let the readers get going
            while not self.stop.is_set():
                self.fault.apply(paths[r], orig[r], st0[r], self.spare)
                self.applied.set()
                time.sleep(self.rng.uniform(0.002, 0.03))
                self.fault.undo(paths[r], orig[r], st0[r], self.spare)
                self.done += 1
                r = (r + 1) % len(paths)
                self.stop.wait(self.rng.uniform(0.005, 0.05))
        except BaseException as e:  # reported by the test
            self.error = e


# ---------------------------------------------------------------------------
# the harness
# ---------------------------------------------------------------------------


def _round(kind: str, pristine, base: str, rnd: int, reads: int):
    """One fresh copy + mount: reads before any fault, then reads while the
    mutator runs. Returns (before Stats, during Stats, faults done)."""
    synth, oracle = pristine
    work = os.path.join(base, f"{kind}-{rnd}")
    os.makedirs(work)
    copy = np_ckpt.Synth(shutil.copytree(synth.path, os.path.join(work, "ckpt")),
                         synth.world_size, synth.specs, synth.tensors, synth.chunks)
    rels = list(oracle)
    want = [oracle[r] for r in rels]
    with harness.Mounted(copy.path, base_dir=work) as m:
        paths = [m.p(r) for r in rels]
        for p, w in zip(paths, want):
            assert _read_whole(p) == w, f"{p}: a fresh mount of the same checkpoint differs"
        n_before = int(reads * BEFORE_SHARE)
        before = fh.run_reads(paths, want, n_before, THREADS, seed=rnd * 2 + 1)
        mut = Mutator(copy, FAULTS[kind], work, seed=rnd)
        mut.start()
        try:
            # Reads of cached pages are fast: on a busy machine they could all
            # be over before the mutator's first fault without this.
            assert mut.applied.wait(30), f"the {kind} mutator never applied a fault"
            during = fh.run_reads(paths, want, reads - n_before, THREADS, seed=rnd * 2 + 2)
        finally:
            mut.stop.set()
            mut.join()
        assert mut.error is None, f"the {kind} mutator failed: {mut.error!r}"
        log = m.log()
    return before, during, mut.done, log


@pytest.mark.parametrize("kind", list(FAULTS))
def test_fault_harness(kind, pristine, tmp_path):
    before, during = fh.Stats(), fh.Stats()
    faults = 0
    for rnd in range(ROUNDS):
        b, d, n, log = _round(kind, pristine, str(tmp_path), rnd, READS // ROUNDS)
        before.add(b)
        during.add(d)
        faults += n
    print(f"\n[{kind}] faults={faults} threads={THREADS} rounds={ROUNDS}\n"
          f"  before: {before.line()}\n  during: {during.line()}")
    assert before.ok == before.reads and before.mmap_ok == before.mmap_reads, (
        f"reads before any fault must all succeed: {before.line()}\n" + "\n".join(before.examples))
    assert during.wrong == 0 and during.zero_filled == 0, (
        f"{kind}: wrong bytes served: {during.line()}\n" + "\n".join(during.examples))
    assert during.failures() == 0, (
        f"{kind}: a failed read must be EIO: {during.line()}\n" + "\n".join(during.examples))
    # each thread does its share rounded down: at most THREADS reads short per phase
    assert before.reads + during.reads >= READS - 2 * THREADS * ROUNDS
    assert before.reads > 0 and faults >= 1, f"the {kind} mutator never ran"
    assert during.eio + during.mmap_sigbus > 0, (
        f"{kind}: no read failed although a source changed: {during.line()}\n"
        f"daemon log tail:\n{log[-2000:]}")


# ---------------------------------------------------------------------------
# page cache
# ---------------------------------------------------------------------------


def _pages_in(ranges: list[tuple[int, int]], page: int = fh.PAGE) -> set[int]:
    """Offsets of the pages lying wholly inside one of ``ranges``."""
    out = set()
    for lo, hi in ranges:
        first = -(-lo // page) * page
        out.update(range(first, hi - page + 1, page))
    return out


def _check_pages(pages, oracle: bytes, what: str) -> set[int]:
    """Asserts every page read is EIO or the oracle's bytes; returns the
    offsets of the failed pages."""
    failed = set()
    for pr in pages:
        if pr.data is None:
            assert pr.err == errno.EIO, f"{what}: page {pr.offset} failed with {pr.err}"
            failed.add(pr.offset)
        else:
            want = oracle[pr.offset:pr.offset + fh.PAGE]
            assert len(pr.data) == len(want), f"{what}: page {pr.offset} read short"
            assert pr.data == want, (
                f"{what}: page {pr.offset} holds bytes that are not the indexed ones"
                + (" (all zeros)" if pr.data.count(0) == len(pr.data) else ""))
    return failed


def _wait_eio(path: str, oracle: bytes, pages: set[int], within: float, what: str,
              log) -> None:
    """Re-reads ``path`` page by page until every page in ``pages`` fails
    with EIO; asserts that this happens within ``within`` seconds and that
    every page read meanwhile is EIO or the oracle's bytes."""
    t0 = time.monotonic()
    while True:
        failed = _check_pages(read_pages(path), oracle, what)
        if pages <= failed:
            return
        assert time.monotonic() - t0 < within, (
            f"{what}: {within:g} s later, {len(pages - failed)} of the {len(pages)} pages "
            f"built from the changed shard still read the indexed bytes (page cache) "
            f"instead of EIO\nlog: {log()[-1500:]}")
        time.sleep(0.05)


def _row_ckpt(tmp_path) -> tuple[np_ckpt.Synth, int]:
    """A 3-rank checkpoint of dim-0 splits, and the rank whose shard the
    page-cache tests change (its chunks are whole pages of the consolidated
    file, in the middle of each tensor)."""
    return np_ckpt.write(str(tmp_path / "ckpt"), world_size=3, specs=np_ckpt.ROW_SPECS,
                         seed=5), 1


def _reindexed_reads_right(synth: np_ckpt.Synth, oracle: bytes, base: str) -> None:
    r = run_ckptfs("index", synth.path)
    assert r.returncode == 0, describe(r)
    with harness.Mounted(synth.path, base_dir=base) as m:
        assert _read_whole(m.p("consolidated/model.safetensors")) == oracle


@pytest.mark.parametrize("kind", list(FAULTS))
def test_page_cache_after_fault_and_restore(kind, tmp_path):
    """The consolidated file is read whole (cached); a fault on one shard
    makes every page built from it EIO within 2 s (never the cached indexed
    bytes, never the fault's bytes); once the shard is restored byte for
    byte, pages read EIO or the right bytes; after `ckptfs index` all of it
    reads right again."""
    synth, rank = _row_ckpt(tmp_path)
    shard, fault = synth.shard(rank), FAULTS[kind]
    orig, st0 = _read_whole(shard), os.stat(shard)
    spare = str(tmp_path)
    with harness.Mounted(synth.path, base_dir=str(tmp_path)) as m:
        path = m.p("consolidated/model.safetensors")
        oracle = _read_whole(path)
        np_ckpt.check_consolidated(oracle, synth)
        changed = _pages_in(np_ckpt.rank_ranges(oracle, synth, rank))
        assert len(changed) >= 4, "the changed rank must own several whole pages"
        fault.apply(shard, orig, st0, spare)
        _wait_eio(path, oracle, changed, 2.0, f"after {kind}", m.log)
        fault.undo(shard, orig, st0, spare)
        assert _read_whole(shard) == orig
        t1 = time.monotonic()
        while time.monotonic() - t1 < 1.0:
            _check_pages(read_pages(path), oracle, f"after {kind} was undone")
            time.sleep(0.1)
    _reindexed_reads_right(synth, oracle, str(tmp_path))


@pytest.mark.parametrize("kind", list(FAULTS))
def test_restored_source_stays_eio_until_reindex(kind, tmp_path):
    """A shard changed and restored while mounted (its bytes the indexed ones
    again, its mtime, ctime or inode not) is a changed source: the pages
    built from it read EIO, within 2 s even when they were cached, until
    `ckptfs index` runs again (README: a file changed while mounted reads as
    EIO)."""
    synth, rank = _row_ckpt(tmp_path)
    shard, fault = synth.shard(rank), FAULTS[kind]
    orig, st0 = _read_whole(shard), os.stat(shard)
    with harness.Mounted(synth.path, base_dir=str(tmp_path)) as m:
        path = m.p("consolidated/model.safetensors")
        oracle = _read_whole(path)
        np_ckpt.check_consolidated(oracle, synth)
        changed = _pages_in(np_ckpt.rank_ranges(oracle, synth, rank))
        fault.apply(shard, orig, st0, str(tmp_path))
        fault.undo(shard, orig, st0, str(tmp_path))
        assert _read_whole(shard) == orig
        _wait_eio(path, oracle, changed, 2.0, f"after {kind} and its undo", m.log)
    _reindexed_reads_right(synth, oracle, str(tmp_path))
