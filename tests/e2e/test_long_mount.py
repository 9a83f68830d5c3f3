"""A mount kept up for long: memory stays flat while checkpoints are
unloaded and loaded again, a file that exists always opens, a checkpoint
whose load failed is loaded once the store is repaired, and a fault that
fails every read leaves a small log with counts.

The churn (bench/bench_churn.py, also run for an hour by hand) opens files
of four checkpoints through `--max-loaded 1`, so nearly every open unloads
one checkpoint and loads another; the expected values are computed here."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_churn import Churn, count_unloads, daemon_pid, full_tensor, make_root, rss_bytes  # noqa: E402
from harness import Mounted, describe, run_ckptfs  # noqa: E402

STEPS, TENSORS = 4, 200
MIB = 1 << 20


def test_churn_keeps_memory_flat_and_every_open_succeeds(tmp_path):
    root = tmp_path / "root"
    make_root(root, STEPS, TENSORS)
    with Mounted(root, "--max-loaded", "1", base_dir=tmp_path, index_dir=tmp_path / "idx") as m:
        pid = daemon_pid(m.path)
        churn = Churn(m.path, STEPS, TENSORS, threads=2).start()
        try:
            time.sleep(5)  # warm-up: every view made, the allocator's arenas grown
            warm, warm_unloads = rss_bytes(pid), count_unloads(m.log_path)
            peak = warm
            for _ in range(20):
                time.sleep(1)
                peak = max(peak, rss_bytes(pid))
        finally:
            st = churn.stop()
        unloads = count_unloads(m.log_path) - warm_unloads
        assert st.errors == {} and st.wrong == 0, (
            f"{st.error_count()} of {st.opens} opens failed {st.errors}, {st.wrong} wrong: {st.examples}")
        assert st.opens >= 2000, f"only {st.opens} opens"
        assert unloads >= 500, f"only {unloads} unloads after the warm-up: not a churn\n" + m.log()[-2000:]
        # ~100 KiB per unload was lost before (hundreds of MiB here).
        assert peak - warm < 16 * MIB, (
            f"RSS grew {(peak - warm) / MIB:.1f} MiB over {unloads} unloads "
            f"({warm / MIB:.1f} -> {peak / MIB:.1f} MiB)")


def test_a_load_that_failed_is_retried_once_the_store_is_repaired(tmp_path):
    root, index = tmp_path / "root", tmp_path / "index"
    make_root(root, 2, 4)
    with Mounted(root, "--index", index, base_dir=tmp_path) as m:
        # Damaged after the mount listed it, before step_001's first use.
        for sst in index.glob("*.sst"):
            data = bytearray(sst.read_bytes())
            for i in range(64, min(len(data), 4096)):
                data[i] ^= 0xFF
            sst.write_bytes(bytes(data))
        consolidated = m.p("step_001", "consolidated")
        for _ in range(3):
            try:
                os.listdir(consolidated)
                raise AssertionError("a damaged store served the views\n" + m.log())
            except OSError as e:
                assert e.errno == errno.EIO, f"{errno.errorcode.get(e.errno)}, not EIO\n" + m.log()
        assert "step_001/: cannot load the checkpoint" in m.log(), m.log()
        # Repaired by hand: the store removed and built again.
        shutil.rmtree(index)
        p = run_ckptfs("index", root, "--index", index)
        assert p.returncode == 0, describe(p)
        deadline, got = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            try:
                got = np.load(m.p("step_001", "tensors", "layer.2.w.npy"))
                break
            except OSError as e:
                assert e.errno == errno.EIO, f"{errno.errorcode.get(e.errno)}, not EIO\n" + m.log()
                time.sleep(0.5)
        assert got is not None, "step_001 never loaded after the repair\n" + m.log()
        np.testing.assert_array_equal(got, full_tensor(1, 2))
        assert "step_001/: loaded after" in m.log(), m.log()


def test_every_read_failing_leaves_a_small_log_with_counts(tmp_path):
    root = tmp_path / "root"
    make_root(root, 1, 4)
    with Mounted(root, "--rescan-ms", "500", base_dir=tmp_path, index_dir=tmp_path / "idx") as m:
        path = m.p("step_000", "consolidated", "model.safetensors")
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            with open(root / "step_000" / "shard-00002-model-00001-of-00001.safetensors", "ab") as f:
                f.write(b"tail")  # a source changed: every read of the step is EIO
            reads, before = 5000, len(m.log())
            for k in range(reads):
                try:
                    os.pread(fd, 16, size - 16 - k % 100)  # tensor bytes (the header is literal)
                    raise AssertionError(f"read {k} of a changed source succeeded")
                except OSError as e:
                    assert e.errno == errno.EIO, errno.errorcode.get(e.errno)
        finally:
            os.close(fd)
        grew = len(m.log()) - before
        assert grew < 10_000, f"{grew} bytes of log for {reads} failed reads"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "more like this in the last 10 s" not in m.log():
            time.sleep(0.5)
        assert "more like this in the last 10 s" in m.log(), m.log()[-3000:]
