"""Crashes during StorageWriter saves (2 gloo ranks, CPU): a rank is
SIGKILLed at a random moment of a save, 20 times (seeded, so a failure
replays). After every crash:
  - every step saved before is intact (its files hash as they did);
  - the broken step has no commit record (.ckptfs/commit.sst), unless the
    kill came after it was renamed into place; a save that returned always
    has one, and a committed step has its .metadata and loads;
and in the end a re-save into every broken directory succeeds and loads
to its state with stock dcp.load.

The same for layout="hf" (FileSystemReader becomes HuggingFaceStorageReader,
.metadata the published shard files), where also a broken step that shows
rank 1's shard file under its final name loads to its full state: shards
are published rank 1 last, so none is ever missing or partly written then.

Kill moments: uniform over 1.3x the duration of a clean save, measured
from the rank's "ready" marker (state built, save about to start), so
kills land in planning, staging, fsync, .metadata and after. A save's
duration moves with the machine's load, so it is measured again on every
save that finishes (the median so far), and the runs go on past 20, up to
40, until 10 kills have landed inside a save.

The ranks are forked by a server of writer_gen.py (tools/ranks.py,
RankServer) that imported torch once: two fresh interpreters a run spent
most of the test's time importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import statistics
import tempfile
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from harness import spawn_ranks
import ranks  # noqa: E402  (tools/ranks.py, on the path once harness is imported)

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")
RUNS = 20
MAX_RUNS = 40
KILLS_INSIDE = 10
WORLD = 2
SHARDS = [f"shard-{r + 1:05d}-model-00001-of-00001.safetensors" for r in range(WORLD)]


def _digest(step_dir: str) -> dict:
    out = {}
    for name in sorted(os.listdir(step_dir)):
        p = os.path.join(step_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _markers(path: str) -> list[tuple[str, int, float]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(w, int(n), float(t)) for w, n, t in (line.split() for line in f if line.strip())]


def _save_seconds(marker: str) -> float:
    m = {w: t for w, _, t in _markers(marker)}
    return m["done"] - m["ready"]


@pytest.fixture(scope="module")
def fork_server():
    """start(rank, init_file, job_file, log) -> ForkedRank: the ranks of
    each run are forked by a ranks.RankServer of writer_gen.py (as
    spawn_ranks forks the clean save's and the re-saves'), which imported
    torch once, so a run costs its save and not two imports of torch
    (seconds of CPU each)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

    def start(rank: int, init: str, job_file: str, log: str) -> ranks.ForkedRank:
        open(log, "wb").close()
        argv = [GEN, "_worker", str(rank), str(WORLD), init, job_file]
        return ranks.RankServer.of(GEN, env).fork(argv, env, log, new_session=False)
    return start


def _run_and_kill(start, job: dict, delay: float, victim: int, tmp: str) -> str:
    """Starts the ranks (`start`: fork_server's), SIGKILLs `victim` `delay`
    s after its "ready" marker, then the others; returns what happened
    ("killed", "finished")."""
    init = os.path.join(tempfile.mkdtemp(dir=tmp), "filestore")
    job_file = init + ".job.json"
    with open(job_file, "w") as f:
        json.dump(job, f)
    procs = [start(r, init, job_file, f"{init}.rank{r}.log") for r in range(WORLD)]
    try:
        deadline = time.monotonic() + 120
        while not any(w == "ready" for w, _, _ in _markers(job["marker"])):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ranks never got ready"
            time.sleep(0.01)
        time.sleep(delay)
        if procs[victim].poll() is None:
            procs[victim].send_signal(signal.SIGKILL)
            what = "killed"
        else:
            what = "finished"
        time.sleep(0.3)  # the survivor may still be mid-write; then it goes too
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return what


def _load_equals_state(step_dir: str, layout: str, oracle: dict) -> None:
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in oracle.items()}
    reader = dcp.HuggingFaceStorageReader(step_dir) if layout == "hf" else dcp.FileSystemReader(step_dir)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in oracle.items():
        assert (torch.equal(v, target[k]) if isinstance(v, torch.Tensor) else v == target[k]), (step_dir, k)


def _commit_point(step: str, layout: str) -> bool:
    if layout == "hf":
        return all(os.path.exists(os.path.join(step, s)) for s in SHARDS)
    return os.path.exists(os.path.join(step, ".metadata"))


@pytest.mark.parametrize("layout", ["dcp", "hf"])
def test_sigkill_at_random_points(tmp_path, layout, fork_server):
    rng = random.Random(1234)
    root = str(tmp_path / "run")
    marker = str(tmp_path / "marker")
    oracles = str(tmp_path / "oracles")
    # A clean save first: step_0 must survive everything after it; its
    # duration calibrates the kill moments.
    spawn_ranks(GEN, WORLD, {"kind": "steps", "steps": [0], "root": root, "marker": marker, "layout": layout,
                             "buffer_bytes": 4096, "oracles": oracles}, name="clean save")
    durations = [_save_seconds(marker)]
    intact = {"step_0": _digest(os.path.join(root, "step_0"))}
    broken, outcomes = [], []
    i = kills = 0
    while i < MAX_RUNS and (i < RUNS or kills < KILLS_INSIDE):
        i += 1
        save_s = statistics.median(durations)
        # Every fourth run saves into a directory an earlier crash broke.
        n = broken[0] if broken and i % 4 == 0 else i
        os.remove(marker)
        what = _run_and_kill(fork_server, {"kind": "steps", "steps": [n], "root": root, "marker": marker, "layout": layout,
                              "buffer_bytes": 4096, "oracles": oracles}, rng.uniform(0, 1.3 * save_s), rng.randrange(WORLD),
                             str(tmp_path))
        done = any(w == "done" for w, _, _ in _markers(marker))
        if done:
            durations.append(_save_seconds(marker))
        kills += what == "killed" and not done
        step = os.path.join(root, f"step_{n}")
        outcomes.append((n, what, done))
        for name, digest in intact.items():
            assert _digest(os.path.join(root, name)) == digest, f"run {i}: {name} changed"
        committed = os.path.exists(os.path.join(step, ".ckptfs", "commit.sst"))
        assert committed or not done, f"run {i}: step_{n}'s save returned without a commit record"
        if committed:
            # Done, or killed after the record's rename: complete, and loads below.
            assert _commit_point(step, layout), f"run {i}: committed without its commit point"
            intact[f"step_{n}"] = _digest(step)
            broken = [b for b in broken if b != n]
            continue
        if layout == "hf" and os.path.exists(os.path.join(step, SHARDS[0])):
            _load_equals_state(step, layout, torch.load(os.path.join(oracles, f"{n}.pt"), weights_only=False))
        if n not in broken:
            broken.append(n)
    assert kills >= KILLS_INSIDE, f"too few kills landed inside a save: {outcomes}"
    # Re-save into every broken directory: succeeds and loads.
    if broken:
        os.remove(marker)
        spawn_ranks(GEN, WORLD, {"kind": "steps", "steps": broken, "root": root, "marker": marker,
                                 "layout": layout, "buffer_bytes": 4096, "oracles": oracles}, name="re-save")
    for name in list(intact) + [f"step_{n}" for n in broken]:
        n = int(name.split("_")[1])
        oracle = torch.load(os.path.join(oracles, f"{n}.pt"), weights_only=False)
        _load_equals_state(os.path.join(root, name), layout, oracle)
