"""10^5 random range reads of an `s3://` mount through a proxy that injects
faults (503 SlowDown, resets, bodies cut short), while two of its three
copies of a checkpoint are overwritten: every read is exact or an EIO the
log explains. Against a real S3 server (SeaweedFS, tools/s3_server.py).

Also: ranged GETs answered with another range than the one asked.

A file of its own, apart from test_s3_mount.py (whose helpers it uses), so
that the side-by-side pass runs these tests (about two minutes on 2 cores)
beside the rest of that file rather than after them on the same worker.
"""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path

import pytest

from s3_server import BUCKET, upload_tree
from test_s3_mount import _reference_consolidated


def _explained_failures(log: str) -> dict:
    """Failed reads the log accounts for, by virtual path: a line is one; a
    line the log limiter ends with "(and N more like this in the last S s)"
    is 1 + N."""
    import collections

    out = collections.Counter()
    for line in log.splitlines():
        m = re.search(r"(\S+): read of \d+ bytes at \d+ failed \(Input/output error\)", line)
        if m:
            more = re.search(r"\(and (\d+) more like this in the last \d+ s\)$", line)
            out[m.group(1)] += 1 + (int(more.group(1)) if more else 0)
    return out


READS = 100_000


def test_1e5_random_range_reads_through_faults_and_an_overwrite_are_exact_or_explained_eio(
        s3_server, s3_env, main_ckpt, mount_factory):
    """10^5 random ranges of consolidated/ read with O_DIRECT (each one
    reaches the daemon) by 16 threads, through a proxy that answers 1 % of
    requests each with 503 SlowDown, a connection reset mid-body and a body
    cut short. Three copies of a checkpoint: `main/` is only read; in
    `other/` and `ignored/` a shard is overwritten (same size, every byte
    changed) by a thread of the test after 30 % of the reads; for
    `ignored/` the proxy plays a server that ignores If-Match (a 412 is
    answered with the new version's bytes and ETag). Every read gives the
    bytes of the version indexed (checked tensor by tensor against the
    saved tensors first) or fails with EIO; every EIO is accounted for in
    the log, with key, range and cause."""
    import itertools
    import random
    import threading

    from s3_fault_proxy import FaultProxy

    client = s3_server["client"]
    names = ("main", "other", "ignored")
    for name in names:
        upload_tree(client, main_ckpt["out_dir"], f"faults/{name}/")
    shard = next(k for k in sorted(os.listdir(main_ckpt["out_dir"])) if k.endswith(".safetensors"))
    with mount_factory(f"s3://{BUCKET}/faults") as clean:
        ref = _reference_consolidated(clean, "main", main_ckpt["expected"])
        for name in names[1:]:
            assert Path(clean.p(name, "consolidated", "model.safetensors")).read_bytes() == ref, name

    def unconditional(key: str, rng: str):
        if not key.startswith("faults/ignored/"):
            return None
        got = client.get_object(Bucket=BUCKET, Key=key, Range=rng)
        return got["ETag"], got["ContentRange"], got["Body"].read()

    proxy = FaultProxy(s3_server["port"], seed=23, p_slowdown=0.01, p_reset=0.01, p_truncate=0.01,
                       unconditional=unconditional)
    new_bytes = bytes(b ^ 0xFF for b in (Path(main_ckpt["out_dir"]) / shard).read_bytes())
    counter, lock = itertools.count(), threading.Lock()
    wrong, eio, reads = [], {name: 0 for name in names}, {name: 0 for name in names}
    overwritten = threading.Event()

    def overwrite() -> None:
        for name in names[1:]:
            client.put_object(Bucket=BUCKET, Key=f"faults/{name}/{shard}", Body=new_bytes)
        overwritten.set()

    t0 = time.monotonic()
    try:
        # No listing while mounted: the reads alone must see the change.
        with mount_factory(f"s3://{BUCKET}/faults", "--endpoint-url", f"http://127.0.0.1:{proxy.port}",
                           "--readahead-mib", "0", "--rescan-ms", "0") as m:
            fds = {name: os.open(m.p(name, "consolidated", "model.safetensors"), os.O_RDONLY | os.O_DIRECT)
                   for name in names}

            def worker(seed: int) -> None:
                rng = random.Random(seed)
                while (i := next(counter)) < READS:
                    if i == READS * 3 // 10:
                        threading.Thread(target=overwrite, daemon=True).start()
                    # Most reads go to main/: the overwritten copies read as
                    # EIO without a request once the change is seen.
                    name = rng.choices(names, weights=(8, 1, 1))[0]
                    off = rng.randrange(0, len(ref))
                    n = rng.choice([1, 7, 512, 4096, 65536])
                    try:
                        got = os.pread(fds[name], n, off)
                        ok = got == ref[off:off + n]
                    except OSError as e:
                        got, ok = e, e.errno == errno.EIO
                    with lock:
                        reads[name] += 1
                        if isinstance(got, OSError) and ok:
                            eio[name] += 1
                        elif not ok:
                            wrong.append((name, off, n, got if isinstance(got, OSError) else "other bytes"))

            threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert overwritten.wait(60)
            # The overwritten copies read as EIO from now on (the read of
            # the whole file touches the shard).
            for name in names[1:]:
                with pytest.raises(OSError) as e:
                    os.pread(fds[name], len(ref), 0)
                assert e.value.errno == errno.EIO, name
                eio[name] += 1
            for fd in fds.values():
                os.close(fd)
        seconds = time.monotonic() - t0
    finally:
        proxy.close()
    print(f"{READS} reads in {seconds:.0f} s: {reads}, EIO {eio}, proxy {proxy.counts}, "
          f"412s answered with the new version {proxy.ignored_if_match}")
    assert wrong == [], wrong[:5]
    assert sum(reads.values()) == READS
    for kind in ("slowdown", "reset", "truncate"):
        assert proxy.counts[kind] >= 100, proxy.counts
    assert proxy.ignored_if_match > 0, "the server ignoring If-Match was never asked"
    # The log: the daemon's last lines (the limiter's counts) come when it
    # exits, after the unmount.
    deadline = time.monotonic() + 20
    while True:
        log = Path(m.log_path).read_text(errors="replace")
        explained = _explained_failures(log)
        if all(explained[f"{name}/consolidated/model.safetensors"] >= eio[name] for name in names):
            break
        assert time.monotonic() < deadline, (eio, dict(explained), log[-3000:])
    for name in names[1:]:
        assert f"GET faults/{name}/{shard}" in log and "changed since indexing" in log, log[-3000:]
    assert "ignored If-Match" in log, log[-3000:]
    # Faults of main/ are retried: a read fails only after its retries ran
    # out, and then the log names the key, the range and the cause.
    for line in log.splitlines():
        if "main/consolidated/model.safetensors: read of" in line:
            assert re.search(r"GET faults/main/\S+ bytes \[\d+, \d+\).*after \d+ attempts", line), line


def test_a_ranged_get_answered_with_another_range_is_never_served(s3_server, s3_env, main_ckpt, mount_factory):
    """A gateway that answers 206 with another range of the same length
    (named honestly in Content-Range) for 30 % of ranged GETs: the client
    checks Content-Range against the range it asked, so every read is exact
    (the GET is asked again) or an EIO whose log line names the wrong range;
    never the other range's bytes."""
    import random

    from s3_fault_proxy import FaultProxy

    client = s3_server["client"]
    upload_tree(client, main_ckpt["out_dir"], "shift/ckpt/")
    with mount_factory(f"s3://{BUCKET}/shift") as clean:
        ref = _reference_consolidated(clean, "ckpt", main_ckpt["expected"])

    def fetch(key: str, rng: str):
        got = client.get_object(Bucket=BUCKET, Key=key, Range=rng)
        return got["ETag"], got["ContentRange"], got["Body"].read()

    proxy = FaultProxy(s3_server["port"], seed=7, p_slowdown=0, p_reset=0, p_truncate=0, p_shift=0.3,
                       ranged_only=True, fetch=fetch)
    rng = random.Random(11)
    exact, wrong, eio = 0, [], 0
    try:
        with mount_factory(f"s3://{BUCKET}/shift", "--endpoint-url", f"http://127.0.0.1:{proxy.port}",
                           "--readahead-mib", "0") as m:
            fd = os.open(m.p("ckpt", "consolidated", "model.safetensors"), os.O_RDONLY | os.O_DIRECT)
            for _ in range(300):
                off, n = rng.randrange(0, len(ref)), rng.choice([4096, 65536, 1 << 20])
                try:
                    got = os.pread(fd, n, off)
                except OSError as e:
                    assert e.errno == errno.EIO, e
                    eio += 1
                    continue
                if got == ref[off:off + n]:
                    exact += 1
                else:
                    wrong.append((off, n))
            os.close(fd)
    finally:
        proxy.close()
    print(f"300 reads: {exact} exact, {eio} EIO, {len(wrong)} wrong; proxy {proxy.counts}")
    assert wrong == [], wrong[:5]
    assert proxy.counts["shift"] >= 50, proxy.counts
    # Asked again, a GET gets its own range: 8 attempts at 30 % leave a
    # read failing about once in 10^4.
    assert exact >= 295, (exact, eio)
    log = Path(m.log_path).read_text(errors="replace")
    for line in log.splitlines():
        if "consolidated/model.safetensors: read of" in line:
            assert "wrong range (the server sent Content-Range 'bytes " in line, line
