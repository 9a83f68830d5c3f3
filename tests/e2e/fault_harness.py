"""Random-range readers, an mmap reader and source mutators for the fault
tests (test_faults.py).

Readers pread random ranges of a mount's virtual files and compare every
byte they get with an oracle (the file's bytes before any fault, themselves
checked against the original tensors). A read either returns exactly the
oracle's bytes or fails with EIO; anything else is counted as a failure:
wrong bytes (``zero_filled`` when the wrong bytes are all zeros), another
errno, or a short read (virtual files never change size while mounted).

mmap reads run in a child process: a page the daemon cannot serve faults
with SIGBUS, which would kill the test process. A child killed by SIGBUS
counts as that read's EIO and is replaced.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Stats:
    reads: int = 0
    ok: int = 0
    eio: int = 0
    short: int = 0
    wrong: int = 0
    zero_filled: int = 0
    other_errno: dict = field(default_factory=dict)
    mmap_reads: int = 0
    mmap_ok: int = 0
    mmap_sigbus: int = 0
    mmap_other: int = 0
    examples: list = field(default_factory=list)

    def add(self, other: "Stats") -> None:
        for name in ("reads", "ok", "eio", "short", "wrong", "zero_filled", "mmap_reads",
                     "mmap_ok", "mmap_sigbus", "mmap_other"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.other_errno.items():
            self.other_errno[k] = self.other_errno.get(k, 0) + v
        self.examples.extend(other.examples[:5 - len(self.examples)])

    def failures(self) -> int:
        return (self.short + self.wrong + sum(self.other_errno.values())
                + self.mmap_other)

    def line(self) -> str:
        other = {errno.errorcode.get(k, k): v for k, v in self.other_errno.items()}
        return (f"reads={self.reads} ok={self.ok} eio={self.eio} wrong={self.wrong} "
                f"zero_filled={self.zero_filled} short={self.short} other_errno={other} "
                f"mmap_reads={self.mmap_reads} mmap_ok={self.mmap_ok} "
                f"mmap_sigbus={self.mmap_sigbus} mmap_other={self.mmap_other}")


def judge(st: Stats, got: bytes, want: bytes, err: int | None, what: str) -> None:
    """Counts one read: ``got`` (possibly short) then ``err`` (None if none)."""
    st.reads += 1
    if got != want[:len(got)]:
        st.wrong += 1
        zero = got.count(0) == len(got)
        st.zero_filled += zero
        if len(st.examples) < 5:
            at = next(i for i in range(len(got)) if got[i] != want[i])
            st.examples.append(f"{what}: {'zero-filled' if zero else 'wrong'} bytes "
                               f"from +{at}: got {got[at:at + 16].hex()} "
                               f"want {want[at:at + 16].hex()}")
    elif err == errno.EIO:
        st.eio += 1
    elif err is not None:
        st.other_errno[err] = st.other_errno.get(err, 0) + 1
    elif len(got) < len(want):
        st.short += 1
        if len(st.examples) < 5:
            st.examples.append(f"{what}: short read {len(got)} of {len(want)} bytes")
    else:
        st.ok += 1


def pread_all(fd: int, off: int, n: int) -> tuple[bytes, int | None]:
    """Reads [off, off+n) with as many preads as needed: (bytes, errno)."""
    got = bytearray()
    while len(got) < n:
        try:
            chunk = os.pread(fd, n - len(got), off + len(got))
        except OSError as e:
            return bytes(got), e.errno
        if not chunk:
            break
        got += chunk
    return bytes(got), None


def random_range(rng: random.Random, size: int) -> tuple[int, int]:
    """Mostly small reads (the kernel turns them into page reads and 1 MiB
    readahead), some large, some page-aligned whole pages."""
    pick = rng.random()
    if pick < 0.1:
        off = rng.randrange(0, size, PAGE)
        return off, min(PAGE * rng.randint(1, 4), size - off)
    off = rng.randrange(size)
    cap = 8192 if pick < 0.75 else 256 * 1024
    return off, rng.randint(1, min(cap, size - off))


def reader(paths: list[str], oracle: list[bytes], n: int, seed: int, st: Stats) -> None:
    rng = random.Random(seed)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        for _ in range(n):
            i = rng.randrange(len(fds))
            off, length = random_range(rng, len(oracle[i]))
            got, err = pread_all(fds[i], off, length)
            judge(st, got, oracle[i][off:off + length], err, f"{paths[i]}@{off}+{length}")
    finally:
        for fd in fds:
            os.close(fd)


MMAP_CHILD = r"""
import mmap, os, sys
maps = []
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY)
    maps.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
    os.close(fd)
out = sys.stdout.buffer
out.write(b"R")
out.flush()
for line in sys.stdin.buffer:
    i, off, n = map(int, line.split())
    b = maps[i][off:off + n]
    out.write(len(b).to_bytes(8, "little") + b)
    out.flush()
"""


class MmapReader:
    """Reads ranges through a child's mmap of ``paths``; see the module doc."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.child: subprocess.Popen | None = None

    def start(self) -> None:
        """Starts the child and waits until it has mapped every file."""
        self.child = subprocess.Popen([sys.executable, "-c", MMAP_CHILD, *self.paths],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.child.stdout.read(1) == b"R", "the mmap child could not map the files"

    def read(self, i: int, off: int, n: int) -> tuple[bytes | None, int | None]:
        """(bytes, None), or (None, -signal / exit status) when the child died."""
        if self.child is None:
            self.start()
        try:
            self.child.stdin.write(f"{i} {off} {n}\n".encode())
            self.child.stdin.flush()
            head = self.child.stdout.read(8)
        except BrokenPipeError:
            head = b""
        if len(head) == 8:
            return self.child.stdout.read(int.from_bytes(head, "little")), None
        self.close()
        return None, self.last_rc

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.last_rc = self.child.wait()
            for f in (self.child.stdin, self.child.stdout):
                try:
                    f.close()
                except BrokenPipeError:
                    pass
            self.child = None


def mmap_loop(m: MmapReader, oracle: list[bytes], stop: threading.Event, seed: int,
              st: Stats) -> None:
    rng = random.Random(seed)
    paths = m.paths
    try:
        while not stop.is_set():
            i = rng.randrange(len(paths))
            off, n = random_range(rng, len(oracle[i]))
            got, rc = m.read(i, off, n)
            st.mmap_reads += 1
            if got is None:
                if rc == -signal.SIGBUS:
                    st.mmap_sigbus += 1
                else:
                    st.mmap_other += 1
                    if len(st.examples) < 5:
                        st.examples.append(f"mmap child of {paths[i]} ended with {rc}")
            elif got == oracle[i][off:off + n]:
                st.mmap_ok += 1
            else:
                st.wrong += 1
                st.zero_filled += got.count(0) == len(got)
                if len(st.examples) < 5:
                    st.examples.append(f"mmap {paths[i]}@{off}+{n}: wrong bytes")
    finally:
        m.close()


def evictor(paths: list[str], stop: threading.Event, period: float = 0.02) -> None:
    """Drops the virtual files' clean cached pages now and then, so that
    reads keep reaching the daemon instead of the page cache."""
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        while not stop.wait(period):
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        for fd in fds:
            os.close(fd)


def run_reads(paths: list[str], oracle: list[bytes], total: int, threads: int, seed: int,
              mmap: bool = True, timeout: float = 300.0) -> Stats:
    """``threads`` readers doing ``total`` preads in all, an mmap reader and
    an evictor alongside until they finish; returns the merged counts."""
    per = [Stats() for _ in range(threads + 1)]
    stop = threading.Event()
    workers = [threading.Thread(target=reader, args=(paths, oracle, total // threads,
                                                     seed * 1000 + t, per[t]))
               for t in range(threads)]
    side = [threading.Thread(target=evictor, args=(paths, stop))]
    if mmap:
        m = MmapReader(paths)
        m.start()  # before the readers: python's start-up is slow on a busy machine
        side.append(threading.Thread(target=mmap_loop,
                                     args=(m, oracle, stop, seed, per[threads])))
    for t in workers + side:
        t.start()
    deadline = time.monotonic() + timeout
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    for t in side:
        t.join()
    assert not any(t.is_alive() for t in workers), (
        f"readers still running after {timeout:g} s")
    out = Stats()
    for s in per:
        out.add(s)
    return out
