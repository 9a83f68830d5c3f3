"""Shared helpers for the ckptfs end-to-end tests (no pytest fixtures here).

- finding and running the `ckptfs` binary (env CKPTFS_BIN);
- reading and rewriting safetensors headers byte-exactly, to build bad input;
- mounting with a context manager that always unmounts;
- page-by-page reads that record, per page, the bytes or the errno.

Nothing here imports torch: tests that need it pass tensors in as bytes.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import time
from dataclasses import dataclass, field

from harness import (DEFAULT_BIN, ckptfs_bin, describe, is_mounted,  # noqa: F401
                     run_ckptfs, unmount)

PAGE = os.sysconf("SC_PAGE_SIZE")

# Exit codes of the CLI (cli/cli.h, docs/CLI.md).
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NO_SOURCE = 3
EXIT_STALE = 4
EXIT_PROBLEMS = 5
EXIT_READ_ERROR = 6
EXIT_MOUNT_FAILED = 7
EXIT_INDEX_ERROR = 8


# ckptfs_bin, run_ckptfs (bytes stdout, text stderr, index_dir sets
# CKPTFS_INDEX_DIR), describe, is_mounted and unmount come from harness.py.


# ---------------------------------------------------------------------------
# safetensors headers
# ---------------------------------------------------------------------------


def read_header_raw(path: str) -> tuple[int, bytes]:
    """(N, the N header bytes) of a safetensors file, without validating."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, f.read(n)


def read_header(path: str) -> tuple[int, dict]:
    n, raw = read_header_raw(path)
    return n, json.loads(raw)


def header_from_bytes(data: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8:8 + n])


def data_start(path: str) -> int:
    return 8 + read_header_raw(path)[0]


def sharding_info(header: dict) -> dict[str, list[int]]:
    """{fqn: saved_offsets} from __metadata__.DCP_SHARDING_INFO."""
    meta = header.get("__metadata__", {})
    info = json.loads(meta.get("DCP_SHARDING_INFO") or meta.get("dcp_custom_metadata"))
    return {k: v["saved_offsets"] for k, v in info.items()}


def entries(header: dict) -> dict[str, dict]:
    return {k: v for k, v in header.items() if k != "__metadata__"}


def replace_header_text(path: str, text: bytes) -> None:
    """Rewrites `path` with header bytes `text` (padded with spaces to a
    multiple of 8) in front of the file's original data buffer."""
    n, _ = read_header_raw(path)
    with open(path, "rb") as f:
        f.seek(8 + n)
        data = f.read()
    text = text + b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def edit_header_same_length(path: str, old: bytes, new: bytes) -> None:
    """Replaces the one occurrence of `old` in the header by `new` (same
    length), in place: the file keeps its size and data offsets."""
    assert len(old) == len(new), (old, new)
    n, raw = read_header_raw(path)
    assert raw.count(old) == 1, f"{old!r} occurs {raw.count(old)} times in {path}'s header"
    at = 8 + raw.index(old)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(new)


def set_header_length(path: str, n: int) -> None:
    """Overwrites the u64 length prefix with `n`."""
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", n))


# ---------------------------------------------------------------------------
# page-by-page reads
# ---------------------------------------------------------------------------


@dataclass
class PageRead:
    offset: int
    data: bytes | None = None   # None when the read failed
    err: int | None = None      # errno when it failed


def read_pages(path: str, start: int = 0, end: int | None = None,
               page: int = PAGE) -> list[PageRead]:
    """Reads [start, end) one page-aligned page at a time with pread and
    records each page's bytes or errno. One page per call keeps a failure
    confined to the page that holds unreadable bytes (the kernel falls back
    to single-page reads after a failed readahead)."""
    out: list[PageRead] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        if end is None:
            end = os.fstat(fd).st_size
        at = start - start % page
        while at < end:
            lo, hi = max(at, start), min(at + page, end)
            try:
                buf = b""
                while len(buf) < hi - lo:  # a short read is followed by the error
                    chunk = os.pread(fd, hi - lo - len(buf), lo + len(buf))
                    if not chunk:
                        break
                    buf += chunk
                out.append(PageRead(lo, buf))
            except OSError as e:
                out.append(PageRead(lo, None, e.errno))
            at += page
    finally:
        os.close(fd)
    return out


def pread_errno(path: str, offset: int, length: int) -> int | None:
    """errno of one pread, or None when it succeeded."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, length, offset)
        return None
    except OSError as e:
        return e.errno
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# mounting
# ---------------------------------------------------------------------------


@dataclass
class Mount:
    """`with Mount(root, mnt, index, log) as m:` runs `ckptfs mount` (which
    daemonizes once mounted) and always unmounts on exit."""
    root: str
    mnt: str
    index: str
    log_file: str
    extra: list[str] = field(default_factory=list)
    result: subprocess.CompletedProcess | None = None

    def __enter__(self) -> "Mount":
        os.makedirs(self.mnt, exist_ok=True)
        self.result = run_ckptfs("mount", self.root, self.mnt, "--index", self.index,
                                 "--log-file", self.log_file, *self.extra, timeout=120)
        if self.result.returncode != 0:
            unmount(self.mnt)
            raise AssertionError("mount failed\n" + describe(self.result))
        deadline = time.monotonic() + 20
        while not is_mounted(self.mnt):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.mnt} not mounted 20 s after ckptfs mount exited 0")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        unmount(self.mnt)

    def path(self, rel: str) -> str:
        return os.path.join(self.mnt, rel)

    def log(self) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


def eio_name(e: int | None) -> str:
    return "ok" if e is None else errno.errorcode.get(e, str(e))
