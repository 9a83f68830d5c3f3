"""``ckptfs.torch.StorageWriter``: torch.distributed.checkpoint saves through
the ckptfs stager (docs/WRITER.md).

The files are standard DCP: one ``__R_0.distcp`` per rank whose tensor items
are torch.save archives (framed in C++ around the raw bytes, which come
straight from the ring) and BYTE_IO items stored raw, plus ``.metadata``,
so stock ``dcp.load`` with ``FileSystemReader`` reads them without ckptfs.
Planning is torch's (``DefaultSavePlanner``, or the planner the caller
passes to ``dcp.save``).

Save protocol (every step durable before the next):
  1. coordinator, before any rank writes (``prepare_global_plan``): remove
     ``.ckptfs/commit.sst`` and ``.metadata`` of an earlier save into the
     same directory, fsync the directory;
  2. each rank (``write_data``): stage and write its items, fsync its file;
     its WriteResults carry its rows (ShardMeta -> ByteMeta + CRC32C);
  3. coordinator (``finish``): fsync the directory, write ``.metadata``
     (tmp, fsync, rename, fsync dir), then build the commit rows from every
     rank's results, checked in C++ (every tensor tiled exactly once), and
     write them last as the commit record ``.ckptfs/commit.sst`` (the
     store's WriteCommitRecord; tmp, fsync, rename, fsync dir). The rows are
     kept in ``last_rows``.
A crash anywhere leaves earlier steps untouched and this one without a
commit record, and a new save into the directory starts over at 1.

``dcp.async_save(sd, storage_writer=StorageWriter(...))``: ``stage()`` runs
the planning (one all_gather_object on the default group, as ``dcp.save``
would) and pushes every byte into the ring on the training thread (device
tensors are copied by the CUDA engine and the producer stream is fenced
after the copies; host tensors are copied), so the state dict may change as
soon as it returns; draining, fsync, ``.metadata`` and the commit record
happen in the background save. Host memory is the ring, never a copy of the state dict.
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import os
import pickle
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter as _TorchStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptfs import _writer

__all__ = ["StorageWriter"]

METADATA = ".metadata"
COMMIT_DIR = ".ckptfs"
COMMIT_RECORD = "commit.sst"
DCP_VERSION = "1.0.0"  # what torch's FileSystemWriter writes


@dataclass(frozen=True)
class CkptfsWriteResult(WriteResult):
    """A WriteResult with the row the coordinator commits: for a tensor
    chunk ``("tensor", fqn, offsets, sizes, file, data_offset, data_length,
    crc32c)``; for a BYTE_IO item ``("bytes", key, file, offset, length,
    crc32c)``. ``.metadata`` only ever holds the plain ``storage_data``."""

    row: tuple = ()


_FREE_STAGERS: dict[tuple, list] = {}
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
    return key, _writer.Stager(buffer_bytes=buffer_bytes, buffers=buffers, io_threads=io_threads,
                               zip_crc32=zip_crc32)


def _release_stager(key: tuple, stager) -> None:
    with _STAGERS_LOCK:
        _FREE_STAGERS.setdefault(key, []).append(stager)


@atexit.register
def _close_stagers() -> None:
    """Joins the pooled stagers' I/O threads while the interpreter is whole,
    rather than leaving them to whatever order finalization picks."""
    with _STAGERS_LOCK:
        _FREE_STAGERS.clear()


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


class _RankFile:
    """One rank's ``__R_0.distcp`` being written: items planned, then
    written, then finished (drain, framing, fsync)."""

    def __init__(self, stager_key: tuple, directory: Path, name: str):
        self.name = name
        self.stager_key, self.stager = _acquire_stager(*stager_key)
        self.file = _writer.DcpFile(self.stager, str(directory / name))
        self.items: list[tuple[Any, int, Any]] = []  # (WriteItem, item id, data kept alive)
        self.devices: set[tuple[int, int]] = set()

    def add(self, write_item, data) -> None:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
            item = self.file.add_bytes(buf.nbytes)
            self.items.append((write_item, item, buf))
            return
        t = data.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        item = self.file.add_tensor(str(t.dtype).removeprefix("torch."), list(t.shape), nbytes)
        self.items.append((write_item, item, t))

    def write_all(self, copy_host: bool) -> None:
        for write_item, item, data in self.items:
            if isinstance(data, memoryview):
                if data.nbytes:
                    ptr = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
                    self.file.write(item, ptr, data.nbytes, -1, 0, False)  # our own buffer
                continue
            nbytes = data.numel() * data.element_size()
            if nbytes == 0:
                continue
            if data.is_cuda:
                device = data.device.index
                stream = torch.cuda.current_stream(data.device).cuda_stream
                self.devices.add((device, stream))
                self.file.write(item, data.data_ptr(), nbytes, device, stream, True)
            elif data.device.type == "cpu":
                self.file.write(item, data.data_ptr(), nbytes, -1, 0, copy_host)
            else:
                raise TypeError(f"{write_item.index.fqn}: tensors on {data.device} are not supported "
                                "(host or CUDA memory only)")

    def finish(self) -> list[CkptfsWriteResult]:
        written = self.file.finish()
        # Back to the pool only after a clean finish: a stager that met an
        # error keeps it and is dropped with this file.
        self.file = None
        _release_stager(self.stager_key, self.stager)
        out = []
        for (write_item, _, _), (off, length, doff, dlen, crc) in zip(self.items, written):
            info = _StorageInfo(relative_path=self.name, offset=off, length=length)
            if write_item.type == WriteItemType.BYTE_IO:
                row = ("bytes", write_item.index.fqn, self.name, doff, dlen, crc)
            else:
                chunk = write_item.tensor_data.chunk
                row = ("tensor", write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes),
                       self.name, doff, dlen, crc)
            out.append(CkptfsWriteResult(index=write_item.index, size_in_bytes=length,
                                         storage_data=info, row=row))
        self.items.clear()  # release the tensors
        return out


class StorageWriter(_TorchStorageWriter, AsyncStager):
    """Writes a DCP checkpoint into ``path`` through the ckptfs stager.

    ``buffer_bytes`` x ``buffers`` is the ring (default 2 x 256 MiB), the
    only host memory a save adds; ``io_threads`` pwrite filled buffers;
    ``zip_crc32`` fills the zip CRC-32 of each torch.save archive (torch's
    loader does not check it, other zip readers do; off saves one pass over
    the bytes).
    """

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike, *, buffer_bytes: int = 256 << 20, buffers: int = 2,
                 io_threads: int = 2, zip_crc32: bool = True) -> None:
        super().__init__()
        self.path = Path(path)
        self.buffer_bytes, self.buffers, self.io_threads = buffer_bytes, buffers, io_threads
        self.zip_crc32 = zip_crc32
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank = 0
        self._staged: dict[MetadataIndex, CkptfsWriteResult] | None = None
        self._staged_file: _RankFile | None = None
        self.last_rows: dict | None = None  # the coordinator's rows of the last save (tests, tools)

    # --- StorageWriter -------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or (dist.get_rank() if dist.is_initialized() else 0)
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("ckptfs StorageWriter needs use_collectives=True: the commit is global")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: an earlier save's
        # commit record and .metadata go first, so a crash from here on
        # leaves the directory uncommitted rather than half old, half new.
        self._uncommit()
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._staged is not None:
            results = self._take_staged(plan)
        else:
            rank_file = self._plan_file(plan, planner)
            rank_file.write_all(copy_host=False)
            results = rank_file.finish()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
        metadata.storage_meta = self.storage_meta()
        _writer.sync_dir(str(self.path))  # every rank fsynced its file; now their directory entries
        tmp = self.path / (METADATA + ".tmp")
        _fsync_write(tmp, pickle.dumps(metadata))
        os.replace(tmp, self.path / METADATA)
        _writer.sync_dir(str(self.path))
        self.last_rows = self._commit(metadata, results)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id)

    # --- AsyncStager -----------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Plans as dcp.save will, then copies every byte this rank saves
        into the ring (and on to the page cache as buffers fill). Returns
        the same state_dict: the background save takes the staged results
        instead of reading tensors again."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, self.storage_meta(), rank == 0)
        local = self.prepare_local_plan(planner.create_local_plan())
        if dist.is_initialized():
            plans: list = [None] * dist.get_world_size()
            dist.all_gather_object(plans, local)
        else:
            plans = [local]
        global_plans, _ = planner.create_global_plan(plans)
        if rank == 0:
            global_plans = self.prepare_global_plan(global_plans)  # uncommits
        else:
            global_plans = [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
                            for i, p in enumerate(global_plans)]
        if dist.is_initialized():
            dist.barrier()  # nobody writes before the coordinator uncommitted
        final = planner.finish_plan(global_plans[rank])
        rank_file = self._plan_file(final, planner)
        rank_file.write_all(copy_host=True)
        for device, stream in rank_file.devices:
            rank_file.stager.fence_producer(device, stream)
        self._staged_file = rank_file
        self._staged = {}
        return state_dict

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """The ring is shared per process and kept for the next save."""

    # --- internals -------------------------------------------------------------

    def _plan_file(self, plan: SavePlan, planner: SavePlanner) -> _RankFile:
        prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _StoragePrefix) else f"__{self.rank}_"
        rank_file = _RankFile((self.buffer_bytes, self.buffers, self.io_threads, self.zip_crc32), self.path,
                              f"{prefix}0.distcp")
        # BYTE_IO items first, as torch's writer orders them.
        items = sorted(plan.items, key=lambda wi: wi.type != WriteItemType.BYTE_IO)
        for wi in items:
            rank_file.add(wi, planner.resolve_data(wi))
        return rank_file

    def _take_staged(self, plan: SavePlan) -> list[WriteResult]:
        rank_file, self._staged_file, self._staged = self._staged_file, None, None
        results = {r.index: r for r in rank_file.finish()}
        missing = [wi.index for wi in plan.items if wi.index not in results]
        if missing:
            raise RuntimeError(f"ckptfs StorageWriter: the save's plan has {len(missing)} item(s) that stage() "
                               f"did not write (first: {missing[0]}); async_save needs torch's DefaultSavePlanner")
        return [results[wi.index] for wi in plan.items]

    def _uncommit(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        removed = _remove(self.path / COMMIT_DIR / COMMIT_RECORD)
        removed |= _remove(self.path / METADATA)
        if removed:
            if (self.path / COMMIT_DIR).is_dir():
                _writer.sync_dir(str(self.path / COMMIT_DIR))
            _writer.sync_dir(str(self.path))

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> dict:
        """Builds the commit rows (checked in C++: every tensor tiled exactly
        once) and writes the commit record, durably, last."""
        tensors, chunks, byte_items = [], [], []
        paths = metadata.planner_data or {}
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
        root, rel = str(self.path.parent.resolve()), self.path.name
        return _writer.commit(root, rel, tensors, chunks, byte_items)
