"""``StorageWriter("s3://BUCKET/PREFIX/STEP")``: the object-storage side of
``ckptfs.torch.StorageWriter`` (docs/WRITER.md, "Object storage").

Each rank uploads one ``__R_0.distcp`` as an S3 multipart upload whose
parts go straight from the ring (``_writer.S3Stager``), then completes it.
The step becomes visible only through its ``.metadata``, PUT by the
coordinator after every rank's upload completed, and the commit record
``.ckptfs/commit.sst`` after it. With ``layout="hf"`` each rank's
``shard-RRRRR-model-00001-of-00001.safetensors`` is a multipart upload
that the rank does not complete: it hands its parts to the coordinator
(in its WriteResults), which completes every shard at commit, rank 1's
last (until then the step reads as missing rank 1, as on disk), then PUTs
the record. Before the coordinator commits, the ranks
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

import dataclasses
import logging
from typing import Any

import torch.distributed as dist

from ckptfs import _writer
from ckptfs._names import is_hf_shard, is_rank_file, shard_rank

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

    def uncommit(self, commit_record: str, metadata: str, hf: bool = False) -> None:
        """An earlier save's record and .metadata go first; with the HF layout
        then an earlier save's shards (perhaps of more ranks; rank 1's first,
        so the step reads as incomplete at once), as the save into a
        directory removes them; then open uploads of rank files a crashed
        save left under the step (ours by name)."""
        self.client.delete(self.key(commit_record))
        self.client.delete(self.key(metadata))
        if hf:
            shards = [n for n in self.names() if is_hf_shard(n)]
            for name in sorted(shards, key=shard_rank):
                self.client.delete(self.key(name))
        self.abort_rank_uploads()

    def names(self) -> list[str]:
        """The names of the objects right under the step (not in its folders)."""
        at = len(self.key(""))
        return [n for n in (k[at:] for k, _, _ in self.client.list(self.key(""))) if "/" not in n]

    def abort_rank_uploads(self) -> None:
        at = len(self.key(""))
        for key, upload_id in self.client.list_multipart_uploads(self.key("")):
            if is_rank_file(key[at:]):  # a whole name right under the step: no "/" in it
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


def make_rank_file_class(base, rank_file, hf: bool = False):
    """_S3RankFile over ckptfs.torch's _StagedFile (``base``), with the
    items and results of ``rank_file`` (_RankFile: the same archives,
    uploaded; or, with ``hf``, _HfRankFile: the same safetensors shard).
    Made here so ckptfs.torch keeps its classes where they are."""

    class _S3RankFile(base):
        """A rank's ``__R_0.distcp`` (or HF shard) as one multipart upload.
        Items are collected first: the part size follows from the file's
        size (at most 10,000 parts), and the stager from the part size. A
        DCP file is completed by its rank in ``finish``; an HF shard is left
        open, its parts in ``self.upload``, for the coordinator to
        complete at commit (``complete_shards``)."""

        def __init__(self, target: S3Target, name: str, ring_bytes: int, zip_crc32: bool):
            self.name = name
            self.target, self.ring_bytes, self.zip_crc32 = target, ring_bytes, zip_crc32
            self.stager_key, self.stager, self.file = None, None, None
            self.items: list[tuple[Any, int, Any]] = []
            self.devices: set[tuple[int, int]] = set()
            self._pending: list[tuple[Any, Any]] = []
            self.completed = False
            self.upload: tuple = ()  # HF: (key, upload_id, check, parts) once every part is uploaded

        def add(self, write_item, data) -> None:
            self._pending.append((write_item, data))

        def seal(self) -> None:
            estimate = sum(FRAMING_ALLOWANCE + _nbytes(d) for _, d in self._pending)
            part = _writer.part_bytes_for(estimate, self.target.part_size)
            self.stager_key, self.stager = _acquire_s3_stager(self.target, part, self.ring_bytes, self.zip_crc32)
            make = _writer.S3SafetensorsFile if hf else _writer.S3DcpFile
            self.file = make(self.stager, self.target.key(self.name))
            for write_item, data in self._pending:
                rank_file.add(self, write_item, data)
            self._pending.clear()
            if hf:
                rank_file.seal(self)  # lays out the header, opens the upload
                # Parts are contiguous bytes of the object: tensors go in file order.
                begins = self.file.data_begins
                self.items.sort(key=lambda it: begins[it[1]])
            else:
                self.file.seal()

        _result = rank_file._result

        def finish(self) -> list:
            written = self.file.finish()
            key, upload_id, check, parts = self.file.upload
            if hf:
                self.upload = (key, upload_id, check, parts)
            else:
                if upload_id:
                    self.target.client.complete_multipart_upload(key, upload_id, parts, check)
                self.completed = True
            from ckptfs import torch as ct
            ct._release_stager(self.stager_key, self.stager)
            self.stager, self.file = None, None
            out = [self._result(wi, written[item]) for wi, item, _ in self.items]
            self.items.clear()
            if hf and out:  # the coordinator completes the shard: its parts travel with its results
                out[0] = dataclasses.replace(out[0], upload=(self.name, *self.upload))
            return out

        def abandon(self) -> None:
            """After a failure: the upload aborted, then the stager closed."""
            try:
                if self.file is not None:
                    self.file.abort()
                elif self.upload:  # every part uploaded, not completed
                    key, upload_id, _, _ = self.upload
                    self.target.client.abort_multipart_upload(key, upload_id)
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


def complete_shards(target: S3Target, results: list, commit, record: str) -> dict:
    """The HF layout's commit, on the coordinator: every rank's shard upload
    completed in the order the directory layout publishes them (rank 1's
    last: until it lands the step reads as missing rank 1, which no reader
    serves), then ``commit()`` PUTs the record (``record``). On any failure
    the record is deleted, every shard this save completed is deleted
    again, every one still open aborted, and the error raised (torch hands it to every rank): no step is left that a
    mount or HuggingFaceStorageReader would take for one."""
    uploads = {wr.upload[0]: wr.upload[1:] for rl in results for wr in rl if getattr(wr, "upload", ())}
    names = sorted(uploads, key=shard_rank, reverse=True)
    completed: list[str] = []
    try:
        for name in names:
            key, upload_id, check, parts = uploads[name]
            target.client.complete_multipart_upload(key, upload_id, parts, check)
            completed.append(name)
        return commit()
    except BaseException as e:
        _log.error("ckptfs StorageWriter: the commit of %s failed (%s: %s); its shards are removed", target.url,
                   type(e).__name__, e)
        target.discard(record)
        for name in [n for n in names if n not in completed]:
            key, upload_id, _, _ = uploads[name]
            try:
                target.client.abort_multipart_upload(key, upload_id)
            except Exception:
                pass
        for name in sorted(completed, key=shard_rank):  # rank 1's first
            target.discard(name)
        raise


def commit_dcp(target: S3Target, results: list, put_metadata, commit, metadata: str, record: str) -> dict:
    """The DCP layout's commit, on the coordinator, after every rank completed
    its upload: ``put_metadata()`` (the step is a stock DCP checkpoint now),
    then ``commit()`` PUTs the record. If either fails, ``.metadata`` and the
    record are deleted, then every rank file of this save (named in the
    results: each rank uploaded it in this save's ``write_data``), and the
    error raised (torch hands it to every rank)."""
    try:
        put_metadata()
        return commit()
    except BaseException as e:
        _log.error("ckptfs StorageWriter: the commit of %s failed (%s: %s); its rank files are removed", target.url,
                   type(e).__name__, e)
        target.discard(metadata)
        target.discard(record)
        for name in sorted({wr.storage_data.relative_path for rl in results for wr in rl}):
            target.discard(name)
        raise
