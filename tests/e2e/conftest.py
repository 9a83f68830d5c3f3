"""Shared fixtures for the ckptfs end-to-end tests.

- ``ckptfs_bin``: the binary under test ($CKPTFS_BIN, default
  build/ckptfs of this checkout).
- ``ckptfs``: run a CLI subcommand, returning a CompletedProcess (bytes).
- ``index_dir``: $CKPTFS_INDEX_DIR for the whole session (a tmp dir, so
  ~/.cache is never touched).
- ``main_ckpt`` / ``mapping_ckpt`` / ``llama_ckpt``: real checkpoints written
  by torch's HuggingFaceStorageWriter on 2 gloo ranks (generated once per
  run, all three in parallel, shared by pytest-xdist's workers, see
  ``_generation``).
- ``mount_ckptfs(...)``: context manager that mounts into a tmp dir with
  ``--log-file``, yields a ``Mount`` and always unmounts (``fusermount3 -u``,
  falling back to ``-u -z``), even when the body fails.
- ``main_mount`` / ``main_split_mount`` / ``mapping_mount`` / ``llama_mount``:
  session-scoped mounts of the above.
- ``s3_server`` / ``s3_env``: a real S3 server per test module (s3_server.py)
  and the AWS_* environment of its identity.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent
# tools/: s3_server.py, the S3 server the tests, the benchmarks and the demo share.
for _dir in (E2E_DIR.parent.parent / "tools", E2E_DIR):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

import ckpt_gen  # noqa: E402
import harness  # noqa: E402
from harness import DEFAULT_BIN, is_mounted, unmount  # noqa: E402,F401
import torch  # noqa: E402


# ---------------------------------------------------------------------------
# what the generated checkpoints hold
# ---------------------------------------------------------------------------

# The main checkpoint: BF16/F32 Shard(0) (7 rows over 2 ranks) and Shard(1)
# (9 cols over 2 ranks), Replicate, ints (I64 sharded, I32 replicated), and
# the edge cases: 3-d Shard(1), a Shard(0) tensor with fewer rows than ranks
# (one empty chunk), 0-d scalar, empty (0, 3) tensor, F16/F64/I16/U8/BOOL,
# a plain tensor, plus two larger tensors that span several pages (a
# column-sharded F32 with uneven columns -> many row pieces; an uneven
# row-sharded BF16).
MAIN_SPECS: dict = {}
MAIN_SPECS.update(ckpt_gen.BASE_SPECS)
MAIN_SPECS.update(ckpt_gen.INT_SPECS)
MAIN_SPECS.update(ckpt_gen.EXTRA_SPECS)
MAIN_SPECS.update({
    "extra.empty": ((0, 3), torch.float32, "shard1"),
    "extra.flag": ((5,), torch.bool, "replicate"),
    "extra.bytes": ((7, 2), torch.uint8, "shard0"),
    "extra.short": ((3, 5), torch.int16, "shard1"),
    "extra.wide": ((129, 67), torch.float32, "shard1"),
    "extra.tall": ((257, 33), torch.bfloat16, "shard0"),
})

# Files added to the main checkpoint directory besides the shards: sidecars
# (beside the weights and in .hf_metadata/) and unrelated files whose modes
# the mount must mirror (minus write bits).  relpath -> (mode, bytes)
MAIN_EXTRA_FILES: dict[str, tuple[int, bytes]] = {
    "config.json": (0o644, json.dumps({"model_type": "synthetic",
                                       "architectures": ["Synthetic"]},
                                      indent=2).encode() + b"\n"),
    "tokenizer_config.json": (0o644, b'{"model_max_length": 128}\n'),
    ".hf_metadata/generation_config.json": (0o644, b'{"do_sample": false}\n'),
    "README.md": (0o640, b"# step 100\n\nA test checkpoint.\n"),
    "scripts/run.sh": (0o755, b"#!/bin/sh\necho run\n"),
    "notes/empty.txt": (0o600, b""),
    "notes/deep/data.bin": (0o444, bytes(range(256)) * 50),
}
MAIN_EXTRA_DIRS: dict[str, int] = {"empty_dir": 0o750}
# sidecar name in consolidated/ -> source relpath: every non-weight file of
# the model folder; notes/ holds a .bin (a weight file), so it stays out.
MAIN_SIDECARS = {
    "config.json": "config.json",
    "tokenizer_config.json": "tokenizer_config.json",
    "generation_config.json": ".hf_metadata/generation_config.json",
    "README.md": "README.md",
    "scripts/run.sh": "scripts/run.sh",
}

# The mapping checkpoint: BASE + INT tensors, written with a round-robin
# fqn_to_index_mapping over 3 files and the NeMo-style .hf_metadata sidecar.
MAPPING_NUM_FILES = 3


def _gen_main(path: str) -> dict:
    info = ckpt_gen.write_hf_sharded(path, 2, specs=MAIN_SPECS)
    for rel, (mode, data) in MAIN_EXTRA_FILES.items():
        p = os.path.join(path, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, mode)
    for rel, mode in MAIN_EXTRA_DIRS.items():
        os.makedirs(os.path.join(path, rel))
        os.chmod(os.path.join(path, rel), mode)
    return info


def _gen_mapping(path: str) -> dict:
    return ckpt_gen.write_hf_sharded(path, 2, include_int=True,
                                     num_files=MAPPING_NUM_FILES, hf_metadata=True,
                                     seed=4321)


def _gen_llama(path: str) -> dict:
    return ckpt_gen.write_llama_sharded(path, 2, dtype="float32")


# ---------------------------------------------------------------------------
# binary, index dir, CLI runner
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ckptfs_bin() -> str:
    path = os.environ.get("CKPTFS_BIN", DEFAULT_BIN)
    assert os.path.isfile(path) and os.access(path, os.X_OK), (
        f"ckptfs binary not found at {path}: build it or set CKPTFS_BIN")
    return path


@pytest.fixture(scope="session", autouse=True)
def index_dir(tmp_path_factory) -> str:
    """$CKPTFS_INDEX_DIR for every ckptfs run of the session."""
    d = str(tmp_path_factory.mktemp("ckptfs-index"))
    old = os.environ.get("CKPTFS_INDEX_DIR")
    os.environ["CKPTFS_INDEX_DIR"] = d
    yield d
    if old is None:
        os.environ.pop("CKPTFS_INDEX_DIR", None)
    else:
        os.environ["CKPTFS_INDEX_DIR"] = old


def run_ckptfs(bin_path: str, *args, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """Runs `ckptfs ARGS...` (harness.run_ckptfs: output through files,
    never pipes a daemon could keep open). Returns CompletedProcess with
    bytes stdout and stderr."""
    return harness.run_ckptfs(*args, bin_path=bin_path, timeout=timeout, cwd=cwd,
                              text_stderr=False)


@pytest.fixture(scope="session")
def ckptfs(ckptfs_bin):
    def run(*args, **kw) -> subprocess.CompletedProcess:
        return run_ckptfs(ckptfs_bin, *args, **kw)
    return run


# ---------------------------------------------------------------------------
# mounting
# ---------------------------------------------------------------------------


# is_mounted / unmount: harness.py (test modules import is_mounted from here).


class MountError(RuntimeError):
    def __init__(self, rc: int, stderr: str, cmd):
        super().__init__(f"{' '.join(map(str, cmd))} exited {rc}: {stderr}")
        self.rc = rc
        self.stderr = stderr


@dataclass
class Mount(harness.MountPoint):
    """What mount_ckptfs yields; p(*rel) and log() from harness.MountPoint."""
    path: str            # the mount point
    root: str            # the source root
    log_path: str        # --log-file
    args: tuple = ()
    stderr: str = ""
    extra: dict = field(default_factory=dict)


@contextlib.contextmanager
def mount_ckptfs(bin_path: str, root: str, *args: str, base_dir: str | None = None):
    """Mounts `root` on a fresh tmp dir (`ckptfs mount ROOT MNT --log-file F
    ARGS`), yields a Mount, and always unmounts afterwards (harness.unmount:
    fusermount3 -u retried, then -u -z)."""
    base = base_dir or tempfile.gettempdir()
    mnt = tempfile.mkdtemp(prefix="ckptfs-mnt-", dir=base)
    log_path = mnt + ".log"
    try:
        proc = run_ckptfs(bin_path, "mount", root, mnt, "--log-file", log_path, *args)
        stderr = proc.stderr.decode(errors="replace")
        if proc.returncode != 0:
            raise MountError(proc.returncode, stderr, proc.args)
        if not is_mounted(mnt):
            raise MountError(proc.returncode, "exited 0 but nothing is mounted: " + stderr,
                             proc.args)
        yield Mount(path=mnt, root=root, log_path=log_path, args=args, stderr=stderr)
    finally:
        unmount(mnt)
        if not is_mounted(mnt):
            with contextlib.suppress(OSError):
                os.rmdir(mnt)


@pytest.fixture(scope="session")
def mount_factory(ckptfs_bin, tmp_path_factory):
    """mount_factory(root, *args) -> context manager yielding a Mount."""
    base = str(tmp_path_factory.mktemp("mounts"))

    def make(root: str, *args: str):
        return mount_ckptfs(ckptfs_bin, root, *args, base_dir=base)
    return make


# ---------------------------------------------------------------------------
# a real S3 server (tools/s3_server.py)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server for the test module: {endpoint, client, port}."""
    import s3_server as s3

    server = s3.Server(tmp_path_factory.mktemp("seaweedfs"))
    yield server.as_dict()
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS_* environment of the server's identity (no profile, no token)."""
    import s3_server as s3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    return s3_server


# ---------------------------------------------------------------------------
# generated checkpoints (once per session, in parallel)
# ---------------------------------------------------------------------------


def _generate_all(base: Path) -> dict:
    """Runs all generators at once (they mostly wait on process start-up
    and gloo, so running them together roughly halves the wall time)."""
    jobs = {"main": _gen_main, "mapping": _gen_mapping, "llama": _gen_llama}
    with ThreadPoolExecutor(max_workers=len(jobs)) as ex:
        futures = {name: ex.submit(fn, str(base / name)) for name, fn in jobs.items()}
        return {name: f.result(timeout=600) for name, f in futures.items()}


@pytest.fixture(scope="session")
def _generation(tmp_path_factory) -> dict:
    """{name: info} of the generated checkpoints, made once per run: under
    pytest-xdist every worker is a session of its own, so the first worker
    that needs them generates them into the run's shared temp dir, under a
    file lock, and the others load what it recorded. Tests only read them
    (a test that breaks one works on copy_ckpt's copy). $CKPTFS_TEST_CKPTS,
    when set, is used instead of the run's temp dir: tools/test.sh points
    its passes at one dir, so a run generates them once, not once a pass."""
    if os.environ.get("CKPTFS_TEST_CKPTS"):
        root = Path(os.environ["CKPTFS_TEST_CKPTS"])
    else:
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            base = base.parent  # the run's dir, above each worker's own
        root = base / "ckpts"
    root.mkdir(exist_ok=True)
    record = root / "generated.pt"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.exists():
            return torch.load(record, weights_only=False)
        infos = _generate_all(root)
        torch.save(infos, str(record) + ".tmp")
        os.rename(str(record) + ".tmp", record)
        return infos


@pytest.fixture(scope="session")
def main_ckpt(_generation, ckptfs) -> dict:
    """The main checkpoint (MAIN_SPECS + MAIN_EXTRA_FILES), indexed with
    `ckptfs index` (exit 0, no problems)."""
    info = _generation["main"]
    r = ckptfs("index", info["out_dir"])
    assert r.returncode == 0, r.stderr.decode()
    assert b"problem" not in r.stderr, r.stderr.decode()
    return info


@pytest.fixture(scope="session")
def mapping_ckpt(_generation) -> dict:
    """BASE+INT tensors saved over 3 files per rank with a
    fqn_to_index_mapping, and .hf_metadata/{config.json,
    fqn_to_file_index_mapping.json}. Not indexed beforehand (the mount
    indexes it)."""
    return _generation["mapping"]


@pytest.fixture(scope="session")
def llama_ckpt(_generation) -> dict:
    """Tiny random Llama (F32) saved across 2 ranks, with config.json."""
    return _generation["llama"]


@pytest.fixture(scope="session")
def main_mount(main_ckpt, mount_factory):
    with mount_factory(main_ckpt["out_dir"]) as m:
        yield m


SPLIT_SIZE = "1KB"
SPLIT_BYTES = 1000


@pytest.fixture(scope="session")
def main_split_mount(main_ckpt, mount_factory):
    with mount_factory(main_ckpt["out_dir"], "--max-file-size", SPLIT_SIZE) as m:
        yield m


@pytest.fixture(scope="session")
def mapping_mount(mapping_ckpt, mount_factory):
    with mount_factory(mapping_ckpt["out_dir"]) as m:
        yield m


@pytest.fixture(scope="session")
def llama_mount(llama_ckpt, mount_factory):
    with mount_factory(llama_ckpt["out_dir"]) as m:
        yield m


@pytest.fixture(scope="session")
def copy_ckpt(tmp_path_factory):
    """copy_ckpt(src_dir) -> a fresh copy (own index, free to break)."""
    base = tmp_path_factory.mktemp("copies")
    n = [0]

    def make(src: str) -> str:
        n[0] += 1
        dst = str(base / f"copy{n[0]}" / os.path.basename(src))
        shutil.copytree(src, dst)
        return dst
    return make


# ---------------------------------------------------------------------------
# test tiers (tools/test.sh): serial tests, the quick tier, CI skips nothing
# ---------------------------------------------------------------------------

# Tests that run alone, after the side-by-side pass (`pytest -m serial`):
# each asserts a bound that other tests on the same cores would break
# without anything being wrong (the daemon's RSS, a time, a thread count,
# page-cache residency), or loads the machine so much that its neighbours'
# bounds would break. "file::test function" (every parametrization) or a
# whole file -> why.
SERIAL = {
    "test_long_mount.py::test_churn_keeps_memory_flat_and_every_open_succeeds":
        "bounds the daemon's RSS growth over a churn",
    "test_merged.py::test_eight_readers_by_mmap_and_read_get_exact_bytes_in_bounded_memory":
        "bounds the daemon's peak RSS",
    "test_live.py::test_steps_appear_within_seconds_of_commit":
        "bounds the median time from commit to listable",
    "test_faults.py::test_fault_harness":
        "its readers must still be reading when the source changes (side by side, "
        "all 15000 reads of one kind ended before the change: no EIO to see)",
    "test_faults.py::test_page_cache_after_fault_and_restore":
        "EIO within 2 s of a change",
    "test_faults.py::test_restored_source_stays_eio_until_reindex":
        "EIO within 2 s of a change",
    "test_s3.py::test_an_object_overwritten_after_indexing_is_reported":
        "fails within 20 s",
    "test_s3_mount.py::test_ckptfs_over_s3fs_serves_exact_bytes_after_s3fs_renumbers_then_sees_an_overwrite":
        "drops the machine's page cache (drop_caches): side by side, a test that counts the "
        "bytes its mount fetched saw them fetched twice (test_read_order, safe_open_random)",
    "test_s3_mount.py::test_mount_with_a_wrong_secret_fails_at_once_and_names_credentials":
        "fails within 30 s (not among SERIAL_WAITING: its module fixtures run gloo ranks, "
        "which would load the machine under the stall tests' bounds)",
    "test_readahead.py::test_sequential_reader_gets_its_sources_read_ahead":
        "page-cache residency within 10 s",
    "test_python_mount.py::test_sigint_at_any_moment_of_mount_leaves_nothing":
        "interrupts timed from the start-up measured just before",
    "test_writer_refused.py::test_a_refused_save_leaves_no_writer_thread_running":
        "counts the process's threads",
    "test_s3_cache.py::test_a_second_mount_reads_from_the_cache_and_a_bad_block_is_fetched_again":
        "bounds the GETs of readers racing for a bad block (5 > 4 seen at load 27)",
}

# Serial tests that wait rather than work: each bounds a wall time that is
# almost all sleep (a stalled GET's 2 s window, a retry budget of 20 s),
# with the CPU idle meanwhile, so they may share the machine with each other
# and with the SERIAL tests (which they barely load), though never with the
# side-by-side pass: tools/test.sh runs them beside the SERIAL tests, on 2
# workers (whole files per worker, one file each).
# They are marked `serial` too (`-m "not serial"` leaves them out) and
# `waits`. Same form as SERIAL.
SERIAL_WAITING = {
    "test_s3_stall.py": "every read through a stalling server within 5 s (a dozen stalls of 2-3 s)",
    "test_s3_mount.py::test_stalled_and_trickling_gets_are_abandoned_retried_then_eio_in_bounded_time":
        "EIO within a bounded time (three reads that wait out stalls and a trickle for 14-40 s)",
}

# The quick tier (`pytest tests/e2e --quick`, `tools/test.sh --quick`: with
# the unit tests under 5 minutes on 2 cores): whole files that each cover
# one path end to end, chosen for their speed; --quick does not even import
# the others. file -> what it covers.
QUICK = {
    "test_mount.py": "a mount of a real HF-sharded save: consolidated/, modes, ranges, EIO",
    "test_inspect.py": "the CLI: ls, inspect, check, verify, help of every subcommand",
    "test_store.py": "the RocksDB store: commits, re-index, lazy loads",
    "test_families.py": "model families loaded by transformers from consolidated/",
    "test_presets.py": "mesh/ presets",
    "test_access.py": "permissions and symlinks of the source tree and the views",
    "test_mountpoints.py": "mount points refused or accepted, mount -f ended by a signal",
    "test_torch_save_fixtures.py": "torch.save files written by other projects",
    "test_writer_framing.py": "the writer's torch.save framing, read by torch.load",
    "test_s3_cache.py": "an s3:// root on a real S3 server, with --cache",
}


# The slowest files, slowest first (per-file time of a full run, -n 3 on 2
# cores, as measured file by file and in the CI log's slowest durations).
# With --no-loadscope-reorder (tools/test.sh passes it) pytest-xdist hands
# whole files to its workers in collection order, so collecting these first
# keeps one of them from starting last and running alone at the end; the
# other files follow in their usual order. (Without it, xdist orders files
# by their number of tests, and a file of 2 slow tests, test_writer_crash.py,
# started last.) The S3 fault files lead: each holds several tests of 20-70 s.
SLOW_FIRST = [
    "test_s3_predicted_exact.py", "test_exact_property.py", "test_s3_mount.py", "test_writer_s3_faults.py", "test_writer_crash.py", "test_s3_mount_faults.py",
    "test_writer_s3_hf.py", "test_s3.py", "test_writer_sidecars.py", "test_packaging.py",
    "test_writer_dtypes.py", "test_writer_hf.py", "test_dcp.py", "test_bytecheckpoint.py",
    "test_read_order.py", "test_writer_record.py", "test_peft.py", "test_merged.py",
    "test_writer_refused.py", "test_bad_input.py", "test_writer.py", "test_store_repair.py",
    "test_demo.py", "test_torch_e2e.py", "test_resave_live.py", "test_mesh.py", "test_faults.py",
    "test_mount.py", "test_rare_dtypes.py",
]


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="only the quick tier: the files conftest.QUICK names (tools/test.sh --quick)")


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: runs alone, after the side-by-side pass (conftest.SERIAL, "
                                       "conftest.SERIAL_WAITING)")
    config.addinivalue_line("markers", "waits: serial, but may run beside the other `waits` tests and the "
                                       "`serial` ones (conftest.SERIAL_WAITING)")
    config.addinivalue_line("markers", "quick: in the quick tier (conftest.QUICK)")


def pytest_ignore_collect(collection_path, config):
    """With --quick, the test files outside the quick tier are not collected."""
    if not config.getoption("quick"):
        return None
    name = collection_path.name
    if collection_path.is_file() and name.startswith("test_") and name.endswith(".py"):
        return name not in QUICK or None
    return None


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect by these marks
def pytest_collection_modifyitems(config, items):
    """Marks the tests SERIAL, SERIAL_WAITING and QUICK name; an entry that names no test of
    a file collected whole is an error, so a renamed test cannot silently
    leave its tier."""
    used, files = set(), set()
    for item in items:
        fname = item.path.name
        files.add(fname)
        for key in (fname, f"{fname}::{item.originalname}"):
            if key in SERIAL:
                item.add_marker(pytest.mark.serial)
                used.add(key)
            if key in SERIAL_WAITING:
                item.add_marker(pytest.mark.serial)
                item.add_marker(pytest.mark.waits)
                used.add(key)
            if key in QUICK:
                item.add_marker(pytest.mark.quick)
                used.add(key)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    stale = [k for k in (*SERIAL, *SERIAL_WAITING, *QUICK) if k.split("::")[0] in files and k not in used]
    if stale and not any("::" in str(a) for a in config.args):
        raise pytest.UsageError(f"conftest.py SERIAL/SERIAL_WAITING/QUICK name tests that do not exist: {stale}")


def pytest_sessionfinish(session, exitstatus):
    """In CI (CI=true) a skipped test fails the run: everything must run."""
    if os.environ.get("CI") != "true" or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; in CI nothing may skip", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
