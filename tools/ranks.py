"""N gloo ranks as subprocesses: the spawner the demo, the end-to-end tests
and their generators share (tests/e2e/harness.py re-exports it).

- ``spawn_ranks(script, world_size, job, name=...)``: run a script's
  ``_worker`` entry point on N gloo ranks (file:// rendezvous) and wait;
- ``end_rank()``: end a rank whose work is done, past torch's teardown.

Import-light on purpose (no torch): every rank imports it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
