"""A DCP step read through consolidated/ fetches each source byte once
(source/ordered_fetch.h): a sequential read(), safetensors' load_file,
transformers' from_pretrained and safe_open in reverse and random order,
on local disk and through a real S3 server (SeaweedFS, tools/s3_server.py), each
on a fresh mount whose own log says what it fetched. The bytes are judged
by safetensors/transformers against the tensors the step was made from
(order_gen.py); what was fetched against the tensors' size computed from
those tensors, never from the mount.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import harness
import order_gen
from s3_server import BUCKET, upload_tree

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["read", "load_file", "from_pretrained", "safe_open_reverse", "safe_open_random"]
COUNTERS = re.compile(r"fetched (\d+) bytes from its sources \((\d+) bytes in source order, (\d+) bytes pinned, "
                      r"(\d+) bytes with O_DIRECT, (\d+) bytes refetched\), served (\d+) bytes")
HOLD = re.compile(r"source-order hold: peak (\d+) bytes of the (\d+) bytes? bound")
PUSHED = re.compile(r"pushed pages: (\d+) bytes spliced from pinned source files, (\d+) bytes from memory")


def _make_step(base, larger: bool = False) -> dict:
    out = base / "step-100"
    expected = order_gen.write_step(str(out), larger)
    expected_path = str(base / "expected.pt")
    torch.save(expected, expected_path)
    tensor_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    return {"dir": str(out), "expected": expected, "expected_path": expected_path,
            "tensor_bytes": tensor_bytes}


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    return _make_step(tmp_path_factory.mktemp("order"))


@pytest.fixture(scope="module")
def larger_step(tmp_path_factory):
    return _make_step(tmp_path_factory.mktemp("order-larger"), larger=True)


def _read_with(mode: str, folder: str, expected_path: str) -> None:
    p = subprocess.run([sys.executable, os.path.join(HERE, "order_reader.py"), mode, folder, expected_path],
                       capture_output=True, text=True, timeout=300, cwd=HERE)
    assert p.returncode == 0 and p.stdout.startswith("ok"), (mode, p.stdout[-2000:], p.stderr[-4000:])


def _final_log(m) -> str:
    deadline = time.monotonic() + 10
    while "unmounted" not in m.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    return m.log()


def _as_counters(found: tuple) -> dict:
    fetched, ordered, pinned, direct, refetched, served = map(int, found)
    return {"fetched": fetched, "ordered": ordered, "pinned": pinned, "direct": direct, "refetched": refetched,
            "served": served}


def _counters(log: str) -> dict:
    found = COUNTERS.findall(log)
    assert len(found) == 1, log[-3000:]
    return _as_counters(found[0])


def _pushed(log: str) -> tuple[int, int]:
    """Bytes of pushed pages the mount spliced from pinned source files, and
    bytes it pushed from memory."""
    found = PUSHED.findall(log)
    assert len(found) == 1, log[-3000:]
    return int(found[0][0]), int(found[0][1])


def _check_fetched(c: dict, tensor_bytes: int, what: str) -> None:
    # Every tensor byte is read from the sources at least once; at most 5 %
    # more (the few KiB between a DCP file's items are fetched with them).
    assert tensor_bytes <= c["fetched"] <= 1.05 * tensor_bytes, (what, c, tensor_bytes)
    # Most of it by the source-order plan: the ordinary path's share is the
    # reads before two tensors were begun.
    assert c["ordered"] >= 0.5 * tensor_bytes, (what, c, tensor_bytes)


@pytest.mark.parametrize("mode", MODES)
def test_each_source_byte_fetched_once_from_disk(mode, step, mount_factory):
    with mount_factory(step["dir"]) as m:
        _read_with(mode, m.p("consolidated"), step["expected_path"])
    log = _final_log(m)
    c = _counters(log)
    _check_fetched(c, step["tensor_bytes"], mode)
    # Local sources: the fetch pushes from pinned source pages (the mount
    # runs as root, which may lease any file), not from copies of them.
    assert c["pinned"] >= 0.5 * step["tensor_bytes"], (mode, c)
    # Their pages go into the file's page cache by splice, none from memory
    # (readers take no range here: every push is a pinned range's).
    spliced, from_memory = _pushed(log)
    assert spliced > 0 and from_memory == 0, (mode, PUSHED.search(log).group(0), c)
    assert HOLD.search(log), log[-2000:]


def _invert_in_place(path: str, delay_s: float) -> None:
    """After `delay_s`, inverts every byte of `path` in place, 1 MiB per
    write(), as a tool rewriting the file would."""
    time.sleep(delay_s)
    with open(path, "r+b", buffering=0) as w:
        old = w.read()
        new = np.bitwise_not(np.frombuffer(old, np.uint8)).tobytes()
        for at in range(0, len(new), 1 << 20):
            w.seek(at)
            w.write(new[at:at + (1 << 20)])


def _expected_file(path: str, expected: dict) -> tuple[bytes, int]:
    """The bytes consolidated/model.safetensors must hold: its header as
    the mount gives it (read before any source changes), then each tensor's
    bytes from the tensors the step was made from, where the header puts
    them. Returns (bytes, header length)."""
    import json
    with open(path, "rb", buffering=0) as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
    want = bytearray(os.path.getsize(path))
    want[:8 + n] = n.to_bytes(8, "little") + raw
    for name, meta in json.loads(raw).items():
        if name != "__metadata__":
            b, e = meta["data_offsets"]
            want[8 + n + b:8 + n + e] = expected[name].contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(want), 8 + n


def _pass_over(fd: int, want: bytes, start: int, first=None) -> tuple[int, int, int]:
    """Reads the file from `start` in 1 MiB pread()s, calling first() after
    the first; returns (reads equal to `want`, wrong, EIO)."""
    ok = wrong = eio = 0
    for off in range(start, len(want), 1 << 20):
        if first and off > start:
            first()
            first = None
        try:
            got = os.pread(fd, 1 << 20, off)
        except OSError as e:
            assert e.errno == errno.EIO, e
            eio += 1
            continue
        if got == want[off:off + len(got)]:
            ok += 1
        else:
            wrong += 1
    return ok, wrong, eio


def test_a_source_rewritten_in_place_during_a_load_serves_no_byte_of_it(step, tmp_path, mount_factory):
    """The fetch of local sources pushes pages from pinned source files
    (SourceObject::Pin: a read lease, so a writer's open waits for the
    push). One of the step's files is inverted in place while the step is
    read, at a random moment in the first milliseconds of the fetch (the
    step is fetched in about ten): every byte a read
    returns, during the change or in a second pass after it (from the page
    cache, where pushed pages stay), is the step's as indexed; what cannot
    be answered with those bytes fails with EIO. Rounds on fresh copies and
    mounts. Without the lease (the pin's check then passes before a write
    that the push copies), this failed in each of two runs."""
    rng = random.Random(11)
    totals = [0, 0, 0]
    pinned = 0
    for rnd in range(12):
        copy = tmp_path / f"round{rnd}"
        shutil.copytree(step["dir"], copy)
        shards = sorted(f for f in os.listdir(copy) if f.endswith(".distcp"))
        victim = os.path.join(copy, shards[rnd % len(shards)])
        writer = threading.Thread(target=_invert_in_place, args=(victim, rng.uniform(0, 0.008)))
        with mount_factory(str(copy)) as m:
            path = m.p("consolidated", "model.safetensors")
            want, header = _expected_file(path, step["expected"])
            fd = os.open(path, os.O_RDONLY)
            try:
                first = _pass_over(fd, want, header, writer.start)
                writer.join(60)
                assert not writer.is_alive(), "the writer was held up"
                second = _pass_over(fd, want, header)
            finally:
                os.close(fd)
        totals = [t + a + b for t, a, b in zip(totals, first, second)]
        pinned += _counters(_final_log(m))["pinned"]
    ok, wrong, eio = totals
    assert wrong == 0, f"{wrong} reads returned bytes that are not the indexed ones ({ok} equal, {eio} EIO)"
    assert eio > 0, totals  # the change was seen
    assert pinned > 0  # by the pinned path too


def _source_files(step_dir: str) -> list[str]:
    return [os.path.join(step_dir, f) for f in sorted(os.listdir(step_dir)) if f.endswith(".distcp")]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "fetch-direct"])
def test_fetch_direct_reads_cold_sources_around_the_page_cache(direct, larger_step, mount_factory, ckptfs):
    """--fetch-direct: the planned ranges of cold sources are read with
    O_DIRECT (the log's count), exact (order_reader compares every tensor
    with torch.load's), and the sources' pages stay out of the page cache
    but for what the ordinary path read before the plan began. Without it,
    nothing is read with O_DIRECT and the sources are cached as they are
    read. Indexed first, then evicted: indexing reads each item's framing
    through the page cache, and the kernel's read-ahead around those reads
    caches much of each file, which would leave nothing to check. The step's
    files are several read-ahead windows each (~44 MiB against 8 MiB on the
    test machines), so that the window the ordinary path's reads may set
    going cannot pass for the sources' pages."""
    step = larger_step
    p = ckptfs("index", step["dir"], "-q")
    assert p.returncode == 0, p.stderr
    files = _source_files(step["dir"])
    for f in files:
        harness.evict(f)
    assert sum(harness.resident_bytes(f) for f in files) == 0, "eviction failed: the checks would mean nothing"
    args = ("--fetch-direct",) if direct else ()
    with mount_factory(step["dir"], *args) as m:
        _read_with("load_file", m.p("consolidated"), step["expected_path"])
    c = _counters(_final_log(m))
    _check_fetched(c, step["tensor_bytes"], "load_file")
    resident = sum(harness.resident_bytes(f) for f in files)
    if direct:
        assert c["direct"] >= 0.5 * step["tensor_bytes"], c
        assert c["pinned"] == 0, c  # read into the range's own buffer, not pinned
        assert _pushed(_final_log(m))[0] == 0, c
        assert c["direct"] <= c["ordered"], c
        # Left cached: what was read through the page cache (fetched -
        # direct: the ordinary path's reads, and the planned ranges' prefixes
        # the kernel had read ahead of them already), and per file at most
        # one read-ahead window besides, which those reads may have set
        # going while the plan read the same ranges with O_DIRECT.
        window = harness.read_ahead_bytes(files[0])
        bound = c["fetched"] - c["direct"] + len(files) * window
        assert bound < 0.5 * step["tensor_bytes"], (bound, c)  # else the check below means little
        assert resident <= bound, (resident, window, c)
    else:
        assert c["direct"] == 0, c
        assert resident >= 0.9 * step["tensor_bytes"], (resident, c)


@pytest.fixture(scope="module")
def s3_step(s3_server, step, ckptfs):
    upload_tree(s3_server["client"], step["dir"], "order/step-100/")
    return f"s3://{BUCKET}/order/step-100"


@pytest.mark.parametrize("mode", MODES)
def test_each_source_byte_fetched_once_from_s3(mode, step, s3_step, s3_env, mount_factory, ckptfs):
    # Indexed first, so that every GET of the mount is one of the reads.
    p = ckptfs("index", s3_step, "-q")
    assert p.returncode == 0, p.stderr
    with mount_factory(s3_step, "--part-size", "2MiB", "--max-threads", "4") as m:
        _read_with(mode, m.p("consolidated"), step["expected_path"])
    log = _final_log(m)
    c = _counters(log)
    _check_fetched(c, step["tensor_bytes"], mode)
    assert c["pinned"] == 0, c  # objects are fetched, never pinned
    assert _pushed(log)[0] == 0, c
    received = re.search(r"s3: (\d+) bytes received", log)
    assert received, log[-2000:]
    # What the server sent: the reads' bytes and at most the index's checks besides.
    assert int(received.group(1)) <= 1.05 * step["tensor_bytes"], (mode, received.group(0), c)


def test_indexing_over_s3_reads_each_gap_between_items_once(step, s3_step, s3_env, mount_factory):
    """A fresh index of the step over S3 reads the zip framing of its
    items (a torch.save archive each: records at both ends) in one ranged
    GET per gap between neighbouring items, not one per record: at most one
    GET per item, plus the metadata and sidecar reads. The items are
    counted by torch from the step's own .metadata."""
    import pickle
    with open(os.path.join(step["dir"], ".metadata"), "rb") as f:
        items = len(pickle.load(f).storage_data)
    files = len(os.listdir(step["dir"]))
    with mount_factory(s3_step, "--reindex") as m:
        assert "model.safetensors" in os.listdir(m.p("consolidated"))
    log = _final_log(m)
    gets = re.search(r"s3: (\d+) ranged GETs", log)
    assert gets, log[-2000:]
    assert int(gets.group(1)) <= items + 2 * files, (gets.group(0), items, files)


def test_sigusr1_reports_while_mounted(step, mount_factory):
    with mount_factory(step["dir"]) as m:
        _read_with("load_file", m.p("consolidated"), step["expected_path"])
        pid = harness.mount_daemon_pid(m.path)
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not COUNTERS.search(m.log()) and time.monotonic() < deadline:
            time.sleep(0.05)
        c = _counters(m.log())
        _check_fetched(c, step["tensor_bytes"], "SIGUSR1")


def _report(m, pid: int, n: int) -> dict:
    """Asks the daemon for its counters (SIGUSR1) and returns its n-th report."""
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while len(COUNTERS.findall(m.log())) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    found = COUNTERS.findall(m.log())
    assert len(found) == n, m.log()[-3000:]
    return _as_counters(found[-1])


def _drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert harness.resident_bytes(path) == 0, "the pages stayed: the check below would mean nothing"


def test_a_second_cold_load_through_the_same_mount_is_fetched_in_source_order_again(step, mount_factory):
    """The kernel does not tell the daemon when it drops a file's pages: a
    load after they were dropped (memory pressure, drop_caches; here fadvise
    DONTNEED on the virtual file) asks for every page again, and must be
    fetched once more, in source order, like the first; a warm load after
    it finds the pages in the page cache and fetches only those the kernel
    no longer holds, never the file again.

    The kernel may reclaim a few pages between two loads on its own (a
    machine running DAMON's proactive pageout, as the test machines do, can
    take a page soon after it was filled when its memory region looks
    cold), so the warm load is judged against the pages missing just before
    it, counted with mincore."""
    with mount_factory(step["dir"]) as m:
        pid = harness.mount_daemon_pid(m.path)
        folder = m.p("consolidated")
        path = os.path.join(folder, "model.safetensors")
        _read_with("load_file", folder, step["expected_path"])
        first = _report(m, pid, 1)
        _check_fetched(first, step["tensor_bytes"], "first load")
        _drop_pages(path)
        _read_with("load_file", folder, step["expected_path"])
        second = _report(m, pid, 2)
        again = {k: second[k] - first[k] for k in second}
        _check_fetched(again, step["tensor_bytes"], "second load, pages dropped")
        missing = os.path.getsize(path) - harness.resident_bytes(path)
        assert missing <= 0.05 * step["tensor_bytes"], ("the second load left the file out of the page cache", missing)
        _read_with("load_file", folder, step["expected_path"])
        warm = _report(m, pid, 3)
        # What was missing, plus a read-ahead window's worth of neighbours.
        assert warm["fetched"] - second["fetched"] <= missing + (256 << 10), (missing, second, warm)


def _expected_rank_piece(full: torch.Tensor, local_shape, rank: int, ranks: int) -> torch.Tensor:
    """The piece of `full` a rank of an even split holds, judged by shape alone."""
    if list(local_shape) == list(full.shape):
        return full
    for dim in range(full.dim()):
        if local_shape[dim] * ranks == full.shape[dim]:
            return full.chunk(ranks, dim=dim)[rank]
    raise AssertionError(f"{list(local_shape)} is no even split of {list(full.shape)}")


def test_eight_concurrent_rank_readers_within_the_bound(step, mount_factory):
    """8 threads each read a different mesh/tp8 rank file at once with a
    4 MiB bound (less than the files together): exact bytes, and the hold
    never above the bound."""
    from safetensors.torch import load
    bound_mib = 4
    with mount_factory(step["dir"], "--fetch-hold-mib", str(bound_mib)) as m:
        tp8 = m.p("mesh", "tp8")
        ranks = sorted(os.listdir(tp8))
        assert len(ranks) == 8, ranks
        got, errors = {}, []

        def read(rank_dir: str) -> None:
            try:
                data = b""
                for name in sorted(os.listdir(os.path.join(tp8, rank_dir))):
                    if name.endswith(".safetensors"):
                        with open(os.path.join(tp8, rank_dir, name), "rb", buffering=0) as f:
                            data = b"".join(iter(lambda: f.read(256 << 10), b""))
                got[rank_dir] = load(data)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append((rank_dir, repr(e)))

        threads = [threading.Thread(target=read, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert not errors, errors
    for k, rank_dir in enumerate(ranks):
        for name, t in got[rank_dir].items():
            want = _expected_rank_piece(step["expected"][name], t.shape, k, 8)
            assert torch.equal(t, want), (rank_dir, name)
    log = _final_log(m)
    peak, bound = map(int, HOLD.search(log).groups())
    assert bound == bound_mib << 20, log[-2000:]
    assert 0 < peak <= bound, (peak, bound)


def test_one_npy_reader_fetches_that_tensor_only(step, mount_factory):
    """A random reader of one tensors/*.npy starts no whole-file plan: it
    fetches about that tensor's bytes, not the step's."""
    name = "model.model.layers.1.mlp.down_proj.weight"
    full = step["expected"]["model.layers.1.mlp.down_proj.weight"].numpy()
    with mount_factory(step["dir"]) as m:
        path = m.p("tensors", name + ".npy")
        size = os.path.getsize(path)
        rng = random.Random(3)
        pages = list(range(0, size, 64 << 10))
        rng.shuffle(pages)
        data = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            for off in pages:
                f.seek(off)
                chunk = f.read(64 << 10)
                data[off:off + len(chunk)] = chunk
    import io
    np.testing.assert_array_equal(np.load(io.BytesIO(bytes(data))), full)
    c = _counters(_final_log(m))
    assert c["ordered"] == 0, c
    assert full.nbytes <= c["fetched"] <= 1.05 * full.nbytes, (c, full.nbytes)


def test_faults_on_the_way_leave_no_wrong_byte(step, s3_step, s3_env, s3_server, mount_factory, ckptfs):
    """The source-order fetch through a proxy that slows, resets and cuts
    short 10 % of the answers: every loader still gets the exact tensors
    (retried GETs), and what was fetched stays within 5 % of what was served."""
    from s3_fault_proxy import FaultProxy
    p = ckptfs("index", s3_step, "-q")
    assert p.returncode == 0, p.stderr
    proxy = FaultProxy(s3_server["port"], seed=9, p_slowdown=0.1, p_reset=0.1, p_truncate=0.1, ranged_only=True)
    try:
        with mount_factory(s3_step, "--endpoint-url", f"http://127.0.0.1:{proxy.port}", "--part-size", "1MiB",
                           "--max-threads", "4") as m:
            for mode in ("load_file", "safe_open_reverse"):
                _read_with(mode, m.p("consolidated"), step["expected_path"])
        faulted = sum(v for k, v in proxy.counts.items() if k != "passed")
    finally:
        proxy.close()
    assert faulted > 0, proxy.counts  # the faults happened
    c = _counters(_final_log(m))
    assert c["ordered"] >= 0.5 * step["tensor_bytes"], c
    # Two loaders, one after the other: the second finds in the kernel's
    # page cache what the first was served, unless the kernel dropped it
    # meanwhile; either way each byte served was fetched once.
    assert step["tensor_bytes"] <= c["fetched"] <= 1.05 * c["served"], c
