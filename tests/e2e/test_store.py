"""The index store through the CLI: refusal of directories that are not
ckptfs indexes (the tree left byte-identical), SIGKILLed `ckptfs index`
runs, one writer at a time with readers beside it, schema 1 indexes and
their leftover temporary directories, checkpoints that disappear.

The sources are small sharded safetensors checkpoints written here (two
ranks' row shards with DCP_SHARDING_INFO), so the expected tensors are known
without ckptfs: rank r holds rows [2r, 2r+2) of each tensor."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Mounted, describe, require_bin, run_ckptfs  # noqa: E402

V1_FIXTURE = Path(__file__).resolve().parents[1] / "indexer" / "testdata" / "v1_index"
EXIT_INDEX_ERROR = 8
EXIT_INDEX_BUSY = 9


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        raw = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def full_tensor(step: int, k: int) -> np.ndarray:
    return (np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * step + k)


def make_checkpoint(d: Path, step: int, tensors: int) -> None:
    """Two rank shards of `tensors` tensors of shape (4, 3), row-split."""
    d.mkdir(parents=True)
    names = [f"layer.{k}.w" for k in range(tensors)]
    for r in range(2):
        part = {n: full_tensor(step, k)[2 * r:2 * r + 2] for k, n in enumerate(names)}
        info = {n: {"saved_offsets": [2 * r, 0]} for n in names}
        write_safetensors(d / f"shard-0000{r + 1}-model-00001-of-00001.safetensors", part,
                          {"DCP_SHARDING_INFO": json.dumps(info)})


def make_root(base: Path, steps: int, tensors: int = 4) -> Path:
    root = base / "root"
    for s in range(steps):
        make_checkpoint(root / f"step_{s:03d}", s, tensors)
    return root


def tree_hash(top: Path) -> dict[str, str]:
    """{relative path: sha256 of contents | "dir" | "link -> target"} of everything under top."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(top))
            if p.is_symlink():
                out[rel] = "link -> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def ckptfs(*args, **kw) -> subprocess.CompletedProcess:
    return run_ckptfs(*args, text_stdout=True, **kw)


def listing(root: Path, index: Path) -> list[dict]:
    p = ckptfs("ls", root, "--index", index, "--json")
    assert p.returncode == 0, describe(p)
    return json.loads(p.stdout)


def npy(root: Path, index: Path, vpath: str) -> np.ndarray:
    p = run_ckptfs("cat", root, vpath, "--index", index)
    assert p.returncode == 0, describe(p)
    return np.load(io.BytesIO(p.stdout))


def temp_dirs(base: Path) -> list[str]:
    return [str(p) for p in base.rglob("*") if ".tmp." in p.name]


# --- `--index` at something that is not an index: refused, nothing touched ---

@pytest.mark.parametrize("target", ["checkpoint", "root", "non_empty_dir", "file"])
@pytest.mark.parametrize("command", ["index", "ls"])
def test_index_location_that_is_not_an_index_is_refused_and_untouched(tmp_path, target, command):
    root = make_root(tmp_path, 2)
    (tmp_path / "indexes").mkdir()
    (tmp_path / "indexes" / "notes.txt").write_text("mine")
    (tmp_path / "a_file").write_text("plain file")
    index = {"checkpoint": root / "step_000", "root": root, "non_empty_dir": tmp_path / "indexes",
             "file": tmp_path / "a_file"}[target]
    before = tree_hash(tmp_path)
    p = ckptfs(command, root, "--index", index)
    assert p.returncode == EXIT_INDEX_ERROR, describe(p)
    assert ("is a file" if target == "file" else "not a ckptfs index") in p.stderr, describe(p)
    assert tree_hash(tmp_path) == before


# --- killed indexing ---

def test_sigkilled_index_runs_leave_no_temp_dirs_and_a_usable_store(tmp_path):
    root = make_root(tmp_path, 24, tensors=40)
    clean = tmp_path / "clean-index"
    t0 = time.monotonic()
    p = ckptfs("index", root, "--index", clean)
    duration = time.monotonic() - t0
    assert p.returncode == 0, describe(p)
    expected = listing(root, clean)
    assert len(expected) == 24 * 40

    index = tmp_path / "idx" / "index"
    rng = random.Random(20240611)
    b = require_bin()
    for i in range(20):
        if i % 4 == 0:
            shutil.rmtree(index, ignore_errors=True)  # also kill during creation
        proc = subprocess.Popen([b, "index", str(root), "--index", str(index)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0, duration * 1.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert temp_dirs(tmp_path) == [], f"kill {i}"
        p = ckptfs("index", root, "--index", index)
        assert p.returncode == 0, f"kill {i}: " + describe(p)
        assert listing(root, index) == expected, f"kill {i}"
    assert temp_dirs(tmp_path) == []
    # The bytes served come from the rows: rank r's shard holds rows 2r..2r+1.
    for step in (0, 23):
        got = npy(root, index, f"step_{step:03d}/tensors/layer.7.w.npy")
        np.testing.assert_array_equal(got, full_tensor(step, 7))


# --- one writer, readers beside it ---

def test_a_held_index_is_busy_naming_the_holder_and_still_readable(tmp_path):
    root = make_root(tmp_path, 2)
    index = tmp_path / "index"
    assert ckptfs("index", root, "--index", index).returncode == 0
    expected = listing(root, index)
    # Hold the writer lock the way a ckptfs writer does (flock on writer.pid).
    with open(index / "writer.pid", "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        p = ckptfs("index", root, "--index", index)
        assert p.returncode == EXIT_INDEX_BUSY, describe(p)
        assert f"in use by process {os.getpid()}" in p.stderr, describe(p)
        assert listing(root, index) == expected
    assert ckptfs("index", root, "--index", index).returncode == 0


def test_second_ckptfs_index_is_busy_while_the_first_runs_and_readers_work(tmp_path):
    root = make_root(tmp_path, 30, tensors=40)
    index = tmp_path / "index"
    assert ckptfs("index", root, "--index", index).returncode == 0
    before = listing(root, index)
    make_checkpoint(root / "step_zzz", 999, 40)

    writer = subprocess.Popen([require_bin(), "index", str(root), "--index", str(index)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid_file = index / "writer.pid"
        deadline = time.monotonic() + 30
        while pid_file.read_text().strip() != str(writer.pid):
            assert writer.poll() is None and time.monotonic() < deadline, "writer never took the lock"
            time.sleep(0.0005)
        writer.send_signal(signal.SIGSTOP)
        p = ckptfs("index", root, "--index", index)
        assert p.returncode == EXIT_INDEX_BUSY, describe(p)
        assert f"in use by process {writer.pid}" in p.stderr, describe(p)
        during = listing(root, index)  # a read-only open beside the writer
        assert [e for e in during if e["checkpoint"] != "step_zzz"] == before
    finally:
        writer.send_signal(signal.SIGCONT)
    assert writer.wait(timeout=120) == 0
    after = listing(root, index)
    assert [e for e in after if e["checkpoint"] != "step_zzz"] == before
    assert sum(e["checkpoint"] == "step_zzz" for e in after) == 40


# --- schema 1, checkpoints that go away ---

def test_schema_1_index_is_rebuilt_with_one_line(tmp_path):
    root = make_root(tmp_path, 2)
    index = tmp_path / "index"
    shutil.copytree(V1_FIXTURE, index)
    p = ckptfs("index", root, "--index", index)
    assert p.returncode == 0, describe(p)
    lines = [l for l in p.stderr.splitlines() if "schema 1" in l]
    assert len(lines) == 1 and "rebuilding" in lines[0], describe(p)
    assert len(listing(root, index)) == 2 * 4
    p = ckptfs("index", root, "--index", index)
    assert "schema 1" not in p.stderr, describe(p)


def test_read_command_rebuilds_a_schema_1_index_too(tmp_path):
    root = make_root(tmp_path, 1)
    index = tmp_path / "index"
    shutil.copytree(V1_FIXTURE, index)
    np.testing.assert_array_equal(npy(root, index, "step_000/tensors/layer.2.w.npy"), full_tensor(0, 2))


def test_stale_schema_1_temp_dirs_of_dead_processes_are_removed(tmp_path):
    root = make_root(tmp_path, 1)
    index = tmp_path / "index"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"index.tmp.{dead.pid}"
    shutil.copytree(V1_FIXTURE, stale)
    p = ckptfs("index", root, "--index", index)
    assert p.returncode == 0, describe(p)
    assert not stale.exists()
    assert f"removed {stale}" in p.stderr, describe(p)


def test_reindex_removes_checkpoints_that_are_gone(tmp_path):
    root = make_root(tmp_path, 3)
    index = tmp_path / "index"
    assert ckptfs("index", root, "--index", index).returncode == 0
    assert {e["checkpoint"] for e in listing(root, index)} == {"step_000", "step_001", "step_002"}
    shutil.rmtree(root / "step_001")
    assert ckptfs("index", root, "--index", index).returncode == 0
    assert {e["checkpoint"] for e in listing(root, index)} == {"step_000", "step_002"}


def test_unreadable_writer_commit_record_falls_back_to_the_files(tmp_path):
    root = make_root(tmp_path, 2)
    (root / "step_001" / ".ckptfs").mkdir()
    (root / "step_001" / ".ckptfs" / "commit.sst").write_bytes(b"not an sst file" * 100)
    index = tmp_path / "index"
    p = ckptfs("index", root, "--index", index)
    assert p.returncode == 0, describe(p)
    assert "commit.sst not used" in p.stderr and "indexed from the files alone" in p.stderr, describe(p)
    np.testing.assert_array_equal(npy(root, index, "step_001/tensors/layer.3.w.npy"), full_tensor(1, 3))


# --- mounts read the store lazily, bounded by --max-loaded, and record live steps ---

def loads_in(log: str) -> list[tuple[str, str]]:
    """[(step dir, "loaded" | "unloaded")] in log order."""
    return re.findall(r"(step_\d+)/: (loaded|unloaded)", log)


def npy_file(mnt: str, step: int, k: int) -> str:
    return os.path.join(mnt, f"step_{step:03d}", "tensors", f"layer.{k}.w.npy")


def test_mount_loads_a_checkpoint_on_its_first_use_only(tmp_path):
    root = make_root(tmp_path, steps=4)
    with Mounted(root, base_dir=tmp_path, index_dir=tmp_path / "idx") as m:
        assert sorted(os.listdir(m.path)) == [f"step_{s:03d}" for s in range(4)]
        assert loads_in(m.log()) == [], "listing the root loaded checkpoints\n" + m.log()
        assert np.array_equal(np.load(npy_file(m.path, 2, 1)), full_tensor(2, 1))
        assert loads_in(m.log()) == [("step_002", "loaded")], m.log()


def test_max_loaded_unloads_the_least_recently_used_never_an_open_one(tmp_path):
    root = make_root(tmp_path, steps=5)
    with Mounted(root, "--max-loaded", "2", base_dir=tmp_path, index_dir=tmp_path / "idx") as m:
        held_path = npy_file(m.path, 0, 3)
        want_held = Path(held_path).read_bytes()
        assert np.array_equal(np.load(held_path), full_tensor(0, 3))
        with open(held_path, "rb") as held:
            first = held.read(64)
            for s in range(1, 5):
                for k in range(4):
                    assert np.array_equal(np.load(npy_file(m.path, s, k)), full_tensor(s, k)), (s, k)
            assert first + held.read() == want_held  # still served while others came and went
        events = loads_in(m.log())
        assert ("step_000", "unloaded") not in events, "an open file's checkpoint was unloaded\n" + m.log()
        unloaded = {d for d, e in events if e == "unloaded"}
        assert unloaded == {"step_001", "step_002", "step_003"}, m.log()
        resident = 0
        for _, e in events:
            resident += 1 if e == "loaded" else -1
            assert resident <= 2, "more than --max-loaded checkpoints loaded at once\n" + m.log()
        # An unloaded checkpoint is loaded again, with the same values.
        assert np.array_equal(np.load(npy_file(m.path, 1, 2)), full_tensor(1, 2))
        assert loads_in(m.log()).count(("step_001", "loaded")) == 2, m.log()


def test_checkpoints_found_by_a_live_mount_are_recorded_in_the_store(tmp_path):
    root = make_root(tmp_path, steps=1)
    index = tmp_path / "index"
    with Mounted(root, "--index", index, base_dir=tmp_path) as m:
        make_checkpoint(root / "step_007", 7, 4)
        deadline = time.time() + 20
        while time.time() < deadline and not os.path.isdir(m.p("step_007", "tensors")):
            time.sleep(0.1)
        assert np.array_equal(np.load(npy_file(m.path, 7, 0)), full_tensor(7, 0)), m.log()
    p = ckptfs("index", root, "--index", index, "--dump")  # reads the store, indexes nothing
    assert p.returncode == 0, describe(p)
    commits = {json.loads(line)["key"]: json.loads(line)["value"] for line in p.stdout.splitlines()
               if line.startswith('{"key":"c/')}
    assert set(commits) == {"c/step_000", "c/step_007"}, p.stdout[:2000]
    assert commits["c/step_007"]["source"] == "scan" and commits["c/step_007"]["tensors"] == 4


def test_background_mount_with_a_relative_index_path(tmp_path):
    # The daemon changes directory to / once mounted, and loads lazily after.
    root = make_root(tmp_path, steps=2)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = run_ckptfs("mount", "root", "mnt", "--index", "rel-index", "--log-file", "mnt.log", cwd=tmp_path)
    try:
        assert p.returncode == 0, describe(p)
        assert np.array_equal(np.load(npy_file(str(mnt), 1, 2)), full_tensor(1, 2)), \
            (tmp_path / "mnt.log").read_text()
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    assert (tmp_path / "rel-index" / "CKPTFS_STORE").exists()


def test_first_step_in_an_empty_root_is_seen_by_inotify_alone(tmp_path):
    # --rescan-ms 0: no periodic walk, so only a watch on the root itself
    # can notice the first step of an empty training root.
    root = tmp_path / "run"
    root.mkdir()
    with Mounted(root, "--rescan-ms", "0", base_dir=tmp_path, index_dir=tmp_path / "idx") as m:
        make_checkpoint(root / "step_001", 1, 2)
        deadline = time.time() + 10
        while time.time() < deadline and not os.path.isdir(m.p("step_001", "tensors")):
            time.sleep(0.02)
        assert os.path.isdir(m.p("step_001", "tensors")), "the first step never appeared\n" + m.log()
        assert np.array_equal(np.load(npy_file(m.path, 1, 1)), full_tensor(1, 1))
