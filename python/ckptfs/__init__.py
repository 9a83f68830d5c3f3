"""ckptfs from Python.

- ``ckptfs.torch.StorageWriter(path)``: a torch.distributed.checkpoint
  StorageWriter whose files are standard DCP and whose save ends with a
  ckptfs commit record (docs/WRITER.md).
- ``ckptfs.mount(src, mnt, **options)``: ``ckptfs mount`` as a context
  manager for scripts and notebooks.
- ``ckptfs.crc32c(buf)``: the per-chunk checksum the writer stores.

``import ckptfs`` does not import torch; ``ckptfs.torch`` does.
"""

from __future__ import annotations

from ckptfs._mount import Mount, ckptfs_binary, mount
from ckptfs._writer import crc32c

__all__ = ["Mount", "ckptfs_binary", "crc32c", "mount"]
