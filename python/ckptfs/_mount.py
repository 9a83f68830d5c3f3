"""``ckptfs.mount``: ``ckptfs mount -f`` as a child process this process
owns, unmounted and ended on every way out.

The daemon runs in the foreground mode of the CLI, started with
``posix_spawn`` as the leader of a new session: an interrupt meant for
Python (Ctrl-C, a notebook's "interrupt kernel") never reaches it, and
stopping its process group also stops the ``fusermount3`` it may be running.
Owning the process is what lets every path clean up: the CLI's background
mode forks a child that mounts whether or not the parent is still there.

While the mount starts, SIGINT is held back (Python's handler only records
it); an interrupt stops the daemon, removes anything it mounted, and only
then is raised. The same hold covers ``unmount()``, so a second interrupt
cannot cut a cleanup short. A ``Mount`` that is dropped without
``unmount()`` is unmounted when it is collected or when the interpreter
exits (``weakref.finalize``, as ``tempfile.TemporaryDirectory`` does).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref

FSTYPE = "fuse.ckptfs"  # what /proc/self/mountinfo says of our mounts (subtype=ckptfs)
STOP_GRACE_S = 5.0  # how long the daemon gets to unmount and exit after SIGTERM


def ckptfs_binary() -> str:
    """The ``ckptfs`` CLI: $CKPTFS_BIN, else the one `pip install .` put on
    PATH (next to this interpreter first)."""
    env = os.environ.get("CKPTFS_BIN")
    if env:
        return env
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


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_type(path: str) -> str | None:
    """The filesystem type mounted on ``path`` (the last mount there), or
    None. Read from mountinfo, so a dead FUSE mount (stat fails with
    ENOTCONN) still counts."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 7 or _unescape(fields[4]) != path:
                continue
            sep = fields.index("-", 6)
            found = fields[sep + 1]
    return found


def _fusermount(path: str, *args: str) -> None:
    subprocess.run(["fusermount3", "-u", *args, path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


# --- holding SIGINT back ---------------------------------------------------------

class _Held:
    """SIGINTs received while held; re-delivered on release."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum, frame) -> None:
        self.count += 1


@contextlib.contextmanager
def _sigint_held():
    """Runs the body with SIGINT recorded instead of raised, then hands a
    recorded one to the handler that was in place. Python runs signal
    handlers in the main thread only, so elsewhere there is nothing to hold
    (and signal.signal may not be called)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = signal.getsignal(signal.SIGINT)
    if isinstance(previous, _Held):  # nested: the outer hold re-delivers
        yield previous
        return
    if previous is None or previous == signal.SIG_IGN:  # not ours to restore / nothing to hold
        yield None
        return
    held = _Held()
    signal.signal(signal.SIGINT, held)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
        if held.count:
            if callable(previous):
                previous(signal.SIGINT, sys._getframe())
            else:  # SIG_DFL: the process ends, as it would have, after the cleanup
                os.kill(os.getpid(), signal.SIGINT)


# --- the daemon --------------------------------------------------------------------

class _Daemon:
    """What a Mount owns: the daemon's pid (its process group too), the
    mount point, and what to remove once both are gone. Holds no reference
    to the Mount, so a finalizer can use it."""

    def __init__(self, pid: int, path: str, made_dir: bool, log_path: str, own_log: bool) -> None:
        self.pid, self.path, self.made_dir = pid, path, made_dir
        self.log_path, self.own_log = log_path, own_log
        self.owner = os.getpid()  # a forked child must not stop its parent's mount
        self.status: int | None = None  # wait status once reaped
        self.stopped = False

    def exited(self) -> bool:
        """True once the daemon has exited (not reaped yet: its pid and
        process group stay reserved until reap())."""
        if self.status is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else (SIGCHLD ignored, os.wait())
            self.status = -1
            return True
        return info is not None

    def reap(self) -> None:
        if self.status is None:
            try:
                _, self.status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.status = -1

    def wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.exited():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def signal_group(self, sig: int) -> None:
        if self.status is None:  # a zombie leader still reserves the group id
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def mounted(self) -> bool:
        return _mount_type(self.path) == FSTYPE

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read().strip()
        except OSError:
            return ""

    def end(self, grace: float) -> None:
        """Lets the daemon exit by itself for ``grace`` s, then SIGTERM (its
        FUSE loop ends and unmounts), then SIGKILL; whatever else is left in
        its group (a fusermount3 mid-mount) is killed before it is reaped."""
        if not self.wait(grace):
            self.signal_group(signal.SIGTERM)
            if not self.wait(STOP_GRACE_S):
                self.signal_group(signal.SIGKILL)
                self.wait(STOP_GRACE_S)
        self.signal_group(signal.SIGKILL)
        self.reap()

    def stop(self, busy_tries: int) -> None:
        """Unmounts (``fusermount3 -u``, ``busy_tries`` times 0.1 s apart
        while busy, then lazily) and ends the daemon; then removes a dead
        mount it left. busy_tries=0: a start-up being undone, SIGTERM at once."""
        if self.stopped or os.getpid() != self.owner:
            return
        with _sigint_held():
            if busy_tries and not self.exited():
                for _ in range(busy_tries):
                    if not self.mounted():
                        break
                    _fusermount(self.path)
                    if self.mounted():
                        time.sleep(0.1)
                else:
                    _fusermount(self.path, "-z")
            self.end(grace=STOP_GRACE_S if busy_tries else 0.0)
            # Nothing of the daemon runs any more: a mount still there is its
            # dead one (killed mid-mount), and nothing can mount here again.
            if self.mounted():
                _fusermount(self.path, "-z")
            self.stopped = True
            if self.made_dir and not self.mounted():
                with contextlib.suppress(OSError):
                    os.rmdir(self.path)
            if self.own_log:
                with contextlib.suppress(OSError):
                    os.unlink(self.log_path)


def _spawn(cmd: list[str], log_path: str) -> int:
    """``cmd`` as a new session, stdin /dev/null, stdout and stderr appended
    to ``log_path``. posix_spawn is one call: no window in which the child
    exists and this process does not yet know its pid."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_DUP2, fd, 1), (os.POSIX_SPAWN_DUP2, fd, 2)]
        # Python ignores SIGPIPE and SIGXFSZ; an exec'd program should not.
        return os.posix_spawnp(cmd[0], cmd, dict(os.environ), file_actions=actions, setsid=True,
                               setsigmask=(), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    finally:
        os.close(fd)


def _new_log() -> str:
    fd, path = tempfile.mkstemp(prefix="ckptfs-mount-", suffix=".log")
    os.close(fd)
    return path


def _check_mountpoint(path: str) -> None:
    """What the CLI checks, said for Python callers before anything starts."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(
            f"mountpoint {path} is not a directory: ckptfs mounts on an empty directory. Pass a new or "
            "empty directory as mnt (mount() creates a missing one), or mnt=None for a fresh temporary one")
    os.makedirs(path, exist_ok=True)
    if _mount_type(os.path.realpath(path)) is not None:
        raise RuntimeError(f"mountpoint {path} is already mounted (unmount it first: fusermount3 -u {path})")


class Mount:
    """A running ``ckptfs mount``; ``path`` is the mount point, ``log_path``
    the daemon's log. Use as a context manager (``with ckptfs.mount(src,
    mnt) as m:``) or call ``unmount()``. The mount lasts while this object
    does: one dropped without unmount() is unmounted when collected, or at
    interpreter exit."""

    def __init__(self, src: str, mnt: str | None = None, *, wait: float | None = None,
                 log_file: str | None = None, **options):
        binary = ckptfs_binary()  # before anything is made that would need removing
        # An s3:// root goes to the CLI as it is (its flags: endpoint_url=..., region=...).
        self.src = src if os.fspath(src).startswith("s3://") else os.path.abspath(src)
        made = mnt is None
        if not made:
            _check_mountpoint(os.path.abspath(mnt))
        for key in ("foreground", "f", "log_file"):
            options.pop(key, None)  # the daemon is ours: foreground, output to log_path
        self._daemon: _Daemon | None = None
        with _sigint_held() as held:  # from the first thing made that would need removing
            # realpath: as mountinfo shows it.
            self.path = os.path.realpath(tempfile.mkdtemp(prefix="ckptfs-mnt-") if made else mnt)
            self.log_path = os.path.abspath(log_file) if log_file else _new_log()
            cmd = [binary, "mount", "-f", self.src, self.path, *_flags(options)]
            try:
                self._daemon = _Daemon(_spawn(cmd, self.log_path), self.path, made, self.log_path,
                                       own_log=not log_file)
                self._finalizer = weakref.finalize(self, _implicit_stop, self._daemon)
                up = self._wait_until_mounted(cmd, wait, held)
            except BaseException:
                self._undo_start(made, own_log=not log_file)
                raise
            # Interrupted while starting, or as the mount came up: undone
            # here, then the hold's exit raises the KeyboardInterrupt.
            # (One arriving after the hold ends, before the caller holds
            # this object, is left to the finalizer.)
            if not up or (held is not None and held.count):
                self._undo_start(made, own_log=not log_file)

    def _undo_start(self, made: bool, own_log: bool) -> None:
        if self._daemon is not None:
            self._daemon.stop(busy_tries=0)
            self._finalizer.detach()
            return
        if own_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)

    def _wait_until_mounted(self, cmd: list[str], wait: float | None, held: _Held | None) -> bool:
        """True once the daemon's mount is up, False on an interrupt
        (``held`` recorded one); raises when the daemon exits first or
        ``wait`` s pass. The caller stops the daemon in all but the first."""
        d = self._daemon
        deadline = None if wait is None else time.monotonic() + wait
        while not d.mounted():
            if held is not None and held.count:
                return False
            if d.exited():
                d.reap()
                code = os.waitstatus_to_exitcode(d.status) if d.status >= 0 else "?"
                raise RuntimeError(f"`{' '.join(cmd)}` exited {code}: {d.log_text()}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: not mounted {wait:g} s after `{' '.join(cmd)}` started; "
                                   f"its log so far: {d.log_text()}")
            time.sleep(0.02)
        return True

    def unmount(self, attempts: int = 50) -> None:
        """``fusermount3 -u``, retried while busy (``attempts`` times, 0.1 s
        apart), then lazily (-z); then ends the daemon. Safe to call twice;
        a second interrupt while it runs waits for it to finish."""
        if self._daemon is not None:
            self._daemon.stop(busy_tries=max(1, attempts))
            self._finalizer.detach()

    @property
    def pid(self) -> int | None:
        """The daemon's process id (None once stopped)."""
        d = self._daemon
        return None if d is None or d.stopped else d.pid

    def __enter__(self) -> "Mount":
        return self

    def __exit__(self, *exc) -> None:
        self.unmount()


def _implicit_stop(daemon: _Daemon) -> None:
    if not daemon.stopped and os.getpid() == daemon.owner:
        with contextlib.suppress(Exception):  # warnings may be gone at interpreter exit
            warnings.warn(f"ckptfs: unmounting {daemon.path}, whose Mount was dropped without unmount()",
                          ResourceWarning, stacklevel=2)
    daemon.stop(busy_tries=50)


def mount(src: str, mnt: str | None = None, **options) -> Mount:
    """Mounts checkpoint root ``src`` (a directory, or ``s3://BUCKET/PREFIX``
    as ``ckptfs mount`` takes it) on ``mnt`` (created when missing; a
    fresh temp dir when None) with ``ckptfs mount``; keyword options become
    flags (``max_file_size="1GB"`` -> ``--max-file-size 1GB``,
    ``reindex=True`` -> ``--reindex``), ``log_file`` names the daemon's log
    (default: a temp file, removed after a clean unmount), ``wait`` bounds
    the start-up in seconds (default: none; indexing a large tree takes a
    while). Returns a Mount, a context manager that unmounts on exit. An
    interrupt or error during start-up leaves nothing mounted or running."""
    return Mount(src, mnt, **options)
