#!/usr/bin/env python3
"""Writers for the live-mount tests (test_live.py): real ``dcp.save`` calls
into a mounted training root, timed and killed from the test.

- ``StepSaver``: 2 gloo ranks (harness.spawn_ranks) that save one DCP
  checkpoint per task, each only once the test creates the task's go file;
  rank 0 records when ``dcp.save`` returned in the task's done file. The
  test decides when each save starts, so it can watch the mount around it.
- ``ForkSaver``: one process that imports torch once and forks a child per
  ``dcp.save`` (single process, no process group), so a test can SIGKILL
  dozens of saves at random points without paying torch's import each time.
- ``training_state(seed)`` / ``kill_state(seed)``: the state dicts saved.

Both run `python3 live_gen.py _worker ...` / `python3 live_gen.py serve`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import dcp_gen
from harness import spawn_ranks

import torch  # noqa: E402  (dcp_gen set the offline variables first)

# ---------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------


def training_state(seed: int) -> dict:
    """A tiny LlamaForCausalLM after one AdamW step, as a training loop saves
    it: {"model": model.state_dict(), "optim": optimizer state}, with
    tensor-parallel placements for the model and its Adam moments.

    Returns {"model", "config", "state", "placements", "weights" (the model
    state dict, what consolidated/ must hold), "input_ids", "logits"}."""
    model, config, msd, osd, logits = dcp_gen._llama(False, seed=seed, with_optim=True)
    placements = {}
    for fqn in msd:
        placements[f"model.{fqn}"] = dcp_gen._llama_placement(fqn)
    for fqn in osd["state"]:
        placements[f"optim.state.{fqn}.exp_avg"] = dcp_gen._llama_placement(fqn)
        placements[f"optim.state.{fqn}.exp_avg_sq"] = dcp_gen._llama_placement(fqn)
    return {"model": model, "config": config, "state": {"model": msd, "optim": osd},
            "placements": placements, "weights": msd, **logits}


# The killed saves: one file per tensor (single_file_per_rank=False), so a
# save passes through KILL_TENSORS+1 visible states before its .metadata.
KILL_TENSORS = 32
KILL_SHAPE = (64, 128)  # 32 KiB of float32 per file


def kill_state(seed: int) -> dict[str, torch.Tensor]:
    """A flat HF-named state dict: consolidated/ holds every tensor of it."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(KILL_SHAPE, generator=g)
            for i in range(KILL_TENSORS)}


# ---------------------------------------------------------------------------
# StepSaver: 2 gloo ranks saving on the test's signal
# ---------------------------------------------------------------------------


def _wait_for(path: str, abort: str, timeout: float) -> bool:
    """True once `path` exists; False when `abort` appears or on timeout."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if os.path.exists(abort) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for task in job["tasks"]:
            if not _wait_for(task["go"], job["abort"], job["wait_s"]):
                break
            job_input = torch.load(task["input_path"], weights_only=False)
            sd = dcp_gen._distribute(job_input["state"], (), job_input["placements"], mesh)
            writer = dcp.FileSystemWriter(task["out_dir"], single_file_per_rank=True,
                                          thread_count=1, sync_files=False)
            dcp.save(sd, storage_writer=writer)
            returned = time.time()
            if rank == 0:
                _write_atomically(task["done"], json.dumps({"returned": returned}))
            dist.barrier()
    finally:
        dist.destroy_process_group()


class StepSaver:
    """Runs the gloo ranks in a background thread, one save per directory in
    ``out_dirs`` (in order). ``go(i, state, placements)`` starts save i of
    the nested state dict (DTensors where ``placements`` says, e.g.
    {"model.lm_head.weight": "S0"}); ``wait_done(i)`` returns the wall time
    its ``dcp.save`` returned."""

    def __init__(self, ctl_dir: str, out_dirs: list[str], world_size: int = 2,
                 wait_s: float = 240.0):
        self.ctl = ctl_dir
        self.abort = os.path.join(ctl_dir, "abort")
        self.tasks = []
        for i, out_dir in enumerate(out_dirs):
            self.tasks.append({"out_dir": out_dir, "input_path": os.path.join(ctl_dir, f"input{i}.pt"),
                               "go": os.path.join(ctl_dir, f"go{i}"),
                               "done": os.path.join(ctl_dir, f"done{i}")})
        self.world_size, self.wait_s = world_size, wait_s
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "StepSaver":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            spawn_ranks(__file__, self.world_size,
                        {"tasks": self.tasks, "abort": self.abort, "wait_s": self.wait_s},
                        name="live_gen", timeout=self.wait_s + 60,
                        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        except BaseException as e:  # reported by wait_done / stop
            self.error = e

    def go(self, i: int, state: dict, placements: dict[str, str]) -> None:
        torch.save({"state": state, "placements": placements}, self.tasks[i]["input_path"])
        with open(self.tasks[i]["go"], "w"):
            pass

    def wait_done(self, i: int, timeout: float = 180.0) -> float:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.tasks[i]["done"]):
            if self.error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the saving ranks stopped before task {i} was done: "
                                   f"{self.error}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"task {i} ({self.tasks[i]['out_dir']}) not saved "
                                   f"within {timeout:g} s")
            time.sleep(0.002)
        with open(self.tasks[i]["done"]) as f:
            return json.load(f)["returned"]

    def stop(self) -> None:
        """Lets ranks still waiting for a go file exit, and joins them."""
        with open(self.abort, "w"):
            pass
        self._thread.join(timeout=self.wait_s + 90)
        if self.error is not None:
            raise RuntimeError(f"the saving ranks failed: {self.error}")


# ---------------------------------------------------------------------------
# ForkSaver: dcp.save in forked children, to be killed
# ---------------------------------------------------------------------------


def _save_flat(out_dir: str, sd: dict) -> None:
    import torch.distributed.checkpoint as dcp
    writer = dcp.FileSystemWriter(out_dir, single_file_per_rank=False, thread_count=1,
                                  sync_files=False)
    dcp.save(sd, storage_writer=writer)


def _serve() -> None:
    """Line protocol on stdin/stdout (one JSON object a line):
    {"op": "save", "dir", "seed"} -> {"pid"}: a child saves kill_state(seed);
    {"op": "reap", "pid"} -> {"status"}: its exit code, or -signal."""
    import warnings
    warnings.simplefilter("ignore")  # DCP's single-process and overwrite warnings
    torch.set_num_threads(1)
    warm = tempfile.mkdtemp(prefix="live_gen_warm_")
    _save_flat(os.path.join(warm, "a"), kill_state(0))  # imports what a child will need
    t0 = time.monotonic()
    _save_flat(os.path.join(warm, "b"), kill_state(0))
    seconds = time.monotonic() - t0
    shutil.rmtree(warm, ignore_errors=True)
    print(json.dumps({"ready": seconds}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "save":
            sd = kill_state(req["seed"])
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _save_flat(req["dir"], sd)
                except BaseException:
                    traceback.print_exc()
                    code = 3
                os._exit(code)
            print(json.dumps({"pid": pid}), flush=True)
        elif req["op"] == "reap":
            _, st = os.waitpid(req["pid"], 0)
            status = os.waitstatus_to_exitcode(st)
            print(json.dumps({"status": status}), flush=True)


class ForkSaver:
    """Client of `live_gen.py serve`. ``save_seconds``: how long one warm
    save took in the server (for choosing kill delays)."""

    def __init__(self, log_path: str):
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
        self.save_seconds = self._reply()["ready"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"live_gen serve exited {self.proc.wait()}; see {self._log.name}")
        return json.loads(line)

    def _ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def save(self, out_dir: str, seed: int) -> int:
        return self._ask(op="save", dir=out_dir, seed=seed)["pid"]

    def reap(self, pid: int) -> int:
        return self._ask(op="reap", pid=pid)["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


if __name__ == "__main__":
    if sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from harness import end_rank
        end_rank()
    elif sys.argv[1] == "serve":
        _serve()
    else:
        sys.exit(f"usage: {sys.argv[0]} serve | _worker RANK WORLD INIT JOB")
