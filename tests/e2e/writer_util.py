"""Helpers for the writer end-to-end tests: an independent CRC32C, the
bytes a row points at, which chunk a byte of a file belongs to, and
`ckptfs verify` checking every chunk a writer recorded."""

from __future__ import annotations

import json
import os

from harness import run_ckptfs


def _table() -> list[int]:
    t = []
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        t.append(c)
    return t


_T = _table()


def crc32c(data: bytes) -> int:
    """CRC32C by its definition (byte-wise table), independent of ckptfs."""
    c = 0xFFFFFFFF
    for b in data:
        c = (c >> 8) ^ _T[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


def chunk_bytes(root: str, chunk: dict) -> bytes:
    """The bytes a row's chunk points at (``file`` relative to ``root``)."""
    with open(os.path.join(root, chunk["file"]), "rb") as f:
        f.seek(chunk["offset"])
        return f.read(chunk["length"])


def chunk_at(rows: dict, file: str, offset: int) -> tuple[str, dict] | None:
    """(fqn, chunk) of the row whose bytes hold byte ``offset`` of ``file``
    (a path as the rows spell it), or None when the byte is framing."""
    for t in rows["tensors"]:
        for c in t["chunks"]:
            if c["file"] == file and c["offset"] <= offset < c["offset"] + c["length"]:
                return t["fqn"], c
    return None


def assert_verify_checks_every_chunk(root: str, rows: dict, index_dir: str) -> dict:
    """`ckptfs verify --json root` exits 0 with no problem and no warning, and
    checks one CRC32C per chunk of the writer's ``rows`` (counted from the
    rows, not from ckptfs). Returns the report."""
    p = run_ckptfs("verify", root, "--json", index_dir=index_dir, text_stdout=True)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["problems"] == [] and report["warnings"] == [], report
    assert report["checksummed_chunks"] == sum(len(t["chunks"]) for t in rows["tensors"]), report
    return report
