"""Process plumbing shared by the ckptfs end-to-end tests and generators.

One version of each helper that several test files and generators used to
carry their own copy of:

- ``spawn_ranks(script, world_size, job, name=...)``: run a generator's
  ``_worker`` entry point on N gloo ranks (file:// rendezvous) and wait
  (forked from a server for FORKED_GENERATORS);
- ``run_ckptfs(*args, index_dir=...)``: run the ckptfs CLI with output through
  temp files and, optionally, a private ``CKPTFS_INDEX_DIR``;
- ``describe(proc)``: a failed CompletedProcess, for assertion messages;
- ``is_mounted(path)`` / ``unmount(path)``: ``fusermount3 -u`` retried, then
  ``fusermount3 -u -z`` as a last resort;
- ``Mounted(root, ...)``: a context manager that runs ``ckptfs mount`` and
  always unmounts.

Import-light on purpose (no torch, no pytest): generator ranks import their
generator module, which imports this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

# The checkout this file belongs to: its build and its vendored fixtures.
REPO_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_BIN = os.path.join(REPO_DIR, "build", "ckptfs")
# Files written by other projects' tools (tests/fixtures/third_party/SOURCES.md).
THIRD_PARTY = os.path.join(REPO_DIR, "tests", "fixtures", "third_party")

# ---------------------------------------------------------------------------
# N gloo ranks as subprocesses (tools/ranks.py, shared with the demo)
# ---------------------------------------------------------------------------

sys.path.insert(0, os.path.join(REPO_DIR, "tools"))
import ranks  # noqa: E402
from ranks import end_rank  # noqa: E402,F401  (re-exported)

# The generators the writer tests start ranks of many times over: their
# ranks are forked from a server that imported torch once (ranks.py,
# _RankServer), which saves some 2 s of CPU per rank. The others start
# fresh processes: they run once per suite, or patch torch globally
# (bytecheckpoint_gen), or start helpers in sessions of their own
# (megatron_gen). CKPTFS_TEST_FRESH_RANKS=1 starts every rank fresh.
FORKED_GENERATORS = frozenset({"writer_gen.py", "writer_hf_gen.py", "writer_dtypes_gen.py"})


def spawn_ranks(script: str, world_size: int, job: dict, **kwargs) -> None:
    """ranks.spawn_ranks, forked from a server for FORKED_GENERATORS."""
    if os.path.basename(script) in FORKED_GENERATORS and not os.environ.get("CKPTFS_TEST_FRESH_RANKS"):
        kwargs.setdefault("fork_server", True)
    ranks.spawn_ranks(script, world_size, job, **kwargs)


# ---------------------------------------------------------------------------
# the ckptfs CLI
# ---------------------------------------------------------------------------


def ckptfs_bin() -> str:
    """$CKPTFS_BIN, default build/ckptfs of this checkout (not checked)."""
    return os.environ.get("CKPTFS_BIN", DEFAULT_BIN)


def require_bin(path: str | None = None) -> str:
    """The binary (default ckptfs_bin()); asserts that it is executable."""
    path = path or ckptfs_bin()
    assert os.path.isfile(path) and os.access(path, os.X_OK), (
        f"ckptfs binary not found at {path}: build it or set CKPTFS_BIN")
    return path


def run_ckptfs(*args, index_dir: str | None = None, env: dict | None = None,
               bin_path: str | None = None, timeout: float = 120, cwd=None,
               text_stdout: bool = False, text_stderr: bool = True) -> subprocess.CompletedProcess:
    """Runs ``ckptfs ARGS...`` (args pass through str()) and returns the
    CompletedProcess: stdout bytes (text with ``text_stdout``), stderr text
    (bytes with ``text_stderr=False``), both decoded with errors="replace".

    ``env`` (default os.environ) is copied; ``index_dir`` sets
    ``CKPTFS_INDEX_DIR`` in the copy, so ~/.cache is never touched.
    ``bin_path`` defaults to ckptfs_bin() and must be executable.
    Output goes through temp files, not pipes: a daemonized ``ckptfs mount``
    must not keep our pipe open."""
    b = require_bin(bin_path)
    run_env = dict(os.environ if env is None else env)
    if index_dir is not None:
        run_env["CKPTFS_INDEX_DIR"] = str(index_dir)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.run([b, *map(str, args)], stdout=out, stderr=err,
                           stdin=subprocess.DEVNULL, env=run_env, timeout=timeout, cwd=cwd)
        out.seek(0)
        err.seek(0)
        o, e = out.read(), err.read()
    return subprocess.CompletedProcess(
        p.args, p.returncode,
        o.decode(errors="replace") if text_stdout else o,
        e.decode(errors="replace") if text_stderr else e)


def describe(p: subprocess.CompletedProcess, stdout_chars: int = 300) -> str:
    """A CompletedProcess for an assertion message: the command, its exit
    status, the last 3000 characters of stderr and the first
    ``stdout_chars`` of stdout."""
    err = p.stderr.decode(errors="replace") if isinstance(p.stderr, bytes) else (p.stderr or "")
    out = p.stdout if isinstance(p.stdout, (bytes, str)) else b""
    return (f"`{' '.join(map(str, p.args))}` exited {p.returncode}\n"
            f"stderr: {err.strip()[-3000:]}\nstdout ({len(out)}): {out[:stdout_chars]!r}")


# ---------------------------------------------------------------------------
# mounting
# ---------------------------------------------------------------------------


def _unescape_mount_path(s: str) -> str:
    # /proc/self/mounts escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def is_mounted(path) -> bool:
    """True when ``path`` is a mount point (works for a dead FUSE daemon too,
    where stat() fails with ENOTCONN and os.path.ismount says False)."""
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 1 and _unescape_mount_path(parts[1]) == path:
                return True
    return False


def unmount(path, *, attempts: int = 20, collect: bool = True) -> None:
    """Unmounts ``path`` if mounted: ``fusermount3 -u``, retried ``attempts``
    times 0.2 s apart while busy, then ``fusermount3 -u -z`` (lazy) as a last
    resort, then waits up to 5 s for the mount to go.

    With ``collect`` a gc.collect() runs before each try, dropping numpy
    memmaps / safetensors mmaps of the mount that would keep it busy."""
    path = str(path)
    for _ in range(attempts):
        if not is_mounted(path):
            return
        if collect:
            gc.collect()
        subprocess.run(["fusermount3", "-u", path], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        if not is_mounted(path):
            return
        time.sleep(0.2)
    subprocess.run(["fusermount3", "-u", "-z", path], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    for _ in range(50):
        if not is_mounted(path):
            return
        time.sleep(0.1)


def mount_daemon_pids(path) -> list[int]:
    """The `ckptfs mount` daemons serving ``path`` (by their command line)."""
    path = str(path)
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[1] == "mount" and path in argv and os.path.basename(argv[0]) == "ckptfs":
            pids.append(int(pid))
    return pids


def mount_daemon_pid(path) -> int:
    """The one `ckptfs mount` daemon serving ``path``."""
    pids = mount_daemon_pids(path)
    assert len(pids) == 1, f"{len(pids)} ckptfs daemons serve {path}: {pids}"
    return pids[0]


def kill_mount_daemon(path) -> int:
    """SIGKILLs the `ckptfs mount` daemon serving ``path``: the kernel then
    fails the requests it had not answered, so that a test can end a reader
    that waits on a hung mount (a reader in a FUSE open ignores even
    SIGKILL). Returns how many processes were killed."""
    pids = mount_daemon_pids(path)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


class MountPoint:
    """Paths of a mount for anything with ``.path`` (the mount point) and
    ``.log_path`` (its ``--log-file``): ``p(*rel)`` and ``log()``."""

    path: str
    log_path: str

    def p(self, *rel: str) -> str:
        return os.path.join(self.path, *rel)

    def log(self) -> str:
        """The daemon's log so far ("" before it exists)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


class Mounted(MountPoint):
    """``with Mounted(root, base_dir=..., index_dir=...) as m:`` runs
    ``ckptfs mount ROOT MNT --log-file LOG ARGS...`` (it daemonizes once
    mounted), waits until MNT shows in /proc/self/mounts and always unmounts
    on exit, also when the body or the mount itself fails.

    ``mnt`` defaults to a fresh ``mkdtemp(prefix="mnt-", dir=base_dir)``,
    removed again after a clean unmount; ``log_file`` defaults to MNT.log.
    A failed mount (exit != 0) or one that does not show up within ``wait``
    seconds raises AssertionError with describe() of the mount command.

    m.path is the mount point, m.p(*rel) a path inside it, m.log() the log,
    m.result the mount command's CompletedProcess."""

    def __init__(self, root, *args, mnt=None, base_dir=None, log_file=None,
                 index_dir=None, env=None, wait: float = 20.0, collect: bool = True):
        self.root = str(root)
        self.args = tuple(args)
        self._made_mnt = mnt is None
        self.path = tempfile.mkdtemp(prefix="mnt-", dir=base_dir) if mnt is None else str(mnt)
        self.log_path = str(log_file) if log_file is not None else self.path + ".log"
        self.index_dir, self.env = index_dir, env
        self.wait, self.collect = wait, collect
        self.result: subprocess.CompletedProcess | None = None

    def __enter__(self) -> "Mounted":
        os.makedirs(self.path, exist_ok=True)
        try:
            self.result = run_ckptfs("mount", self.root, self.path, "--log-file", self.log_path,
                                     *self.args, index_dir=self.index_dir, env=self.env)
            assert self.result.returncode == 0, "mount failed\n" + describe(self.result)
            deadline = time.monotonic() + self.wait
            while not is_mounted(self.path):
                assert time.monotonic() < deadline, (
                    f"{self.path} not mounted {self.wait:g} s after `ckptfs mount` exited 0\n"
                    + describe(self.result))
                time.sleep(0.05)
        except BaseException:
            self._cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        unmount(self.path, collect=self.collect)
        if self._made_mnt and not is_mounted(self.path):
            try:
                os.rmdir(self.path)
            except OSError:
                pass


def evict(path: str) -> None:
    """Drops the file's clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_ahead_bytes(path: str) -> int:
    """The kernel's read-ahead window for files on the block device holding
    `path` (its queue's read_ahead_kb; a partition's is its disk's)."""
    st = os.stat(path)
    dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for queue in (os.path.join(dev, "queue"), os.path.join(dev, "..", "queue")):
        if os.path.exists(os.path.join(queue, "read_ahead_kb")):
            with open(os.path.join(queue, "read_ahead_kb")) as f:
                return int(f.read()) << 10
    raise RuntimeError(f"{path}: no block device queue under {dev} to read read_ahead_kb from")


_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(path: str, lo: int = 0, hi: int | None = None) -> int:
    """Bytes of the pages of [lo, hi) of `path` (default: all of it) that are
    in the page cache (mincore on a private mapping: its pages are the
    file's until written)."""
    if hi is None:
        hi = os.path.getsize(path)
    page = mmap.PAGESIZE
    lo -= lo % page
    pages = (hi - lo + page - 1) // page
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), hi - lo, access=mmap.ACCESS_COPY, offset=lo)
    try:
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(hi - lo), vec)
        del anchor
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(page for v in vec if v & 1)
    finally:
        m.close()
