"""Process plumbing shared by the ckptfs end-to-end tests and generators.

One version of each helper that several test files and generators used to
carry their own copy of:

- ``spawn_ranks(script, world_size, job, name=...)``: run a generator's
  ``_worker`` entry point on N gloo ranks (file:// rendezvous) and wait;
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

import atexit
import gc
import json
import os
import re
import shutil
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
# N gloo ranks as subprocesses
# ---------------------------------------------------------------------------


def end_rank() -> None:
    """Ends a rank process whose work is done and whose process group is
    destroyed, skipping only the interpreter's own finalization: there,
    torch's gloo threads have aborted finished ranks ("terminate called
    without an active exception", no Python frame on the stack). atexit
    handlers still run (ckptfs's pooled stagers join their I/O threads in
    one), so only torch's teardown is left out. Call it on success only: a
    rank that raised exits through the interpreter with its traceback."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(script: str, world_size: int, job: dict, *, name: str,
                env: dict | None = None, timeout: float = 300.0,
                tail: int = 4000, new_session: bool = False,
                tmp_prefix: str | None = None) -> None:
    """Runs ``world_size`` ranks as fresh processes
    ``python3 SCRIPT _worker RANK WORLD_SIZE INIT_FILE JOB_FILE`` and waits.

    Spawn semantics, but independent of the caller's ``__main__`` (works from
    pytest, ``python3 -``, notebooks...). ``job`` is written as JSON to
    JOB_FILE; INIT_FILE is a not-yet-existing path in a private temp dir, for
    ``init_process_group("gloo", init_method=f"file://{INIT_FILE}")``.

    Every rank gets ``OMP_NUM_THREADS=MKL_NUM_THREADS=1``, ``PYTHONFAULTHANDLER=1``, the caller's
    ``env`` overrides on top of os.environ, and ``GLOO_SOCKET_IFNAME=lo``
    unless already set. Each rank's stdout+stderr goes to its own log file
    (never a pipe: a chatty rank cannot block the others at a barrier).

    ``timeout`` bounds the whole run. With ``new_session`` each rank starts
    its own process group and a left-over rank is killed with its whole group
    (for ranks that spawn helpers of their own, e.g. megatron's Manager).

    Raises RuntimeError naming ``name`` with the last ``tail`` characters of
    every failed or timed-out rank's output. The temp dir is always removed
    and no rank is left running.
    """
    tmpd = tempfile.mkdtemp(prefix=tmp_prefix or f"{name}_pg_")
    init_file = os.path.join(tmpd, "filestore")  # must not exist yet
    job_file = os.path.join(tmpd, "job.json")
    with open(job_file, "w") as f:
        json.dump(job, f)
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT from C++) leaves its
    # Python stack in its log, which the error below shows.
    full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    full_env.update(env or {})
    full_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world_size):
            log = open(os.path.join(tmpd, f"rank{rank}.log"), "w+b")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(script), "_worker",
                 str(rank), str(world_size), init_file, job_file],
                env=full_env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=new_session))
        deadline = time.monotonic() + timeout
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            outs = []
            for r, _ in bad:
                logs[r].seek(0)
                outs.append(f"--- rank {r} ---\n"
                            + logs[r].read().decode(errors="replace")[-tail:])
            what = "failed or timed out" if timed_out else "failed"
            raise RuntimeError(f"{name} ranks {what} {bad}:\n" + "\n".join(outs))
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    if new_session:
                        os.killpg(p.pid, signal.SIGKILL)
                    else:
                        p.kill()
                except ProcessLookupError:
                    pass
                p.wait()
        for log in logs:
            log.close()
        shutil.rmtree(tmpd, ignore_errors=True)


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


def kill_mount_daemon(path) -> int:
    """SIGKILLs the `ckptfs mount` daemon serving ``path``: the kernel then
    fails the requests it had not answered, so that a test can end a reader
    that waits on a hung mount (a reader in a FUSE open ignores even
    SIGKILL). Returns how many processes were killed."""
    path = str(path)
    killed = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[1] == "mount" and path in argv and os.path.basename(argv[0]) == "ckptfs":
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
    return killed


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
