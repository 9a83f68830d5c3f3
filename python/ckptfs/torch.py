"""``ckptfs.torch.StorageWriter``: torch.distributed.checkpoint saves through
the ckptfs stager (docs/WRITER.md).

By default the files are standard DCP: ``io_threads`` files
``__R_0.distcp``, ``__R_1.distcp``, ... per rank (one per I/O thread, as
torch's FileSystemWriter with thread_count), whose tensor items are torch.save archives (framed in C++ around the raw
bytes, which come straight from the ring) and BYTE_IO items stored raw,
plus ``.metadata``, so stock ``dcp.load`` with ``FileSystemReader`` reads
them without ckptfs.
Planning is torch's (``DefaultSavePlanner``, or the planner the caller
passes to ``dcp.save``).

``StorageWriter(path, layout="hf")`` writes torch's sharded safetensors
instead, what ``HuggingFaceStorageWriter(path, save_distributed=True)``
writes: one ``shard-RRRRR-model-00001-of-00001.safetensors`` per rank
(RRRRR = rank + 1) holding the rank's chunks, placed by the
``saved_offsets`` in ``__metadata__["DCP_SHARDING_INFO"]``; no
``.metadata``, no index json, no consolidation. Stock
``HuggingFaceStorageReader`` loads it. Same entries, offsets and data
bytes as torch's files (the header is laid out in C++, the bytes come from
the ring); only JSON key order may differ (safetensors hashes
``__metadata__``; torch orders DCP_SHARDING_INFO by size when CUDA is
available, ckptfs by plan). Tensors only: a non-tensor item is refused before anything is written
(torch's writer would put it in front of the header and break the file).

Every dtype torch's writer of the layout saves is taken (float8 variants,
float4_e2m1fn_x2, uint16/32/64, complex ...); any other is refused in
``prepare_local_plan``, naming the tensor and dtype, before any rank writes
(docs/WRITER.md, "Element types").

Save protocol (every step durable before the next):
  1. coordinator, before any rank writes (``prepare_global_plan``): remove
     ``.ckptfs/commit.sst`` and ``.metadata`` of an earlier save into the
     same directory, fsync the directory;
  2. each rank (``write_data``): stage and write its items, fsync its files;
     its WriteResults carry its rows (ShardMeta -> ByteMeta + CRC32C);
  3. coordinator (``finish``): fsync the directory, write ``.metadata``
     (tmp, fsync, rename, fsync dir), then build the commit rows from every
     rank's results, checked in C++ (every tensor tiled exactly once), and
     write them last as the commit record ``.ckptfs/commit.sst`` (the
     store's WriteCommitRecord; tmp, fsync, rename, fsync dir). The rows are
     kept in ``last_rows``.
With layout="hf", 1 also removes an earlier save's shard files, 2 writes
``NAME.tmp``, and 3 is publishing instead of ``.metadata``: the coordinator
renames every rank's file into place, rank 1's last (until then the
directory reads as missing rank 1, which indexers refuse, not as a smaller
complete checkpoint), and fsyncs the directory.
A crash anywhere leaves earlier steps untouched and this one without a
commit record, and a new save into the directory starts over at 1.

``StorageWriter("s3://BUCKET/PREFIX/STEP")`` uploads the same files to
object storage, either layout (ckptfs._s3_save; docs/WRITER.md, "Object
storage").

``dcp.async_save(sd, storage_writer=StorageWriter(...))``: ``stage()`` runs
the planning (one all_gather_object on the default group, as ``dcp.save``
would) and pushes every byte into the ring on the training thread (device
tensors are copied by the CUDA engine and the producer stream is fenced
after the copies; host tensors are copied), so the state dict may change as
soon as it returns; draining, fsync, ``.metadata`` (or publishing) and
the commit record happen in the background save. Host memory is the ring, never a copy of the state dict.

``StorageWriter(path, snapshot=True)`` trades memory for a shorter stall:
``stage()`` copies the state dict into a host snapshot allocated on the
first save and reused by the next ones (one copy of this rank's tensors,
pinned when CUDA is present, filled by several threads) and returns; the
background save plans and writes from the snapshot, so the training thread
never waits for the disk or the network (ckptfs/_snapshot.py).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import json
import os
import pickle
import re
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY, FORMAT_VALUE, HF_DCP_VERSION, SAVED_OFFSETS_KEY,
    _gen_file_name)
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter as _TorchStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptfs import _snapshot, _writer
from ckptfs._names import HF_TMP_SUFFIX, is_hf_shard, other_layout_files

__all__ = ["StorageWriter"]

METADATA = ".metadata"
COMMIT_DIR = ".ckptfs"
COMMIT_RECORD = "commit.sst"
DCP_VERSION = "1.0.0"  # what torch's FileSystemWriter writes
LAYOUTS = ("dcp", "hf")
FORMATS = {"dcp": "dcp", "hf": "sharded-safetensors"}  # the index's name for each (indexer/readers)
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # RFC 3986's scheme, then "//"


def _local_path(path: str | os.PathLike) -> Path | str:
    """``path`` as a directory, an ``s3://`` URL as it is (str), or
    ValueError for any other URL: pathlib would make ``gs://b/p`` the
    relative folder ``gs:/b/p`` and save there."""
    m = _URL_SCHEME.match(os.fspath(path)) if isinstance(path, str) else None
    if m and m.group(1) == "s3":
        return path.rstrip("/")
    if m:
        raise ValueError(f"ckptfs StorageWriter: {path!r} is a {m.group(1)}:// URL, not a directory; "
                         "it saves into a local or network directory path or an s3:// URL")
    return Path(path)


@dataclass(frozen=True)
class CkptfsWriteResult(WriteResult):
    """A WriteResult with the row the coordinator commits: for a tensor
    chunk ``("tensor", fqn, offsets, sizes, file, data_offset, data_length,
    crc32c)``; for a BYTE_IO item ``("bytes", key, file, offset, length,
    crc32c)``. ``.metadata`` only ever holds the plain ``storage_data``.
    On S3 with layout="hf", a shard's first result also carries its open
    upload, ``(name, key, upload_id, check, parts)``, for the coordinator to
    complete at commit (ckptfs._s3_save.complete_shards)."""

    row: tuple = ()
    upload: tuple = ()


_FREE_STAGERS: dict[tuple, list] = {}
_ALL_STAGERS: weakref.WeakSet = weakref.WeakSet()  # pooled or in use, for _close_stagers
_STAGERS_LOCK = threading.Lock()


def _acquire_stager(buffer_bytes: int, buffers: int, io_threads: int, zip_crc32: bool):
    """A stager of this configuration that no save is using. Stagers are
    kept for the process's next saves: the ring (pinned memory on GPUs) is
    slow to allocate. A stager has one producer at a time, so two saves in
    flight (an async_save not yet waited for) get two."""
    key = (buffer_bytes, buffers, io_threads, zip_crc32)
    with _STAGERS_LOCK:
        free = _FREE_STAGERS.setdefault(key, [])
        if free:
            return key, free.pop()
    stager = _writer.Stager(buffer_bytes=buffer_bytes, buffers=buffers, io_threads=io_threads, zip_crc32=zip_crc32)
    with _STAGERS_LOCK:
        _ALL_STAGERS.add(stager)
    return key, stager


def _release_stager(key: tuple, stager) -> None:
    with _STAGERS_LOCK:
        _FREE_STAGERS.setdefault(key, []).append(stager)


@atexit.register
def _close_stagers() -> None:
    """Joins every stager's I/O threads while the interpreter is whole, the
    pooled ones and those a failed save left referenced from its traceback,
    rather than leaving them to whatever order finalization picks."""
    with _STAGERS_LOCK:
        stagers = list(_ALL_STAGERS)
        _FREE_STAGERS.clear()
    for stager in stagers:
        try:
            stager.close()
        except Exception:  # a write error it kept: the save that met it has raised it already
            pass


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _host_or_cuda(fqn: str, t: torch.Tensor) -> None:
    if not (t.is_cuda or t.device.type == "cpu"):
        raise TypeError(f"{fqn}: tensors on {t.device} are not supported (host or CUDA memory only)")


class _StagedFile:
    """A rank file written through a pooled stager: items planned (``add``),
    their bytes pushed into the ring (``write_all``), then finished (drain,
    fsync) into CkptfsWriteResults. ``self.file`` is the C++ file; its
    ``write(item, ptr, nbytes, device, stream, copy_host)`` takes each
    item's bytes."""

    def __init__(self, stager_key: tuple, name: str):
        self.name = name
        self.stager_key, self.stager = _acquire_stager(*stager_key)
        self.file = None
        self.items: list[tuple[Any, int, Any]] = []  # (WriteItem, item id, data kept alive)
        self.devices: set[tuple[int, int]] = set()

    def write_all(self, copy_host: bool, streams: dict[int, int]) -> None:
        """Pushes every item's bytes; ``streams`` maps each CUDA device to the
        producer's stream, taken on the training thread (torch's current
        stream is per thread, and this may run on a helper thread)."""
        for write_item, item, data in self.items:
            if isinstance(data, memoryview):
                if data.nbytes:
                    ptr = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
                    self.file.write(item, ptr, data.nbytes, -1, 0, False)  # our own buffer
                continue
            nbytes = data.numel() * data.element_size()
            if nbytes == 0:
                continue
            _host_or_cuda(write_item.index.fqn, data)
            if data.is_cuda:
                device = data.device.index
                stream = streams[device]
                self.devices.add((device, stream))
                self.file.write(item, data.data_ptr(), nbytes, device, stream, True)
            else:
                self.file.write(item, data.data_ptr(), nbytes, -1, 0, copy_host)

    def abandon(self) -> None:
        """After a failure: the file dropped and the stager's I/O threads
        joined now (it may hold the error, so it is not pooled again), not
        whenever the traceback that references this file is freed."""
        self.file = None
        self.items.clear()
        stager, self.stager = self.stager, None
        if stager is not None:
            try:
                stager.close()
            except Exception:  # its write error: the failure being raised already covers it
                pass

    def cuda_devices(self) -> set[int]:
        return {d.device.index for _, _, d in self.items if isinstance(d, torch.Tensor) and d.is_cuda}

    def finish(self) -> list[CkptfsWriteResult]:
        written = self.file.finish()
        # Back to the pool only after a clean finish: a stager that met an
        # error keeps it and is closed by abandon().
        self.file = None
        _release_stager(self.stager_key, self.stager)
        self.stager = None
        out = [self._result(wi, w) for (wi, _, _), w in zip(self.items, written)]
        self.items.clear()  # release the tensors
        return out

    def _tensor_row(self, write_item, offset: int, length: int, crc: int) -> tuple:
        chunk = write_item.tensor_data.chunk
        return ("tensor", write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes), self.name, offset, length, crc)


def _split_items(items: list, files: int) -> list[list]:
    """The items of a rank's ``files`` DCP files, split by torch's own rule
    (FileSystemWriter with thread_count: BYTE_IO items round-robin, then
    tensors from the largest, each to the file with the fewest bytes), each
    file's BYTE_IO items first as torch's writer writes them. Empty files are
    dropped (the first is kept: a rank always writes one file)."""
    buckets = [sorted(b, key=lambda wi: wi.type != WriteItemType.BYTE_IO)
               for b in _split_by_size_and_type(files, items)]
    return [b for i, b in enumerate(buckets) if b or i == 0]


def _on_each(files: list, fn) -> list:
    """``fn(file)`` for every file, concurrently when there are several
    (the C++ calls release the GIL); raises the first file's error after
    every call has returned."""
    if len(files) <= 1:
        return [fn(f) for f in files]
    with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="ckptfs-save") as pool:
        futures = [pool.submit(fn, f) for f in files]
        return [fu.result() for fu in futures]


@contextlib.contextmanager
def _abandon_on_error(files: list):
    """On any exception in the body (KeyboardInterrupt included), abandons
    every file ``files`` holds by then before the exception goes on: their
    stagers' threads are joined at once, on every path out of a save."""
    try:
        yield
    except BaseException:
        for f in files:
            f.abandon()
        raise


def _write_files(files: list, copy_host: bool) -> None:
    """Every file's bytes into its stager, one producer thread per file."""
    devices = set().union(*(f.cuda_devices() for f in files))
    streams = {d: torch.cuda.current_stream(d).cuda_stream for d in devices}
    _on_each(files, lambda f: f.write_all(copy_host, streams))


def _finish_files(files: list) -> list:
    """Drains and fsyncs every file (concurrently); their results, in file order."""
    return [r for rl in _on_each(files, lambda f: f.finish()) for r in rl]


def _contiguous(data) -> torch.Tensor:
    t = data.detach()
    return t if t.is_contiguous() else t.contiguous()


class _RankFile(_StagedFile):
    """One of a rank's ``__R_K.distcp`` files: torch.save archives for
    tensors (framed in C++), BYTE_IO items raw."""

    def __init__(self, stager_key: tuple, directory: Path, name: str):
        super().__init__(stager_key, name)
        self.file = _writer.DcpFile(self.stager, str(directory / name))

    def add(self, write_item, data) -> None:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
            item = self.file.add_bytes(buf.nbytes)
            self.items.append((write_item, item, buf))
            return
        t = _contiguous(data)
        nbytes = t.numel() * t.element_size()
        item = self.file.add_tensor(str(t.dtype).removeprefix("torch."), list(t.shape), nbytes)
        self.items.append((write_item, item, t))

    def seal(self) -> None:
        """The archives' framing is laid out as items are added."""

    def _result(self, write_item, written: tuple) -> CkptfsWriteResult:
        off, length, doff, dlen, crc = written
        if write_item.type == WriteItemType.BYTE_IO:
            row = ("bytes", write_item.index.fqn, self.name, doff, dlen, crc)
        else:
            row = self._tensor_row(write_item, doff, dlen, crc)
        return CkptfsWriteResult(index=write_item.index, size_in_bytes=length,
                                 storage_data=_StorageInfo(relative_path=self.name, offset=off, length=length), row=row)


class _HfRankFile(_StagedFile):
    """One rank's ``shard-RRRRR-model-00001-of-00001.safetensors`` as torch's
    HuggingFaceStorageWriter (save_distributed=True) writes it: the rank's
    chunks under their fqns, ``__metadata__`` with DCP_SHARDING_INFO (each
    chunk's ``saved_offsets``, in plan order, ``json.dumps``'d as torch
    does), DCP_VERSION and format. Written as ``NAME.tmp``; the coordinator
    renames it at commit (``_publish_shards``)."""

    def __init__(self, stager_key: tuple, directory: Path, name: str):
        super().__init__(stager_key, name)
        self.file = _writer.SafetensorsFile(self.stager, str(directory / (name + HF_TMP_SUFFIX)))

    def add(self, write_item, data) -> None:
        t = _contiguous(data)
        nbytes = t.numel() * t.element_size()
        item = self.file.add_tensor(write_item.index.fqn, str(t.dtype).removeprefix("torch."), list(t.shape), nbytes)
        self.items.append((write_item, item, t))

    def seal(self) -> None:
        info = {wi.index.fqn: {SAVED_OFFSETS_KEY: list(wi.tensor_data.chunk.offsets)} for wi, _, _ in self.items}
        self.file.seal({CUSTOM_METADATA_KEY: json.dumps(info), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                        FORMAT_KEY: FORMAT_VALUE})

    def _result(self, write_item, written: tuple) -> CkptfsWriteResult:
        off, length, crc = written
        return CkptfsWriteResult(index=write_item.index, size_in_bytes=length,
                                 storage_data=_StorageInfo(relative_path=self.name, offset=off, length=length),
                                 row=self._tensor_row(write_item, off, length, crc))


class StorageWriter(_TorchStorageWriter, AsyncStager):
    """Writes a checkpoint into ``path`` through the ckptfs stager.

    ``layout="dcp"`` (default): standard DCP, ``__R_K.distcp`` per rank and
    I/O thread, and ``.metadata``. ``layout="hf"``: torch's sharded safetensors, one
    ``shard-RRRRR-model-00001-of-00001.safetensors`` per rank with
    DCP_SHARDING_INFO, as ``HuggingFaceStorageWriter(save_distributed=True)``
    writes them (stock ``HuggingFaceStorageReader`` loads them); tensors only.

    ``buffer_bytes`` x ``buffers`` is the ring (default 2 x 256 MiB), the
    only host memory a save adds; ``io_threads`` pwrite filled buffers
    (DCP: each into its own file, with its share of the ring);
    ``zip_crc32`` fills the zip CRC-32 of each torch.save archive (DCP only;
    torch's loader does not check it, other zip readers do; off saves one
    pass over the bytes). ``snapshot=True`` makes ``dcp.async_save`` stage
    into a host copy of the state dict kept for the process's next saves
    instead of through the ring: the shortest stall, for one copy of this
    rank's tensors in host memory (``snapshot_threads`` threads fill it).

    ``path`` may be ``s3://BUCKET/PREFIX/STEP`` (either layout): one
    multipart upload per rank from the ring (parts of at least
    ``part_size``, ``max_threads`` in flight), committed once every rank's
    upload is in (HF: the coordinator completes every shard then, rank 1's
    last); ``endpoint_url``, ``region`` and ``force_path_style``
    override the AWS configuration ``ckptfs mount s3://`` reads.
    """

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike, *, layout: str = "dcp", buffer_bytes: int = 256 << 20,
                 buffers: int = 2, io_threads: int = 2, zip_crc32: bool = True, snapshot: bool = False,
                 snapshot_threads: int = _snapshot.DEFAULT_THREADS, part_size: int = 16 << 20,
                 max_threads: int = 8, endpoint_url: str | None = None, region: str | None = None,
                 force_path_style: bool = False) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        if min(buffer_bytes, buffers, io_threads) < 1:
            raise ValueError(f"buffer_bytes, buffers and io_threads must be >= 1, not {buffer_bytes}, {buffers}, "
                             f"{io_threads}")
        self.s3_options = dict(part_size=part_size, max_threads=max_threads, endpoint_url=endpoint_url,
                               region=region, force_path_style=force_path_style)
        self.layout = layout
        self.path = _local_path(path)
        self._s3 = self._s3_target()
        self.buffer_bytes, self.buffers, self.io_threads = buffer_bytes, buffers, io_threads
        self.zip_crc32 = zip_crc32 and layout == "dcp"  # safetensors items are raw bytes: no zip
        self.snapshot, self.snapshot_threads = snapshot, snapshot_threads
        self._lease: _snapshot.Lease | None = None  # the snapshot's use by the save in flight
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank = 0
        self._staged: dict[MetadataIndex, CkptfsWriteResult] | None = None
        self._staged_files: list[_StagedFile] = []
        self.last_rows: dict | None = None  # the coordinator's rows of the last save (tests, tools)

    # --- StorageWriter -------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = _local_path(checkpoint_id)
            self._s3 = self._s3_target()
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self._lease is not None:
            self._lease.thread = threading.current_thread()  # the save's: its end ends the lease
        self.rank = kwargs.get("rank") or (dist.get_rank() if dist.is_initialized() else 0)
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("ckptfs StorageWriter needs use_collectives=True: the commit is global")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _check_dtypes(plan, self.layout)  # before anything is removed or written
        if self.layout == "hf":
            _check_hf_plan(plan)
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            self._refuse_other_layout()
        if self._s3 is None:
            self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: an earlier save's
        # commit record and .metadata (or shard files) go first, so a crash
        # from here on leaves the directory uncommitted rather than half
        # old, half new. (After stage() it is done: this rank's staged
        # shard is already being written.)
        if self._staged is None:
            self._uncommit()
        return self._name_plans(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            if self._s3 is not None:
                return self._s3_write_data(plan, planner)
            return self._write_data(plan, planner)
        finally:
            lease, self._lease = self._lease, None
            if lease is not None:  # every byte read from the snapshot is written
                lease.done.set()

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._staged is not None:
            results = self._take_staged(plan)
        else:
            files: list[_StagedFile] = []
            with _abandon_on_error(files):
                self._plan_files(plan, planner, files)
                _write_files(files, copy_host=False)
                results = _finish_files(files)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._s3 is not None and self.layout == "hf":
            from ckptfs._s3_save import complete_shards
            self.last_rows = complete_shards(self._s3, results, lambda: self._commit(metadata, results),
                                             f"{COMMIT_DIR}/{COMMIT_RECORD}")
            return
        if self._s3 is not None:
            from ckptfs._s3_save import commit_dcp
            self.last_rows = commit_dcp(self._s3, results,
                                        lambda: self._s3.put(METADATA, self._metadata_bytes(metadata, results)),
                                        lambda: self._commit(metadata, results), METADATA,
                                        f"{COMMIT_DIR}/{COMMIT_RECORD}")
            return
        if self.layout == "hf":
            self._publish_shards(results)
        else:
            self._write_metadata(metadata, results)
        self.last_rows = self._commit(metadata, results)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id) or str(checkpoint_id).startswith("s3://")

    # --- AsyncStager -----------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Plans as dcp.save will, then copies every byte this rank saves
        into the ring (and on to the page cache as buffers fill). Returns
        the same state_dict: the background save takes the staged results
        instead of reading tensors again. With ``snapshot=True``: copies
        the state dict into the snapshot and returns the copy, which the
        background save plans and writes as dcp.save would."""
        if self.snapshot:
            staged, self._lease = _snapshot.snapshot().take(state_dict, self.snapshot_threads)
            return staged
        rank = dist.get_rank() if dist.is_initialized() else 0
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, self.storage_meta(), rank == 0)
        plans = _gather_local_plans(lambda: self.prepare_local_plan(planner.create_local_plan()))
        global_plans, _ = planner.create_global_plan(plans)
        # The coordinator uncommits; the others only name the plans alike.
        global_plans = self.prepare_global_plan(global_plans) if rank == 0 else self._name_plans(global_plans)
        if dist.is_initialized():
            dist.barrier()  # nobody writes before the coordinator uncommitted
        final = planner.finish_plan(global_plans[rank])
        files: list[_StagedFile] = []
        with _abandon_on_error(files):
            self._plan_files(final, planner, files)
            _write_files(files, copy_host=True)
            for f in files:
                for device, stream in f.devices:
                    f.stager.fence_producer(device, stream)
        self._staged_files = files
        self._staged = {}
        return state_dict

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """The ring is shared per process and kept for the next save."""

    # --- internals -------------------------------------------------------------

    def _name_plans(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Each rank's file name, as torch's writers name them: the DCP
        prefix ``__R_``, or the 1-based shard index of the HF layout."""
        if self.layout == "hf":
            return [dataclasses.replace(p, storage_data={"shard_index": i}) for i, p in enumerate(plans, start=1)]
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def _plan_files(self, plan: SavePlan, planner: SavePlanner, files: list[_StagedFile]) -> None:
        """This rank's files with their items planned, appended to ``files``
        as each is made (so a failure can abandon those made). DCP: up to
        ``io_threads`` files ``__R_0.distcp``, ``__R_1.distcp``, ... (as
        torch's FileSystemWriter with thread_count), each with its own
        stager and I/O thread, so no two threads write into one file. HF:
        the rank's one shard, or none when it has nothing to save (torch's
        writer writes no file then)."""
        if self._s3 is not None and self.layout == "hf":  # one shard upload, completed at commit
            if not plan.items:
                return
            shard = plan.storage_data.get("shard_index", self.rank + 1)
            files.append(_s3_rank_file(hf=True)(self._s3, _gen_file_name(1, 1, shard),
                                                self.buffer_bytes * self.buffers, False))
            buckets = [plan.items]
        elif self._s3 is not None:  # one object per rank, its parts uploaded by max_threads threads
            prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _StoragePrefix) else f"__{self.rank}_"
            files.append(_s3_rank_file()(self._s3, f"{prefix}0.distcp", self.buffer_bytes * self.buffers,
                                         self.zip_crc32))
            buckets = [_split_items(plan.items, 1)[0]]
        elif self.layout == "hf":
            if not plan.items:
                return
            shard = plan.storage_data.get("shard_index", self.rank + 1)
            key = (self.buffer_bytes, self.buffers, self.io_threads, self.zip_crc32)
            files.append(_HfRankFile(key, self.path, _gen_file_name(1, 1, shard)))
            buckets = [plan.items]
        else:
            prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _StoragePrefix) else f"__{self.rank}_"
            buckets = _split_items(plan.items, self.io_threads)
            n = len(buckets)  # the ring and the I/O threads are shared out, not multiplied
            key = (max(1, self.buffer_bytes // n), self.buffers, max(1, self.io_threads // n), self.zip_crc32)
            for i in range(n):
                files.append(_RankFile(key, self.path, f"{prefix}{i}.distcp"))
        for f, bucket in zip(files, buckets):
            for wi in bucket:
                f.add(wi, planner.resolve_data(wi))
            f.seal()

    def _take_staged(self, plan: SavePlan) -> list[WriteResult]:
        files, self._staged_files, self._staged = self._staged_files, [], None
        with _abandon_on_error(files):
            results = {r.index: r for r in _finish_files(files)}
        missing = [wi.index for wi in plan.items if wi.index not in results]
        if missing:
            raise RuntimeError(f"ckptfs StorageWriter: the save's plan has {len(missing)} item(s) that stage() "
                               f"did not write (first: {missing[0]}); async_save needs torch's DefaultSavePlanner")
        return [results[wi.index] for wi in plan.items]

    def _metadata_bytes(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
        metadata.storage_meta = self.storage_meta()
        return pickle.dumps(metadata)

    def _write_metadata(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's commit point: ``.metadata``, durably, after every rank file."""
        data = self._metadata_bytes(metadata, results)
        _writer.sync_dir(str(self.path))  # every rank fsynced its file; now their directory entries
        tmp = self.path / (METADATA + ".tmp")
        _fsync_write(tmp, data)
        os.replace(tmp, self.path / METADATA)
        _writer.sync_dir(str(self.path))

    def _publish_shards(self, results: list[list[WriteResult]]) -> None:
        """Renames every rank's fsynced ``NAME.tmp`` to NAME, rank 1's last:
        until then the shard files read as a checkpoint missing rank 1,
        which no reader serves, rather than as a smaller complete one."""
        names = sorted({wr.storage_data.relative_path for rl in results for wr in rl}, reverse=True)
        for name in names:
            os.replace(self.path / (name + HF_TMP_SUFFIX), self.path / name)
        _writer.sync_dir(str(self.path))

    def _refuse_other_layout(self) -> None:
        """A step holding a save of the other layout is refused, before
        anything is removed or written: the new files would sit beside the
        old ones, and a reader (ckptfs's index, or stock loaders) could take
        the old for the new. Its files are not ours to delete."""
        if self._s3 is not None:
            names = self._s3.names()
        else:
            names = os.listdir(self.path) if self.path.is_dir() else []
        found = other_layout_files(names, self.layout)
        if found:
            other = "hf" if self.layout == "dcp" else "dcp"
            shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
            raise ValueError(f"ckptfs StorageWriter: {self.path} holds a layout={other!r} save ({shown}); a "
                             f"layout={self.layout!r} save would leave it beside the new files. Save into a new "
                             "step, or remove those files first")

    def _uncommit(self) -> None:
        if self._s3 is not None:
            self._s3.uncommit(f"{COMMIT_DIR}/{COMMIT_RECORD}", METADATA, hf=self.layout == "hf")
            return
        self.path.mkdir(parents=True, exist_ok=True)
        removed = _remove(self.path / COMMIT_DIR / COMMIT_RECORD)
        removed |= _remove(self.path / METADATA)
        if self.layout == "hf":  # an earlier save's shards (perhaps of more ranks) and leftovers
            # Rank 1's first, as published last (_publish_shards): a crash
            # in between leaves a step missing rank 1, never rank 1's
            # shard beside a partial set that reads as a smaller step.
            for name in sorted(os.listdir(self.path)):
                if is_hf_shard(name, tmp=True):
                    removed |= _remove(self.path / name)
        if removed:
            if (self.path / COMMIT_DIR).is_dir():
                _writer.sync_dir(str(self.path / COMMIT_DIR))
            _writer.sync_dir(str(self.path))

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> dict:
        """Builds the commit rows (checked in C++: every tensor tiled exactly
        once) and writes the commit record, durably, last."""
        tensors, chunks, byte_items = [], [], []
        # Nested keys for DCP; safetensors names are the flat fqns.
        paths = (metadata.planner_data or {}) if self.layout == "dcp" else {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                path = [str(k) for k in paths.get(fqn, (fqn,))]
                tensors.append((fqn, path, str(md.properties.dtype).removeprefix("torch."), list(md.size)))
        for rl in results:
            for wr in rl:
                row = getattr(wr, "row", None)
                if not row:
                    raise RuntimeError(f"{wr.index.fqn}: a WriteResult without ckptfs rows; every rank must "
                                       "save with ckptfs.torch.StorageWriter")
                if row[0] == "tensor":
                    _, fqn, offs, sizes, name, doff, dlen, crc = row
                    chunks.append((fqn, list(offs), list(sizes), name, doff, dlen, crc))
                else:
                    _, key, name, off, length, _crc = row
                    byte_items.append((key, name, off, length))
        if self._s3 is not None:
            return self._s3.commit(tensors, chunks, byte_items, FORMATS[self.layout])
        root, rel = str(self.path.parent.resolve()), self.path.name
        return _writer.commit(root, rel, tensors, chunks, byte_items, format=FORMATS[self.layout])

    # --- object storage (ckptfs._s3_save) --------------------------------------

    def _s3_target(self):
        if not isinstance(self.path, str):
            return None
        from ckptfs._s3_save import S3Target
        return S3Target(self.path, **self.s3_options)

    def _s3_write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Uploads this rank's file (or finishes the staged one), then every
        rank's ok/error flag is exchanged: a failure anywhere is raised on
        every rank and nothing is committed (ckptfs._s3_save)."""
        from ckptfs._s3_save import agree_or_raise
        files: list[_StagedFile] = []
        error, results = None, []
        try:
            if self._staged is not None:
                files = list(self._staged_files)
                results = self._take_staged(plan)
            else:
                with _abandon_on_error(files):
                    self._plan_files(plan, planner, files)
                    _write_files(files, copy_host=False)
                    results = _finish_files(files)
        except BaseException as e:  # KeyboardInterrupt included: every rank must hear of it
            error = e
        agree_or_raise(self._s3, self.rank, files, error)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut


def _s3_rank_file(hf: bool = False):
    """The class of a rank file uploaded to S3, of either layout."""
    from ckptfs._s3_save import make_rank_file_class
    if hf not in _S3_RANK_FILE:
        _S3_RANK_FILE[hf] = make_rank_file_class(_StagedFile, _HfRankFile if hf else _RankFile, hf=hf)
    return _S3_RANK_FILE[hf]


_S3_RANK_FILE: dict[bool, type] = {}


def _gather_local_plans(make_plan) -> list[SavePlan]:
    """Every rank's local plan (``make_plan()`` here). A rank whose plan is
    refused still takes part in the gather, so that every rank raises
    rather than some waiting forever: its own error, or a RuntimeError
    naming the first rank that refused."""
    try:
        local, refusal = make_plan(), None
    except (TypeError, ValueError) as e:
        local, refusal = None, e
    if not dist.is_initialized():
        if refusal is not None:
            raise refusal
        return [local]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, None if refusal is None else str(refusal)))
    if refusal is not None:
        raise refusal
    for rank, (_, why) in enumerate(gathered):
        if why is not None:
            raise RuntimeError(f"ckptfs StorageWriter: rank {rank} refused the save, nothing was written: {why}")
    return [p for p, _ in gathered]


def _dtype_refusal(layout: str, dtype: torch.dtype, sizes) -> str | None:
    """Why this layout's files cannot hold a chunk of ``dtype`` and ``sizes``,
    or None. DCP: every dtype torch.save archives hold (what torch's
    FileSystemWriter saves). HF: what safetensors.torch.save, and so torch's
    HuggingFaceStorageWriter, holds (not complex128, complex32 or a 0-d
    float4_e2m1fn_x2)."""
    name = str(dtype).removeprefix("torch.")
    if layout == "dcp":
        if _writer.torch_save_element_size(name):
            return None
        return f"torch.{name} has no torch.save storage (torch's FileSystemWriter cannot save it either)"
    try:
        _writer.safetensors_type(name, list(sizes))
        return None
    except TypeError as e:
        return str(e).removeprefix("NotSupported: ")


def _check_dtypes(plan: SavePlan, layout: str) -> None:
    """Every tensor chunk of the plan is of a dtype the layout's files hold;
    else TypeError naming each refused tensor and its dtype, while planning,
    before any rank writes a byte."""
    refused: dict[str, str] = {}
    for wi in plan.items:
        if wi.type == WriteItemType.BYTE_IO or wi.tensor_data is None or wi.index.fqn in refused:
            continue
        why = _dtype_refusal(layout, wi.tensor_data.properties.dtype, wi.tensor_data.chunk.sizes)
        if why is not None:
            refused[wi.index.fqn] = why
    if refused:
        named = "; ".join(f"{fqn!r}: {why}" for fqn, why in refused.items())
        raise TypeError(f"ckptfs StorageWriter(layout={layout!r}) cannot save {len(refused)} tensor(s), nothing "
                        f"was written: {named}")


def _check_hf_plan(plan: SavePlan) -> None:
    """The HF layout holds tensors only, one chunk per fqn per rank."""
    seen: set[str] = set()
    for wi in plan.items:
        fqn = wi.index.fqn
        if wi.type == WriteItemType.BYTE_IO:
            raise ValueError(
                f"ckptfs StorageWriter(layout='hf'): {fqn!r} is not a tensor; safetensors files hold tensors "
                "only (torch's HuggingFaceStorageWriter writes such items in front of the safetensors header, "
                "which leaves the file unreadable). Save non-tensors apart, or use layout='dcp'")
        if fqn in seen:
            raise ValueError(f"ckptfs StorageWriter(layout='hf'): this rank saves two chunks of {fqn!r}; a "
                             "safetensors file holds one entry per name")
        seen.add(fqn)
