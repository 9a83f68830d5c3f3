"""N gloo ranks as subprocesses: the spawner the demo, the end-to-end tests
and their generators share (tests/e2e/harness.py re-exports it).

- ``spawn_ranks(script, world_size, job, name=...)``: run a script's
  ``_worker`` entry point on N gloo ranks (file:// rendezvous) and wait;
  with ``fork_server=True`` the ranks are forked from a server that
  imported the script (and so torch) once (``RankServer``, which tests that
  start and kill ranks themselves use directly);
- ``end_rank()``: end a rank whose work is done, past torch's teardown.

Import-light on purpose (no torch): every rank imports it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

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
                tmp_prefix: str | None = None, fork_server: bool = False) -> None:
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

    With ``fork_server`` the ranks are forked from a ``RankServer`` of the
    script instead (a rank then saves the seconds of CPU that importing
    torch costs); the script must be importable without side effects and
    its ``_worker`` must not depend on being ``__main__``.

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
            log_path = os.path.join(tmpd, f"rank{rank}.log")
            log = open(log_path, "w+b")
            logs.append(log)
            argv = [os.path.abspath(script), "_worker", str(rank), str(world_size), init_file, job_file]
            if fork_server:
                procs.append(RankServer.of(argv[0], full_env).fork(argv, full_env, log_path, new_session))
                continue
            procs.append(subprocess.Popen(
                [sys.executable, *argv], env=full_env, stdout=log, stderr=subprocess.STDOUT,
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
# ranks forked from a server that imported the script once
# ---------------------------------------------------------------------------


# Modules the ranks of torch.distributed scripts import lazily (the state
# dict helpers, FSDP2, DTensor's meshes, DCP's HF storage, ckptfs's writer):
# a server imports them before it forks.
RANK_SERVER_PRELOAD = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                       "torch.distributed.device_mesh", "torch.distributed.fsdp", "ckptfs.torch")

# Variables nothing reads while a script is imported, only while a rank
# runs: ranks that differ only in these share a server.
_READ_WHEN_RUN = ("AWS_", "PYTEST_CURRENT_TEST")


class ForkedRank:
    """What spawn_ranks needs of a Popen, for a rank a RankServer forked:
    its exit status comes from the server, which reaps it."""

    def __init__(self, pid: int, server: "RankServer"):
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> int | None:
        return self._server.status(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended, its status not yet read
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RankServer:
    """``python3 ranks.py _serve SCRIPT``: imports SCRIPT (and so torch)
    once, then forks a rank per request. One per script and environment
    (but for _READ_WHEN_RUN: each rank gets its caller's) for the life of
    the calling process. Requests and answers are JSON lines: the caller
    sends ``[argv, env, log_path, new_session]`` and gets ``["pid", P]``;
    the server reaps its ranks and sends ``["exit", P, RETURNCODE]``
    (negative: killed by that signal, as Popen says)."""

    _servers: dict = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, script: str, env: dict) -> "RankServer":
        key = (script, tuple(sorted((k, v) for k, v in env.items() if not k.startswith(_READ_WHEN_RUN))))
        with cls._lock:
            server = cls._servers.get(key)
            if server is None or server._proc.poll() is not None:
                server = cls._servers[key] = cls(script, env)
            return server

    def __init__(self, script: str, env: dict):
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_serve", script], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
                                      bufsize=1)
        self._cond = threading.Condition()
        self._pids: list[int] = []  # answers to fork requests, in order
        self._exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self._proc.stdin.close)

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if msg[0] == "pid":
                    self._pids.append(msg[1])
                else:
                    self._exits[msg[1]] = msg[2]
                self._cond.notify_all()
        with self._cond:  # the server is gone: no answer will come
            self._cond.notify_all()

    def fork(self, argv: list, env: dict, log_path: str, new_session: bool) -> ForkedRank:
        with self._cond:
            self._proc.stdin.write(json.dumps([argv, env, log_path, new_session]) + "\n")
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: self._pids or self._proc.poll() is not None, timeout=120):
                raise RuntimeError(f"the rank server of {argv[0]} did not fork in 120 s")
            if not self._pids:
                raise RuntimeError(f"the rank server of {argv[0]} exited {self._proc.returncode}")
            return ForkedRank(self._pids.pop(0), self)

    def status(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._proc.poll() is not None, timeout=timeout)
            return self._exits.get(pid)


def _serve(script: str) -> None:
    """The server's side of RankServer: no thread of its own (it forks)."""
    import importlib
    import importlib.util
    sys.path.insert(0, os.path.dirname(script))
    spec = importlib.util.spec_from_file_location("_rank_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # What every rank would import lazily, imported once here.
    for name in RANK_SERVER_PRELOAD:
        importlib.import_module(name)
    out = sys.stdout
    buf = b""
    children: set[int] = set()
    eof = False
    while not eof or children:
        if not eof and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 1 << 16)
            eof = not chunk
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                pid = _fork_rank(module, *json.loads(line))
                children.add(pid)
                out.write(json.dumps(["pid", pid]) + "\n")
                out.flush()
        elif eof:
            time.sleep(0.05)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    out.write(json.dumps(["exit", pid, code]) + "\n")
                    out.flush()
                except BrokenPipeError:
                    pass


def _fork_rank(module, argv: list, env: dict, log_path: str, new_session: bool) -> int:
    """Forks a rank that runs ``module._worker`` as ``python3 SCRIPT
    _worker RANK WORLD INIT_FILE JOB_FILE`` would: its environment exactly
    ``env``, stdout and stderr into log_path, exit 0 through end_rank, or
    1 with the traceback."""
    pid = os.fork()
    if pid:
        return pid
    try:
        if new_session:
            os.setsid()
        os.environ.clear()
        os.environ.update(env)
        sys.argv = list(argv)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if "numpy" in sys.modules:  # its global generator, seeded afresh as in a new process
            sys.modules["numpy"].random.seed()
        _, _, rank, world, init_file, job_file = argv
        with open(job_file) as f:
            module._worker(int(rank), int(world), init_file, json.load(f))
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    end_rank()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_serve":
        _serve(sys.argv[2])
    else:
        sys.exit("usage: ranks.py _serve SCRIPT (see RankServer)")
