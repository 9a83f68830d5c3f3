"""``ckptfs.mount``: run ``ckptfs mount`` in the background, unmount on exit."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time


def ckptfs_binary() -> str:
    """The ``ckptfs`` CLI: $CKPTFS_BIN, else the one `pip install .` put on
    PATH (next to this interpreter first)."""
    env = os.environ.get("CKPTFS_BIN")
    if env:
        return env
    import sys
    beside = os.path.join(os.path.dirname(sys.executable), "ckptfs")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("ckptfs")
    if not found:
        raise FileNotFoundError("the ckptfs binary is not on PATH: `pip install .` from a ckptfs "
                                "checkout installs it, or set CKPTFS_BIN")
    return found


def _flags(options: dict) -> list[str]:
    """{"max_file_size": "1GB", "reindex": True} -> ["--max-file-size", "1GB", "--reindex"]."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, str(value)]
    return out


def _is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f if len(line.split()) > 1)


class Mount:
    """A running ``ckptfs mount``; ``path`` is the mount point. Use as a
    context manager (``with ckptfs.mount(src, mnt) as m:``) or call
    ``unmount()``."""

    def __init__(self, src: str, mnt: str | None = None, *, wait: float = 30.0, **options):
        self.src = os.path.abspath(src)
        self._made = mnt is None
        self.path = tempfile.mkdtemp(prefix="ckptfs-mnt-") if mnt is None else os.path.abspath(mnt)
        os.makedirs(self.path, exist_ok=True)
        cmd = [ckptfs_binary(), "mount", self.src, self.path, *_flags(options)]
        # The daemon keeps running after `ckptfs mount` exits 0 once mounted;
        # its output goes to a file, never to a pipe it could keep open.
        with tempfile.TemporaryFile() as err:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
            err.seek(0)
            msg = err.read().decode(errors="replace").strip()
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}: {msg}")
        deadline = time.monotonic() + wait
        while not _is_mounted(self.path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.path}: not mounted {wait:g} s after `ckptfs mount` exited 0: {msg}")
            time.sleep(0.05)

    def unmount(self, attempts: int = 50) -> None:
        """``fusermount3 -u``, retried while busy, then lazily (-z)."""
        for _ in range(attempts):
            if not _is_mounted(self.path):
                break
            subprocess.run(["fusermount3", "-u", self.path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if _is_mounted(self.path):
                time.sleep(0.1)
        else:
            subprocess.run(["fusermount3", "-u", "-z", self.path], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        if self._made and not _is_mounted(self.path):
            try:
                os.rmdir(self.path)
            except OSError:
                pass

    def __enter__(self) -> "Mount":
        return self

    def __exit__(self, *exc) -> None:
        self.unmount()


def mount(src: str, mnt: str | None = None, **options) -> Mount:
    """Mounts checkpoint root ``src`` on ``mnt`` (a fresh temp dir when None)
    with ``ckptfs mount``; keyword options become flags (``max_file_size=
    "1GB"`` -> ``--max-file-size 1GB``, ``reindex=True`` -> ``--reindex``).
    Returns a Mount, a context manager that unmounts on exit."""
    return Mount(src, mnt, **options)
