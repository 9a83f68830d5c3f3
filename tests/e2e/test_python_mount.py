"""``ckptfs.mount`` from Python: whatever interrupts it, nothing stays mounted
or running; a mountpoint that is a file is refused with what to do.

What is left is judged from outside the process under test: the mount
table (/proc/self/mountinfo) and every process's command line.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import np_ckpt
from harness import ckptfs_bin, is_mounted, require_bin, unmount

# Enough tensors that indexing makes the start-up last a while, so that
# interrupts land inside it.
MANY = {f"model.layers.{i}.w": ((4, 3), np.float32, 0) for i in range(30_000)}

CHILD = textwrap.dedent("""
    import sys, time
    import ckptfs
    src, mnt, idx = sys.argv[1:4]
    print("start", flush=True)
    try:
        m = ckptfs.mount(src, mnt, index=idx)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
    print("mounted", flush=True)
    time.sleep(120)
""")


@pytest.fixture(scope="module")
def many_tensors(tmp_path_factory):
    require_bin()
    return np_ckpt.write(str(tmp_path_factory.mktemp("src") / "ckpt"), world_size=2, specs=MANY)


def _daemons(mnt: str) -> list[int]:
    """Pids of ckptfs processes whose command line names ``mnt``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"ckptfs" and mnt.encode() in argv:
            found.append(int(pid))
    return found


def _leftovers(mnt: str) -> list[str]:
    """What a trial left behind (and then removes it, so that the next
    trial starts clean)."""
    left = []
    if is_mounted(mnt):
        left.append(f"{mnt} still mounted")
        unmount(mnt, attempts=2)
    # A daemon may still be exiting after its unmount: give it a moment.
    deadline = time.monotonic() + 5
    while _daemons(mnt) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in _daemons(mnt):
        left.append(f"ckptfs daemon {pid} still running")
        os.kill(pid, signal.SIGKILL)
    return left


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError(f"the child printed nothing for {timeout} s")
        return proc.stdout.readline().decode().strip()
    finally:
        sel.close()


def _trial(src: str, mnt: str, idx: str, delay: float | None) -> tuple[str, float]:
    """Runs CHILD; ``delay`` s after it calls ckptfs.mount (None: once it is
    mounted) sends SIGINT to the child only. Returns what the child said
    last ("interrupted": inside mount(); "mounted": after it) and the time
    from the call to the mount."""
    env = dict(os.environ, CKPTFS_BIN=ckptfs_bin())
    proc = subprocess.Popen([sys.executable, "-c", CHILD, src, mnt, idx], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
    try:
        assert _readline(proc, 60) == "start"
        t0 = time.monotonic()
        said = "start"
        if delay is None:
            said = _readline(proc, 60)
        else:
            time.sleep(delay)
        took = time.monotonic() - t0
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        rest = proc.stdout.read().decode().split()
        return (rest[-1] if rest else said), took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_sigint_at_any_moment_of_mount_leaves_nothing(many_tensors, tmp_path):
    src = many_tensors.path
    mnt = str(tmp_path / "mnt")
    os.makedirs(mnt)
    # Uninterrupted, to learn how long a start-up takes here (a fresh index
    # each time: indexing is part of it); then interrupted after the mount.
    problems, windows = [], []
    for i in range(3):
        said, took = _trial(src, mnt, str(tmp_path / f"idx-base-{i}"), None)
        assert said == "mounted"
        windows.append(took)
        problems += [f"after the mount: {p}" for p in _leftovers(mnt)]
    window = sorted(windows)[1]
    outcomes = []
    trials = 14
    for i in range(trials):
        delay = window * 1.2 * i / (trials - 1)  # from at once to just past the start-up
        said, _ = _trial(src, mnt, str(tmp_path / f"idx-{i + 1}"), delay)
        outcomes.append(said)
        problems += [f"SIGINT {delay:.3f} s into mount() ({said}): {p}" for p in _leftovers(mnt)]
    assert not problems, "\n".join(problems)
    # The interrupts did land inside the start-up (mount() raised).
    assert outcomes.count("interrupted") >= trials // 3, (windows, outcomes)
    assert os.listdir(mnt) == []


def test_a_finished_mount_is_unmounted_and_its_daemon_ended(many_tensors, tmp_path):
    import ckptfs
    mnt = str(tmp_path / "mnt")
    with ckptfs.mount(many_tensors.path, mnt, index=str(tmp_path / "idx")) as m:
        assert is_mounted(mnt)
        assert m.pid in _daemons(mnt)
        got = np.load(os.path.join(mnt, "tensors", "model.layers.7.w.npy"))
        assert np.array_equal(got, many_tensors.tensors["model.layers.7.w"])
        m.unmount()
        m.unmount()  # twice is harmless
    assert not is_mounted(mnt) and _daemons(mnt) == []


def test_a_dropped_mount_is_unmounted_when_collected(many_tensors, tmp_path):
    import ckptfs
    mnt = str(tmp_path / "mnt")
    m = ckptfs.mount(many_tensors.path, mnt, index=str(tmp_path / "idx"))
    assert is_mounted(mnt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del m
        gc.collect()
    assert not is_mounted(mnt) and _daemons(mnt) == []
    assert any(issubclass(w.category, ResourceWarning) for w in caught)


def test_a_failed_start_raises_with_the_clis_message_and_leaves_nothing(tmp_path):
    import ckptfs
    missing = str(tmp_path / "no-such-checkpoint")
    mnt = str(tmp_path / "mnt")
    with pytest.raises(RuntimeError, match="no-such-checkpoint: not a directory"):
        ckptfs.mount(missing, mnt, index=str(tmp_path / "idx"))
    assert not is_mounted(mnt) and _daemons(mnt) == []


def test_an_s3_root_is_mounted_as_the_cli_mounts_it(s3_env, tmp_path):
    """ckptfs.mount("s3://...") passes the URL on (it was made a local path,
    ".../s3:/bucket/..."): the step saved there by stock dcp.save reads back
    through consolidated/ as safetensors reads it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from s3_server import BUCKET
    import ckptfs
    from ckptfs.torch import StorageWriter
    g = torch.Generator().manual_seed(5)
    sd = {"a.weight": torch.randn(40, 24, generator=g), "b.bias": torch.randn(24, generator=g).bfloat16()}
    dcp.save(sd, storage_writer=StorageWriter(f"s3://{BUCKET}/pymount/step_1"), no_dist=True)
    with ckptfs.mount(f"s3://{BUCKET}/pymount", str(tmp_path / "mnt"), index=str(tmp_path / "idx")) as m:
        got = load_file(os.path.join(m.path, "step_1", "consolidated", "model.safetensors"))
    assert got.keys() == sd.keys()
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in sd.items())


def test_mounting_onto_a_file_says_what_to_do(many_tensors, tmp_path):
    import ckptfs
    target = tmp_path / "a-file"
    target.write_text("keep me")
    with pytest.raises(NotADirectoryError) as e:
        ckptfs.mount(many_tensors.path, str(target), index=str(tmp_path / "idx"))
    msg = str(e.value)
    assert f"mountpoint {target} is not a directory" in msg
    assert "empty directory" in msg and "mnt=None" in msg
    assert target.read_text() == "keep me"
    assert _daemons(str(target)) == []
