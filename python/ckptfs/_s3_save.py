"""``StorageWriter("s3://BUCKET/PREFIX/STEP")``: the object-storage side of
``ckptfs.torch.StorageWriter`` (docs/WRITER.md, "Object storage").

Each rank uploads one ``__R_0.distcp`` as an S3 multipart upload whose
parts go straight from the ring (``_writer.S3Stager``), then completes it.
The step becomes visible only through its ``.metadata``, PUT by the
coordinator after every rank's upload completed, and the commit record
``.ckptfs/commit.sst`` after it. Before the coordinator commits, the ranks
exchange an ok/error flag (``all_gather_object`` inside ``write_data``), so
a failure on any rank (an upload that exhausted its retries, an exception,
an interrupt, a rank that died) is seen by every rank, which then raises
it: the failed save's open multipart uploads of rank files under the step
are aborted, its completed rank files deleted, and no ``.metadata`` or
record is written. An earlier step under the same prefix is never touched.

Configuration is ``ckptfs mount s3://``'s (AWS_* environment, profiles,
endpoint, CA bundle, path style: source/s3_config.h).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch.distributed as dist

from ckptfs import _writer

# The rank files a save of this writer uploads (torch's DCP names).
RANK_FILE = re.compile(r"__\d+_\d+\.distcp$")
_log = logging.getLogger("ckptfs")
# Per-item room for torch.save framing when estimating a file's size for
# its part size (the framing is a few hundred bytes to a few KiB).
FRAMING_ALLOWANCE = 64 << 10


def split_url(url: str) -> tuple[str, str]:
    """``s3://b/run/step_1`` -> (``s3://b/run``, ``step_1``): the root the
    commit record is written for, and the step's directory under it."""
    rest = url[len("s3://"):].rstrip("/")
    bucket, _, key = rest.partition("/")
    if not bucket or not key:
        raise ValueError(f"ckptfs StorageWriter: {url!r} names no prefix to save under; "
                         "use s3://BUCKET/PREFIX/STEP")
    parent, _, step = key.rpartition("/")
    return f"s3://{bucket}" + (f"/{parent}" if parent else ""), step


class S3Target:
    """Where a save goes on S3, and the few whole-object calls of its
    protocol. The client is made on first use in each process (it is not
    picklable; torch may copy the writer)."""

    def __init__(self, url: str, *, part_size: int, max_threads: int, endpoint_url: str | None,
                 region: str | None, force_path_style: bool):
        self.url = url.rstrip("/")
        self.root, self.dir = split_url(self.url)
        self.part_size, self.max_threads = part_size, max_threads
        self.options = dict(endpoint_url=endpoint_url or "", region=region or "", force_path_style=force_path_style)
        self._client = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}

    @property
    def client(self):
        if self._client is None:
            self._client = _writer.S3Client(self.root, **self.options)
        return self._client

    def key(self, name: str) -> str:
        return f"{self.client.prefix}{self.dir}/{name}"

    def uncommit(self, commit_record: str, metadata: str) -> None:
        """An earlier save's record and .metadata go first; then open uploads
        of rank files a crashed save left under the step (ours by name)."""
        self.client.delete(self.key(commit_record))
        self.client.delete(self.key(metadata))
        self.abort_rank_uploads()

    def abort_rank_uploads(self) -> None:
        for key, upload_id in self.client.list_multipart_uploads(self.key("")):
            if RANK_FILE.search(key) and "/" not in key[len(self.key("")):]:
                self.client.abort_multipart_upload(key, upload_id)

    def put(self, name: str, data: bytes) -> None:
        self.client.put(self.key(name), data)

    def discard(self, name: str) -> None:
        """Best effort, after a failure whose own error is being raised."""
        try:
            self.client.delete(self.key(name))
        except Exception:
            pass

    def commit(self, tensors: list, chunks: list, byte_items: list, format: str) -> dict:
        return _writer.commit_s3(self.client, self.dir, tensors, chunks, byte_items, format=format)


def _acquire_s3_stager(target: S3Target, part_bytes: int, ring_bytes: int, zip_crc32: bool):
    """A pooled S3 stager (ring of parts, upload threads) for this target's
    configuration; keyed like the POSIX ones (ckptfs.torch's pool)."""
    from ckptfs import torch as ct
    buffers = max(2, ring_bytes // part_bytes)
    key = ("s3", target.root, tuple(sorted(target.options.items())), part_bytes, buffers, target.max_threads, zip_crc32)
    with ct._STAGERS_LOCK:
        free = ct._FREE_STAGERS.setdefault(key, [])
        if free:
            return key, free.pop()
    stager = _writer.S3Stager(target.client, part_bytes=part_bytes, buffers=buffers,
                              upload_threads=target.max_threads, zip_crc32=zip_crc32)
    with ct._STAGERS_LOCK:
        ct._ALL_STAGERS.add(stager)
    return key, stager


def make_rank_file_class(base, rank_file):
    """_S3RankFile over ckptfs.torch's _StagedFile (``base``), with
    _RankFile's (``rank_file``) items and results: the same archives,
    uploaded. Made here so ckptfs.torch keeps its classes where they are."""

    class _S3RankFile(base):
        """A rank's ``__R_0.distcp`` as one multipart upload. Items are
        collected first: the part size follows from the file's size
        (at most 10,000 parts), and the stager from the part size."""

        def __init__(self, target: S3Target, name: str, ring_bytes: int, zip_crc32: bool):
            self.name = name
            self.target, self.ring_bytes, self.zip_crc32 = target, ring_bytes, zip_crc32
            self.stager_key, self.stager, self.file = None, None, None
            self.items: list[tuple[Any, int, Any]] = []
            self.devices: set[tuple[int, int]] = set()
            self._pending: list[tuple[Any, Any]] = []
            self.completed = False

        def add(self, write_item, data) -> None:
            self._pending.append((write_item, data))

        def seal(self) -> None:
            estimate = sum(FRAMING_ALLOWANCE + _nbytes(d) for _, d in self._pending)
            part = _writer.part_bytes_for(estimate, self.target.part_size)
            self.stager_key, self.stager = _acquire_s3_stager(self.target, part, self.ring_bytes, self.zip_crc32)
            self.file = _writer.S3DcpFile(self.stager, self.target.key(self.name))
            for write_item, data in self._pending:
                rank_file.add(self, write_item, data)
            self._pending.clear()
            self.file.seal()

        _result = rank_file._result

        def finish(self) -> list:
            written = self.file.finish()
            key, upload_id, check, parts = self.file.upload
            if upload_id:
                self.target.client.complete_multipart_upload(key, upload_id, parts, check)
            self.completed = True
            from ckptfs import torch as ct
            ct._release_stager(self.stager_key, self.stager)
            self.stager, self.file = None, None
            out = [self._result(wi, w) for (wi, _, _), w in zip(self.items, written)]
            self.items.clear()
            return out

        def abandon(self) -> None:
            """After a failure: the upload aborted, then the stager closed."""
            if self.file is not None:
                try:
                    self.file.abort()
                except Exception:  # the save's own error is what is raised
                    pass
            base.abandon(self)

    return _S3RankFile


def _nbytes(data) -> int:
    if isinstance(data, memoryview):
        return data.nbytes
    if hasattr(data, "getbuffer"):
        return data.getbuffer().nbytes
    if hasattr(data, "numel"):
        return data.numel() * data.element_size()
    return len(data)


def agree_or_raise(target: S3Target, rank: int, files: list, error: BaseException | None) -> None:
    """Every rank's ok/error flag, exchanged before the coordinator may
    commit; a failure anywhere is raised on every rank after the save's
    uploads are cleaned up (open ones aborted, completed ones deleted)."""
    failures: list[tuple[int, str]] = []
    exchange_error: BaseException | None = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        flags: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(flags, None if error is None else f"{type(error).__name__}: {error}")
            failures = [(r, f) for r, f in enumerate(flags) if f is not None]
        except BaseException as e:  # a rank died or the group broke: nothing may be committed
            exchange_error = e
    elif error is not None:
        failures = [(rank, f"{type(error).__name__}: {error}")]
    if not failures and exchange_error is None:
        return
    _discard(target, files)
    if error is not None:
        raise error
    if exchange_error is not None:
        cause = RuntimeError(f"ckptfs StorageWriter: the ranks could not agree that every upload of {target.url} "
                             f"completed ({exchange_error}); the save is not committed and its uploads were "
                             "discarded")
    else:
        where = "; ".join(f"rank {r}: {f}" for r, f in failures)
        cause = RuntimeError(f"ckptfs StorageWriter: the save to {target.url} failed on another rank ({where}); "
                             "nothing was committed and this rank's upload was discarded")
    # Logged too: with a peer gone, torch's own collective after write_data
    # fails next and its error is the one the rank exits with.
    _log.error("%s", cause)
    raise cause from exchange_error


def _discard(target: S3Target, files: list) -> None:
    """This rank's completed rank files deleted, every open upload of a rank
    file under the step aborted (a dead rank's included); best effort."""
    for f in files:
        try:
            if getattr(f, "completed", False):
                target.client.delete(target.key(f.name))
            else:
                f.abandon()
        except Exception:
            pass
    try:
        target.abort_rank_uploads()
    except Exception:
        pass
