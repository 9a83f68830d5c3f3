"""A save the writer refuses ends cleanly: the writer's I/O threads are
joined on the way out (not left to the interpreter's teardown), and rank
processes that exit through the refusal exit 1, with neither a writer
thread nor a gloo thread left running into the interpreter's finalization
(where a gloo worker that takes the GIL aborts the process).

Real torch, CPU, gloo; the refused dtype is complex32 with layout="hf"
(safetensors has no dtype for it), refused while planning: no file is
written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")
IO_THREAD = "ckptfs-io"  # what the stager names its I/O threads
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # torch's names for a gloo group's threads


def io_threads() -> int:
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == IO_THREAD
        except OSError:  # a thread that ended meanwhile
            pass
    return n


def io_threads_after_join() -> int:
    """io_threads() once the threads just joined are gone from /proc: a
    joined thread's join returns when the kernel clears its tid, a moment
    before the thread is removed from /proc/self/task. A thread still
    running (a stager left open) stays; one joined is gone within
    microseconds, well inside the 1 s allowed."""
    for _ in range(100):
        n = io_threads()
        if n == 0:
            return 0
        time.sleep(0.01)
    return n


def test_a_refused_save_leaves_no_writer_thread_running(tmp_path):
    from ckptfs.torch import StorageWriter, _close_stagers
    _close_stagers()  # earlier tests' pooled stagers
    good = {"w": torch.arange(3000, dtype=torch.float32)}
    dcp.save(good, storage_writer=StorageWriter(tmp_path / "good", buffer_bytes=4096))
    assert io_threads() > 0  # the pooled stagers, kept for the next save
    _close_stagers()
    assert io_threads_after_join() == 0
    refused = {"w": torch.arange(3000, dtype=torch.float32), "c": torch.zeros(8, dtype=torch.complex32)}
    with pytest.raises(CheckpointException) as e:
        dcp.save(refused, storage_writer=StorageWriter(tmp_path / "refused", layout="hf", buffer_bytes=4096))
    refusal = e.value.failures[0][0]  # (exception, traceback) per rank
    assert isinstance(refusal, TypeError) and "complex32" in str(refusal)
    assert e.tb is not None
    assert io_threads_after_join() == 0
    assert not (tmp_path / "refused").exists() or os.listdir(tmp_path / "refused") == []


# Runs a script as __main__ after registering, before anything else can, an
# atexit handler; handlers run last-registered first, so this one runs after
# every other (ckptfs's and torch's included), as the interpreter is about to
# finalize, and names the threads still alive then.
LAUNCHER = """\
import atexit, os, runpy, sys

def _threads_at_finalization():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    sys.stderr.write("threads at finalization: " + ",".join(sorted(names)) + "\\n")

atexit.register(_threads_at_finalization)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FINALIZATION_THREADS = "threads at finalization: "


def threads_at_finalization(log: str) -> list[str]:
    """The thread names a rank run through LAUNCHER reported, or [] when the
    line is missing (the caller checks it is there)."""
    lines = [ln for ln in log.splitlines() if ln.startswith(FINALIZATION_THREADS)]
    return lines[-1].removeprefix(FINALIZATION_THREADS).split(",") if lines else []


def _run_ranks(job: dict, world: int, tmpd: str, timeout: float = 120) -> list[tuple[int, str]]:
    """Runs the ranks of writer_gen.py JOB through LAUNCHER; [(exit status,
    log)] per rank (a negative status is the signal that ended it)."""
    launcher = os.path.join(tmpd, "launcher.py")
    with open(launcher, "w") as f:
        f.write(LAUNCHER)
    job_file = os.path.join(tmpd, "job.json")
    with open(job_file, "w") as f:
        json.dump(job, f)
    init = os.path.join(tmpd, "filestore")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, logs = [], []
    try:
        for rank in range(world):
            log = open(os.path.join(tmpd, f"rank{rank}.log"), "w+b")
            logs.append(log)
            argv = [sys.executable, launcher, GEN, "_worker", str(rank), str(world), init, job_file]
            procs.append(subprocess.Popen(argv,
                                          env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        out = []
        for p, log in zip(procs, logs):
            p.wait(timeout=timeout)
            log.seek(0)
            out.append((p.returncode, log.read().decode(errors="replace")))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def _check_rank(trial: int, rank: int, code: int, log: str) -> str | None:
    """Why this rank's exit is wrong, or None: it must exit 1 with the
    refusal, never abort, and leave no thread of ckptfs's stager or of
    torch's gloo process group to the interpreter's finalization."""
    where = f"trial {trial} rank {rank}"
    if code == -signal.SIGABRT or "terminate called" in log:
        return f"{where}: aborted (status {code})\n{log[-3000:]}"
    if code != 1 or "complex32" not in log:
        return f"{where}: status {code}, not 1 with the refusal\n{log[-3000:]}"
    threads = threads_at_finalization(log)
    if not threads:
        return f"{where}: the launcher's atexit handler did not report\n{log[-3000:]}"
    left = sorted(set(threads) & {IO_THREAD, *GLOO_THREADS})
    if left:
        return f"{where}: threads alive when the interpreter finalizes: {left}"
    return None


def test_ranks_that_exit_through_a_refused_save_exit_1_every_time(tmp_path):
    """Both ranks refuse while planning, before any file is written, and
    exit through the interpreter with the CheckpointException. A thread left
    running into finalization is what aborted such ranks, seldom (about 1
    exit in 30, when a gloo worker freed the last collective's tensors just
    as finalization began), so the check is on its cause, in every trial:
    no such thread is alive when the last atexit handler runs."""
    failures = []
    for trial in range(3):
        tmpd = tempfile.mkdtemp(prefix=f"refused{trial}-", dir=tmp_path)
        job = {"kind": "refused", "seed": trial, "dir": os.path.join(tmpd, "ckpt")}
        for rank, (code, log) in enumerate(_run_ranks(job, 2, tmpd)):
            if (why := _check_rank(trial, rank, code, log)) is not None:
                failures.append(why)
        left = [os.path.join(d, f) for d, _, files in os.walk(job["dir"]) for f in files]
        if left:
            failures.append(f"trial {trial}: a refused save left files: {left}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("url", ["gs://bucket/run/step_1", "hdfs://nn:8020/run/step_1", "file:///tmp/run/step_1"])
def test_a_url_is_refused_never_saved_into_a_local_folder(tmp_path, monkeypatch, url):
    """pathlib turns `gs://bucket/run` into the relative folder `gs:/bucket/run`;
    the writer refuses the URL instead, in the constructor and in reset (the
    checkpoint_id dcp.save passes), and nothing is created where the folder
    would have gone."""
    from ckptfs.torch import StorageWriter
    monkeypatch.chdir(tmp_path)
    scheme = url.split("://")[0]
    with pytest.raises(ValueError, match=f"{scheme}:// URL, not a directory"):
        StorageWriter(url)
    writer = StorageWriter(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=f"{scheme}:// URL, not a directory"):
        dcp.save({"w": torch.arange(8.0)}, checkpoint_id=url, storage_writer=writer)
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
