"""Live mounts of a training root (docs/SEMANTICS.md, "Live mounts").

`ckptfs mount ROOT MNT` watches ROOT (inotify, plus a re-check every
--rescan-ms, default 2000 ms) while real writers save into it:

- 2 gloo ranks save step_100, step_200, step_300 with
  `torch.distributed.checkpoint.save` (a tiny Llama and its AdamW state,
  tensor-parallel DTensors) while ROOT is mounted: each step's
  consolidated/ becomes listable within seconds of its commit point and
  `transformers` loads it to the logits of the model that was saved;
- a poller lists MNT/step_*/consolidated/ every few ms during the saves:
  whatever it sees is a whole step (its .metadata exists, every file reads
  in full, the weights are the saved ones);
- step_100 deleted while a file of it is open: it disappears (ENOENT), and
  the open descriptor gives the right bytes or EIO;
- dcp.save SIGKILLed at random points (24 runs): a broken step never shows
  consolidated/, `ckptfs check` names it, and a save into it afterwards
  makes it appear;
- step_200 saved again with new values: reads give the old values before
  the rewrite, EIO while it is rewritten, then the new values; never a mix;
- `ckptfs check ROOT` counts the steps saved while mounted.

Expected values come from torch (the in-memory state dicts and models that
were saved), never from ckptfs.

Run: CKPTFS_BIN=build/ckptfs python3 -m pytest tests/e2e/test_live.py -q -s
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load as st_load

import live_gen
from harness import Mounted, describe, run_ckptfs

STEPS = (100, 200, 300)
RESAVED = 200          # the step saved a second time, with new values
RESAVE_SEED = 2200
APPEAR_LIMIT_S = 30.0  # a step not listable this long after its save failed to appear
MEDIAN_LIMIT_S = 5.0   # the asserted bound on the median commit -> listable time
RESCAN_S = 2.0         # the mount's default --rescan-ms
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------
# reading what the mount serves
# ---------------------------------------------------------------------------


def read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def weights_differ(data: bytes, want: dict[str, torch.Tensor]) -> str:
    """"" when `data` is a safetensors file holding exactly `want`, else why not."""
    try:
        got = st_load(data)
    except Exception as e:  # noqa: BLE001  (any parse failure is the finding)
        return f"not a safetensors file ({type(e).__name__}: {e})"
    if set(got) != set(want):
        return f"tensors {sorted(set(got) ^ set(want))[:4]} differ in presence"
    bad = [k for k, t in want.items() if got[k].dtype != t.dtype or not torch.equal(got[k], t)]
    return f"{len(bad)} tensors differ in value, e.g. {bad[:3]}" if bad else ""


def listable(path: str) -> list[str] | None:
    try:
        return os.listdir(path)
    except OSError:
        return None


def logits_of(path: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model(input_ids=input_ids).logits.float()
    del model
    return out


def log_about(m: Mounted, name: str = "", limit: int = 20) -> str:
    """The mount log's lines about `name` (all when ""), failed reads counted
    rather than listed (a reader in a loop logs thousands)."""
    lines = [ln for ln in m.log().splitlines() if f"{name}/" in ln or not name]
    reads = [ln for ln in lines if ": read of " in ln]
    other = [ln for ln in lines if ": read of " not in ln]
    tail = [f"... and {len(reads)} failed reads, the last: {reads[-1]}"] if reads else []
    return "mount log:\n" + "\n".join(other[-limit:] + tail)


# ---------------------------------------------------------------------------
# the poller: never a partial step
# ---------------------------------------------------------------------------


class Poller(threading.Thread):
    """Lists MNT/step_*/consolidated/ every few ms; each time one is listable,
    ROOT/step_N/.metadata must exist and every file must read in full with
    the saved content (checked by value once, then byte for byte)."""

    def __init__(self, mnt: str, root: str, steps: dict[int, dict]):
        super().__init__(daemon=True)
        self.mnt, self.root, self.steps = mnt, root, steps
        self.stop_flag = threading.Event()
        self.violations: list[str] = []
        self.first_seen: dict[int, float] = {}
        self.views_checked = 0
        self.rounds = 0
        self._verified: dict[tuple[int, str], bytes] = {}

    def run(self) -> None:
        while not self.stop_flag.is_set():
            self.rounds += 1
            for name in listable(self.mnt) or []:
                if name.startswith("step_"):
                    self._look(name)
            time.sleep(0.003)

    def _look(self, name: str) -> None:
        cons = os.path.join(self.mnt, name, "consolidated")
        files = listable(cons)
        if files is None:
            return
        now = time.time()
        n = int(name.split("_")[1])
        self.first_seen.setdefault(n, now)
        self.views_checked += 1
        if not os.path.exists(os.path.join(self.root, name, ".metadata")):
            self.violations.append(f"{name}/consolidated/ listed before its .metadata exists")
        if sorted(files) != ["config.json", "model.safetensors"]:
            self.violations.append(f"{name}/consolidated/ lists {sorted(files)}")
        for f in files:
            self._check_file(n, name, f)

    def _check_file(self, n: int, name: str, f: str) -> None:
        try:
            data = read_all(os.path.join(self.mnt, name, "consolidated", f))
        except OSError as e:
            self.violations.append(f"{name}/consolidated/{f}: {errno.errorcode.get(e.errno)}")
            return
        known = self._verified.get((n, f))
        if known is not None:
            if data != known:
                self.violations.append(f"{name}/consolidated/{f}: bytes changed")
            return
        step = self.steps[n]
        why = (weights_differ(data, step["weights"]) if f == "model.safetensors"
               else "" if data == step["config_bytes"] else "not the config.json written")
        if why:
            self.violations.append(f"{name}/consolidated/{f}: {why}")
        else:
            self._verified[(n, f)] = data


# ---------------------------------------------------------------------------
# the scenario: saves into a mounted root (module fixture)
# ---------------------------------------------------------------------------


@dataclass
class StepResult:
    returned: float = 0.0         # wall time dcp.save returned on rank 0
    metadata_mtime: float = 0.0
    listable_at: float | None = None
    logits_equal: bool = False
    logits_max_diff: float = float("nan")


@dataclass
class Resave:
    outcomes: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind, detail)
    returned: float = 0.0
    metadata_mtime: float = 0.0
    final: str = ""
    logits_equal: bool = False


@dataclass
class LiveRun:
    root: str
    mount: Mounted
    steps: dict[int, dict]
    results: dict[int, StepResult] = field(default_factory=dict)
    poller: Poller | None = None
    resave: Resave | None = None
    new_state: dict | None = None


def _commit_step(run: LiveRun, saver, i: int, n: int) -> StepResult:
    step = run.steps[n]
    d = os.path.join(run.root, f"step_{n}")
    os.makedirs(d)
    step["config"].save_pretrained(d)  # config.json before the save: consolidated/ carries it
    step["config_bytes"] = read_all(os.path.join(d, "config.json"))
    saver.go(i, step["state"], step["placements"])
    res = StepResult(returned=saver.wait_done(i))
    res.metadata_mtime = os.stat(os.path.join(d, ".metadata")).st_mtime
    cons = run.mount.p(f"step_{n}", "consolidated")
    while time.time() < res.returned + APPEAR_LIMIT_S:
        if listable(cons) is not None:
            res.listable_at = time.time()
            break
        time.sleep(0.002)
    if res.listable_at is not None:
        got = logits_of(cons, step["input_ids"])
        res.logits_equal = got.shape == step["logits"].shape and torch.equal(got, step["logits"])
        if got.shape == step["logits"].shape:
            res.logits_max_diff = float((got - step["logits"]).abs().max())
    return res


def _classify(data: bytes, old: bytes, new_weights: dict) -> tuple[str, str]:
    if data == old:
        return "old", ""
    why = weights_differ(data, new_weights)
    return ("new", "") if not why else ("mix", why)


def _read_during_resave(path: str, old: bytes, new_weights: dict, out: Resave,
                        stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            kind, detail = _classify(read_all(path), old, new_weights)
        except OSError as e:
            kind, detail = errno.errorcode.get(e.errno, str(e.errno)), ""
        out.outcomes.append((time.time(), kind, detail))
        time.sleep(0.002)


def _resave_step(run: LiveRun, saver, i: int) -> Resave:
    path = run.mount.p(f"step_{RESAVED}", "consolidated", "model.safetensors")
    old = read_all(path)
    new = run.new_state
    out, stop = Resave(), threading.Event()
    reader = threading.Thread(target=_read_during_resave,
                              args=(path, old, new["weights"], out, stop), daemon=True)
    reader.start()
    try:
        saver.go(i, new["state"], new["placements"])
        out.returned = saver.wait_done(i)
        out.metadata_mtime = os.stat(os.path.join(run.root, f"step_{RESAVED}", ".metadata")).st_mtime
        deadline = out.returned + APPEAR_LIMIT_S
        while time.time() < deadline and not _settled(out.outcomes, out.returned):
            time.sleep(0.05)
    finally:
        stop.set()
        reader.join()
    try:
        out.final = _classify(read_all(path), old, new["weights"])[0]
    except OSError as e:
        out.final = errno.errorcode.get(e.errno, str(e.errno))
    if out.final == "new":
        got = logits_of(run.mount.p(f"step_{RESAVED}", "consolidated"), new["input_ids"])
        out.logits_equal = torch.equal(got, new["logits"])
    return out


def _settled(outcomes, since: float) -> bool:
    """The reads after `since` end with at least 0.5 s of new values only."""
    tail = [(t, k) for t, k, _ in list(outcomes) if t > since]
    if not tail or tail[-1][1] != "new":
        return False
    start = tail[-1][0]
    for t, k in reversed(tail):
        if k != "new":
            break
        start = t
    return tail[-1][0] - start >= 0.5


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    base = tmp_path_factory.mktemp("live")
    root, ctl = base / "run", base / "ctl"
    root.mkdir()
    ctl.mkdir()
    saver = live_gen.StepSaver(str(ctl), [str(root / f"step_{n}") for n in STEPS + (RESAVED,)])
    saver.start()  # the ranks import torch while the models are made
    steps = {n: live_gen.training_state(seed=n) for n in STEPS}
    new_state = live_gen.training_state(seed=RESAVE_SEED)
    try:
        with Mounted(str(root), base_dir=str(base)) as m:
            run = LiveRun(root=str(root), mount=m, steps=steps, new_state=new_state)
            run.poller = Poller(m.path, str(root), steps)
            run.poller.start()
            try:
                for i, n in enumerate(STEPS):
                    run.results[n] = _commit_step(run, saver, i, n)
            finally:
                run.poller.stop_flag.set()
                run.poller.join()
            run.resave = _resave_step(run, saver, len(STEPS))
            yield run
            print("\n" + log_about(m, limit=60))
    finally:
        saver.stop()


# ---------------------------------------------------------------------------
# 1. steps appear after their commit point and load to the saved logits
# ---------------------------------------------------------------------------


def test_steps_appear_within_seconds_of_commit(live):
    rows, from_mtime = [], []
    for n in STEPS:
        r = live.results[n]
        assert r.listable_at is not None, (
            f"step_{n}/consolidated/ not listable {APPEAR_LIMIT_S:g} s after dcp.save returned\n"
            + log_about(live.mount, f"step_{n}"))
        from_mtime.append(r.listable_at - r.metadata_mtime)
        rows.append(f"step_{n}: {r.listable_at - r.metadata_mtime:.3f} s after .metadata's mtime, "
                    f"{r.listable_at - r.returned:.3f} s after dcp.save returned")
    med = statistics.median(from_mtime)
    print("\ncommit -> consolidated/ listable:\n  " + "\n  ".join(rows)
          + f"\n  median {med:.3f} s (from .metadata's mtime), load {os.getloadavg()[0]:.1f}")
    assert med < MEDIAN_LIMIT_S, rows


def test_consolidated_loads_to_saved_logits(live):
    for n in STEPS:
        r = live.results[n]
        assert r.listable_at is not None, f"step_{n} never appeared"
        assert r.logits_equal, (f"step_{n}: from_pretrained(MNT/step_{n}/consolidated) logits "
                                f"differ from the saved model's (max |diff| {r.logits_max_diff})")


def test_poller_never_sees_a_partial_step(live):
    p = live.poller
    print(f"\npoller: {p.rounds} rounds, {p.views_checked} listings of consolidated/ checked, "
          f"first seen {sorted(p.first_seen)}")
    assert not p.violations, p.violations[:10]
    # not vacuous: it saw every step served while the saves went on
    assert set(p.first_seen) == set(STEPS), p.first_seen


# ---------------------------------------------------------------------------
# 2. a deleted step disappears; an open descriptor stays safe
# ---------------------------------------------------------------------------


def test_deleted_step_disappears_open_descriptor_safe(live):
    m, n = live.mount, STEPS[0]
    path = m.p(f"step_{n}", "consolidated", "model.safetensors")
    want = read_all(path)
    assert weights_differ(want, live.steps[n]["weights"]) == ""
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, PAGE, 0) == want[:PAGE]
        shutil.rmtree(os.path.join(live.root, f"step_{n}"))
        t0 = time.time()
        gone_after = _wait_gone(m, n, path, t0 + 5.0)
        print(f"\nstep_{n} gone from the mount {gone_after:.3f} s after rmtree")
        with pytest.raises(FileNotFoundError):
            os.stat(m.p(f"step_{n}"))
        # drop the cached pages so that every read below reaches the daemon
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        pages = {"ok": 0, "EIO": 0}
        for off in range(0, len(want), PAGE):
            try:
                got = os.pread(fd, PAGE, off)
            except OSError as e:
                assert e.errno == errno.EIO, (off, errno.errorcode.get(e.errno))
                pages["EIO"] += 1
                continue
            assert got == want[off:off + PAGE], f"page at {off}: other bytes than before the delete"
            pages["ok"] += 1
        print(f"open descriptor after the delete: pages {pages}")
    finally:
        os.close(fd)
    # the other steps are untouched
    assert weights_differ(read_all(m.p(f"step_{STEPS[2]}", "consolidated", "model.safetensors")),
                          live.steps[STEPS[2]]["weights"]) == ""


def _wait_gone(m: Mounted, n: int, path: str, deadline: float) -> float:
    t0 = time.time()
    while True:
        try:
            os.close(os.open(path, os.O_RDONLY))
            opened = True
        except FileNotFoundError:
            opened = False
        listed = f"step_{n}" in os.listdir(m.path)
        if not opened and not listed:
            return time.time() - t0
        assert time.time() < deadline, (
            f"step_{n} deleted {time.time() - t0:.1f} s ago: new opens "
            f"{'still succeed' if opened else 'fail'}, MNT/ {'still' if listed else 'no longer'} "
            f"lists it\n" + log_about(m, f"step_{n}"))
        time.sleep(0.01)


# ---------------------------------------------------------------------------
# 3. writers killed at random points
# ---------------------------------------------------------------------------

KILL_RUNS = 24
KILL_SEED = 20261123
WINDOW_S = 2 * RESCAN_S + 0.5   # killed steps are watched for ~2 rescans after the last kill


@dataclass
class KillRun:
    k: int                # saves into ROOT/step_<k>
    mode: str             # "files": killed once `at` .distcp files exist; "delay": `at` s after fork
    at: float
    seed: int
    dir: str = ""
    pid: int = 0
    started: float = 0.0
    status: int | None = None   # exit status; -9 when the kill landed first
    outcome: str = ""           # "complete" (.metadata exists), "partial" (files), "empty"


def _distcp_count(d: str) -> int:
    try:
        return sum(f.endswith(".distcp") for f in os.listdir(d))
    except FileNotFoundError:
        return 0


class ViewWatch(threading.Thread):
    """Polls MNT/step_K/consolidated/ of every watched step every 5 ms and
    records when each is first listable; listable while ROOT/step_K/.metadata
    does not exist is a violation (.metadata is never removed in this test,
    so checking it after the listing is conservative)."""

    def __init__(self, mnt: str, root: str):
        super().__init__(daemon=True)
        self.mnt, self.root = mnt, root
        self.names: dict[int, str] = {}
        self.seen: dict[int, float] = {}
        self.violations: list[str] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            for k, name in list(self.names.items()):
                if listable(os.path.join(self.mnt, name, "consolidated")) is None:
                    continue
                self.seen.setdefault(k, time.time())
                if not os.path.exists(os.path.join(self.root, name, ".metadata")):
                    self.violations.append(f"{name}/consolidated/ listed without a .metadata")
            time.sleep(0.005)


def _kill_one(saver: live_gen.ForkSaver, r: KillRun, watch: ViewWatch) -> None:
    """Forks r's save and SIGKILLs it at its point; records what it left."""
    watch.names[r.k] = f"step_{r.k}"
    r.pid = saver.save(r.dir, r.seed)
    r.started = time.monotonic()
    while True:
        now = time.monotonic()
        due = now - r.started >= r.at if r.mode == "delay" else _distcp_count(r.dir) >= r.at
        if due or now - r.started > 10:
            break
        time.sleep(0.0005)
    os.kill(r.pid, signal.SIGKILL)  # a zombie until reaped, so the pid is still ours
    r.status = saver.reap(r.pid)
    files = os.listdir(r.dir) if os.path.isdir(r.dir) else []
    r.outcome = "complete" if ".metadata" in files else "partial" if files else "empty"


def _plan_kills(root: str) -> list[KillRun]:
    rng = random.Random(KILL_SEED)
    runs = []
    for i in range(KILL_RUNS):
        if i % 3 == 2:
            r = KillRun(k=1000 + i, mode="delay", at=0.0, seed=5000 + i)  # `at` set from the save time
        else:
            r = KillRun(k=1000 + i, mode="files", at=rng.randint(1, live_gen.KILL_TENSORS),
                        seed=5000 + i)
        r.dir = os.path.join(root, f"step_{r.k}")
        runs.append(r)
    return runs


def _assert_served_exactly(m: Mounted, k: int, seed: int, deadline: float) -> float:
    """Waits until MNT/step_k/consolidated/ lists; its weights must be kill_state(seed)."""
    cons = m.p(f"step_{k}", "consolidated")
    while listable(cons) is None:
        assert time.time() < deadline, (f"step_{k} complete but not served\n"
                                        + log_about(m, f"step_{k}"))
        time.sleep(0.01)
    at = time.time()
    why = weights_differ(read_all(os.path.join(cons, "model.safetensors")), live_gen.kill_state(seed))
    assert why == "", f"step_{k}: {why}"
    return at


def _check_names(root: str, names: set[int], absent: set[int], want_rc: int) -> str:
    r = run_ckptfs("check", root, text_stdout=True)
    text = r.stdout + r.stderr
    named = {k for k in names | absent if re.search(rf"\bstep_{k}\b", text)}
    assert r.returncode == want_rc, describe(r, 3000)
    assert named == names, (f"check names {sorted(named)}, the broken steps are {sorted(names)}\n"
                            + describe(r, 3000))
    return text


def test_killed_writer_never_served(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    saver = live_gen.ForkSaver(str(tmp_path / "forksaver.log"))
    runs = _plan_kills(str(root))
    rng = random.Random(KILL_SEED + 1)
    for r in runs:
        if r.mode == "delay":
            r.at = rng.uniform(0.0, saver.save_seconds)
    try:
        with Mounted(str(root), base_dir=str(tmp_path)) as m:
            watch = ViewWatch(m.path, str(root))
            watch.start()
            try:
                # one save at a time (a kill lands where it was aimed), all
                # watched until ~2 rescans after the last kill
                for r in runs:
                    _kill_one(saver, r, watch)
                time.sleep(WINDOW_S)
            finally:
                watch.stop_flag.set()
                watch.join()
            _judge_kills(m, runs, watch, saver)
    finally:
        saver.close()


def _judge_kills(m: Mounted, runs: list[KillRun], watch: ViewWatch,
                 saver: live_gen.ForkSaver) -> None:
    by = {o: [r for r in runs if r.outcome == o] for o in ("complete", "partial", "empty")}
    print(f"\n{KILL_RUNS} killed saves (one warm save took {saver.save_seconds * 1000:.0f} ms): "
          + ", ".join(f"{o} {len(v)}" for o, v in by.items())
          + "; " + " ".join(f"{r.k}:{r.mode}@{r.at:.3g}->{r.outcome}" for r in runs))
    assert not watch.violations, watch.violations[:10]
    for r in by["partial"] + by["empty"]:
        assert r.k not in watch.seen, (f"step_{r.k} ({r.outcome}) was served\n"
                                       + log_about(m, f"step_{r.k}"))
        assert listable(m.p(f"step_{r.k}", "consolidated")) is None, f"step_{r.k} is served"
    for r in by["complete"]:
        _assert_served_exactly(m, r.k, r.seed, time.time() + 5.0)
    # not vacuous: most kills landed in the middle of a save
    assert len(by["partial"]) >= KILL_RUNS // 2, {o: len(v) for o, v in by.items()}
    broken = {r.k for r in by["partial"]}
    text = _check_names(m.root, broken, {r.k for r in by["complete"] + by["empty"]}, 5)
    print("check names every broken step:\n  " + "\n  ".join(text.strip().splitlines()[-8:]))
    # saving into each broken step's directory again makes it appear, exact
    pids = {r.k: saver.save(r.dir, r.seed + 1000) for r in by["partial"]}
    statuses = {k: saver.reap(pid) for k, pid in pids.items()}
    assert set(statuses.values()) == {0}, statuses
    t0 = time.time()
    late = max(_assert_served_exactly(m, r.k, r.seed + 1000, t0 + 10.0) for r in by["partial"])
    print(f"{len(pids)} broken steps saved again: all served within {late - t0:.3f} s")
    _check_names(m.root, set(), broken | {r.k for r in by["complete"]}, 0)


# ---------------------------------------------------------------------------
# 4. a served step saved again: old, EIO, new; never a mix
# ---------------------------------------------------------------------------


def test_resave_serves_new_values_or_eio_never_a_mix(live):
    rs = live.resave
    kinds = [k for _, k, _ in rs.outcomes]
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    firsts = {k: next(t for t, kk, _ in rs.outcomes if kk == k) - rs.metadata_mtime for k in counts}
    print(f"\nre-save of step_{RESAVED}: reads {counts}; first of each, seconds after the new "
          f".metadata's mtime: { {k: round(v, 3) for k, v in firsts.items()} }; final {rs.final}")
    mixes = [d for _, k, d in rs.outcomes if k == "mix"]
    assert not mixes, f"{len(mixes)} reads mixed or garbled: {mixes[:3]}"
    others = set(kinds) - {"old", "new", "EIO"}
    assert not others, f"reads failed with {others} (only EIO is allowed while rewriting)"
    assert "new" not in kinds or "old" not in kinds[kinds.index("new"):], \
        "old values served after the new ones"
    assert "EIO" not in kinds or "old" not in kinds[kinds.index("EIO"):], \
        "old values served after a read had failed with EIO (the change was seen)"
    assert rs.final == "new", (
        f"{APPEAR_LIMIT_S:g} s after the re-save returned the file still reads as {rs.final!r}\n"
        + log_about(live.mount, f"step_{RESAVED}"))
    assert rs.logits_equal, "from_pretrained after the re-save: logits differ from the new model's"


def test_check_sees_the_live_steps(live):
    # `ckptfs check ROOT` on the mounted root: the steps saved while mounted
    # are checkpoints of ROOT like any other (not an index from before them)
    saved = [d for d in os.listdir(live.root)
             if os.path.exists(os.path.join(live.root, d, ".metadata"))]
    r = run_ckptfs("check", live.root, text_stdout=True)
    summary = (r.stdout + r.stderr).strip().splitlines()[-1:]
    print(f"\ncheck on the live root ({len(saved)} saved steps): exit {r.returncode}, {summary}")
    assert r.returncode == 0, describe(r, 2000)
    assert summary and f" {len(saved)} checkpoint(s)" in summary[0], describe(r, 2000)
