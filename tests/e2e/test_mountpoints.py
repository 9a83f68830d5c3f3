"""Mountpoint checks of `ckptfs mount`, as mount-s3 does them.

Exit code 7 (mount failed, docs/CLI.md) with a message naming the mountpoint
for a mountpoint that is missing, not a directory, not empty (unless
``--allow-non-empty``) or already mounted; a relative mountpoint given to a
foreground mount is unmounted again on SIGTERM / SIGINT; /proc/mounts shows
the source root as the file system name and ``fuse.ckptfs`` as the type.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time

import pytest

import harness
import np_ckpt
from _util import EXIT_MOUNT_FAILED, describe, is_mounted, run_ckptfs, unmount


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> np_ckpt.Synth:
    base = tmp_path_factory.mktemp("mountpoints")
    return np_ckpt.write(str(base / "ckpt"), world_size=2, specs=np_ckpt.ROW_SPECS, seed=41)


def _unescape(field: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _proc_mounts(path: str) -> list[list[str]]:
    """The /proc/self/mounts lines (split, unescaped) whose mount point is ``path``."""
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        lines = [[_unescape(x) for x in line.split()] for line in f]
    return [fields for fields in lines if fields[1] == path]


def _serves(mnt: str, synth: np_ckpt.Synth) -> None:
    with open(os.path.join(mnt, "consolidated", "model.safetensors"), "rb") as f:
        np_ckpt.check_consolidated(f.read(), synth)


def _refused(r: subprocess.CompletedProcess, mnt: str) -> None:
    """Exit 7, a message that names the mountpoint, nothing mounted there."""
    try:
        assert r.returncode == EXIT_MOUNT_FAILED, describe(r)
        assert os.path.basename(mnt) in r.stderr, f"the message does not name {mnt}\n{describe(r)}"
        assert not _proc_mounts(mnt), f"{mnt} is mounted although the mount was refused"
    finally:
        unmount(mnt)


def test_non_empty_mountpoint_refused(ckpt, tmp_path):
    mnt = tmp_path / "busy"
    mnt.mkdir()
    (mnt / "keep.txt").write_bytes(b"mine\n")
    r = run_ckptfs("mount", ckpt.path, mnt, "--log-file", tmp_path / "log")
    _refused(r, str(mnt))
    assert (mnt / "keep.txt").read_bytes() == b"mine\n"


def test_allow_non_empty_mounts(ckpt, tmp_path):
    mnt = tmp_path / "busy"
    mnt.mkdir()
    (mnt / "keep.txt").write_bytes(b"mine\n")
    with harness.Mounted(ckpt.path, "--allow-non-empty", mnt=mnt) as m:
        _serves(m.path, ckpt)
        assert not os.path.exists(m.p("keep.txt")), "the mount does not cover the directory"
    assert (mnt / "keep.txt").read_bytes() == b"mine\n"


def test_mountpoint_already_mounted_refused(ckpt, tmp_path):
    with harness.Mounted(ckpt.path, base_dir=str(tmp_path)) as m:
        r = run_ckptfs("mount", ckpt.path, m.path, "--log-file", tmp_path / "log2")
        try:
            assert r.returncode == EXIT_MOUNT_FAILED, describe(r)
            assert os.path.basename(m.path) in r.stderr, describe(r)
            assert len(_proc_mounts(m.path)) == 1, f"mounts stacked: {_proc_mounts(m.path)}"
        finally:
            while len(_proc_mounts(m.path)) > 1:  # a stacked mount: take the top one off
                subprocess.run(["fusermount3", "-u", m.path], check=False)
        _serves(m.path, ckpt)


def test_mountpoint_is_a_file_refused(ckpt, tmp_path):
    mnt = tmp_path / "file"
    mnt.write_bytes(b"not a directory\n")
    r = run_ckptfs("mount", ckpt.path, mnt, "--log-file", tmp_path / "log")
    _refused(r, str(mnt))
    assert mnt.read_bytes() == b"not a directory\n"


def test_missing_mountpoint_refused(ckpt, tmp_path):
    mnt = tmp_path / "missing"
    r = run_ckptfs("mount", ckpt.path, mnt, "--log-file", tmp_path / "log")
    _refused(r, str(mnt))
    assert not mnt.exists()


def test_proc_mounts_names_source(ckpt, tmp_path):
    """fsname = the source root's absolute path, given relative here; type
    fuse.ckptfs; the mountpoint, given relative, is resolved against the
    caller's directory."""
    (tmp_path / "rel").mkdir()
    cwd = os.path.dirname(ckpt.path)
    mnt = str(tmp_path / "rel")
    r = run_ckptfs("mount", os.path.basename(ckpt.path), os.path.relpath(mnt, cwd),
                   "--log-file", tmp_path / "log", cwd=cwd)
    try:
        assert r.returncode == 0, describe(r)
        lines = _proc_mounts(mnt)
        assert len(lines) == 1, lines
        fsname, _, fstype = lines[0][:3]
        assert fsname == os.path.realpath(ckpt.path), lines[0]
        assert fstype == "fuse.ckptfs", lines[0]
        _serves(mnt, ckpt)
    finally:
        unmount(mnt)


def _tgkill(pid: int, tid: int, sig: int) -> None:
    import ctypes
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.tgkill(pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig})")


def _idle_helper_thread(pid: int) -> int:
    """A thread of the daemon that is neither the loop's (the main thread)
    nor a FUSE worker waiting for a request (in fuse_dev_do_read)."""
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        with open(f"/proc/{pid}/task/{tid}/wchan") as f:
            wchan = f.read()
        if tid != pid and "fuse_dev" not in wchan:
            return tid
    raise AssertionError(f"no helper thread in {os.listdir(f'/proc/{pid}/task')}")


@contextlib.contextmanager
def _foreground_mount(ckpt, tmp_path, mountpoint: str):
    """(process, stderr file) of `ckptfs mount -f ckpt MOUNTPOINT` run from
    tmp_path, once it mounted and served; killed and unmounted after."""
    mnt = str(tmp_path / mountpoint)
    with open(tmp_path / "stderr", "w+") as err:
        p = subprocess.Popen([harness.require_bin(), "mount", ckpt.path, mountpoint, "-f"], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not is_mounted(mnt):
                assert p.poll() is None, f"mount -f exited {p.returncode}"
                assert time.monotonic() < deadline, "not mounted 20 s after mount -f"
                time.sleep(0.05)
            _serves(mnt, ckpt)
            yield p, err
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            unmount(mnt)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_taken_by_a_helper_thread_still_unmounts(ckpt, tmp_path, sig):
    """Which thread of a process takes a signal sent to it is the kernel's
    choice; here it is forced onto one of the daemon's own threads (tgkill):
    the mount still ends within seconds, exit 0, nothing left mounted."""
    (tmp_path / "mnt").mkdir()
    with _foreground_mount(ckpt, tmp_path, "mnt") as (p, err):
        _tgkill(p.pid, _idle_helper_thread(p.pid), sig)
        rc = p.wait(timeout=10)
        err.seek(0)
        assert rc == 0, f"mount -f exited {rc} on {sig.name}: {err.read()[-2000:]}"
        assert not is_mounted(str(tmp_path / "mnt"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_foreground_relative_mountpoint_unmounted_on_signal(ckpt, tmp_path, sig):
    """`ckptfs mount -f ROOT rel` from tmp_path, then a signal: exit 0 and the
    mountpoint is an ordinary empty directory again (no "Transport endpoint
    is not connected")."""
    (tmp_path / "rel").mkdir()
    mnt = str(tmp_path / "rel")
    with _foreground_mount(ckpt, tmp_path, "rel") as (p, err):
        p.send_signal(sig)
        rc = p.wait(timeout=20)
        err.seek(0)
        assert rc == 0, f"mount -f exited {rc} on {sig.name}: {err.read()[-2000:]}"
        assert not is_mounted(mnt), f"{mnt} still mounted after mount -f exited"
        assert os.listdir(mnt) == []
