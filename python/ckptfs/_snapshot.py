"""The snapshot mode of ``dcp.async_save`` (``StorageWriter(..., snapshot=True)``).

``stage()`` copies this rank's state dict into host memory that was
allocated on the first save and is reused by every later one, and returns
at once: the background save writes from the snapshot, so the training
thread never waits for the disk or the network. The cost is memory: one
copy of this rank's tensors, held for the life of the process (pinned when
CUDA is present, so device copies run at full speed). The default staging
(the bounded ring) stays the choice where memory is short.

Why it is faster than torch's default stager, which also copies into host
memory: torch allocates a new copy for every save, and the first touch of
fresh memory (page faults, zeroing) costs about as much as the copy itself.
Here the memory is touched once, and the copy is cut into pieces that
several threads run side by side (a tensor copy releases the GIL).

One snapshot per process, reallocated when the state dict's structure
changes (keys, shapes, dtypes, devices). A save reads the snapshot until
its ``write_data`` has written every byte; a ``stage()`` that starts before
then waits for it (a training loop that saves faster than its storage
absorbs must wait somewhere; torch's stager would instead hold a second
copy). The wait ends when that save has written its files, or when the
thread that ran it has ended (a save that failed before writing).
"""

from __future__ import annotations

import copy
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor

# Pieces of a tensor copied by one thread: large enough that scheduling is
# noise, small enough that a few large tensors still spread over the threads.
PIECE_BYTES = 32 << 20
DEFAULT_THREADS = min(8, os.cpu_count() or 1)


class Lease:
    """The snapshot's use by one save: from stage() until that save's
    write_data returned, or until the thread running the save ended."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.thread: threading.Thread | None = None  # the save's, set when it starts

    def over(self) -> bool:
        return self.done.is_set() or (self.thread is not None and not self.thread.is_alive())


class Snapshot:
    """A reusable host copy of one state dict's tensors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._signature: tuple | None = None
        self._staged: Any = None  # the state dict's structure, tensors in host memory
        self._lease: Lease | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.allocations = 0  # how many times memory was allocated (tests, tools)

    def take(self, state_dict: dict[str, Any], threads: int = DEFAULT_THREADS) -> tuple[dict[str, Any], Lease]:
        """Copies ``state_dict`` into the snapshot; returns the staged state
        dict (tensors in the snapshot, other values deep-copied) and the
        lease that the save must end."""
        self._wait_previous()
        with self._lock:
            signature = _signature(state_dict)
            if signature != self._signature:
                self._staged = None  # free the old copy before allocating the new one
                self._staged = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
                self._signature = signature
                self.allocations += 1
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            staged = _rebuild(state_dict, self._staged, pairs)
            self._copy(pairs, threads)
            self._lease = Lease()
            return staged, self._lease

    def _wait_previous(self) -> None:
        lease = self._lease
        while lease is not None and not lease.over():
            lease.done.wait(0.05)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> None:
        pieces = [p for src, dst in pairs for p in _pieces(src, dst)]
        if threads <= 1 or len(pieces) <= 1:
            for src, dst in pieces:
                dst.copy_(src, non_blocking=src.is_cuda)
        else:
            if self._pool is None or self._pool._max_workers != threads:
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptfs-snapshot")
            for f in [self._pool.submit(dst.copy_, src, non_blocking=src.is_cuda) for src, dst in pieces]:
                f.result()
        for device in {src.device for src, _ in pairs if src.is_cuda}:
            torch.cuda.synchronize(device)


def _local_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, DTensor):
        return [obj._local_tensor]
    if isinstance(obj, ShardedTensor):
        return [s.tensor for s in obj.local_shards()]
    return [obj]


def _signature(obj: Any, path: tuple = ()) -> tuple:
    """What the snapshot's memory depends on: every tensor's place in the
    structure, type, dtype, shape and device."""
    if isinstance(obj, torch.Tensor):
        return ((path, type(obj).__name__,
                 tuple((t.dtype, tuple(t.shape), str(t.device)) for t in _local_tensors(obj))),)
    if isinstance(obj, dict):
        return tuple(x for k, v in obj.items() for x in _signature(v, path + (k,)))
    if isinstance(obj, (list, tuple)):
        return ((path, type(obj).__name__, len(obj)),) + tuple(
            x for i, v in enumerate(obj) for x in _signature(v, path + (i,)))
    return ()


def _rebuild(src: Any, snap: Any, pairs: list) -> Any:
    """The staged state dict: ``src``'s structure with its tensors replaced
    by the snapshot's (their (source, snapshot) local tensors appended to
    ``pairs``) and its other values deep-copied, as they are now."""
    if isinstance(src, torch.Tensor):
        if snap is src or src.dim() == 0:  # torch's allocation keeps 0-d DTensors as they are
            return src.detach().clone() if not isinstance(src, DTensor) else copy.deepcopy(src)
        pairs.extend(zip(_local_tensors(src), _local_tensors(snap)))
        return snap
    if isinstance(src, dict):
        return {k: _rebuild(v, snap[k], pairs) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        return type(src)(_rebuild(v, s, pairs) for v, s in zip(src, snap))
    return copy.deepcopy(src)


def _pieces(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) pairs of at most about PIECE_BYTES each."""
    nbytes = src.numel() * src.element_size()
    if nbytes <= PIECE_BYTES or not (src.is_contiguous() and dst.is_contiguous()):
        return [(src, dst)]
    s, d = src.reshape(-1), dst.reshape(-1)
    step = max(1, PIECE_BYTES // src.element_size())
    return [(s[i:i + step], d[i:i + step]) for i in range(0, s.numel(), step)]


_SNAPSHOT = Snapshot()


def snapshot() -> Snapshot:
    """The process's snapshot."""
    return _SNAPSHOT
