"""Exact or an error, at random (issue 54): DCP steps written by stock torch
`dcp.save`, served by a fresh `mount s3://` (every item placed by
prediction, its framing read with its bytes) and by a local mount, read by
stock clients, every byte compared with torch's own `dcp.load` of the step.

A case is one step, made from its seed alone (`make_state`): 1 to 6
tensors of every dtype DCP saves, from 0-d to `max_mib` (over 64 MiB in the
long run), saved as they are: contiguous, transposed, permuted, sliced with
a storage offset, several views of one storage; a share of the steps
written through torch's ZStandard extension. Steps are batched under one
root per mount. Each step is read on the fresh S3 mount first by one
reader chosen at random (so each reader meets unsettled predictions):
`load_file` (mmap), `read()` of the whole file, `safe_open` in random order,
or random-range `pread`s; then by all of them, by `tensors/*.npy` and by
`consolidated.bf16/`; and the same on the local mount. A share of the S3
batches goes through the fault proxy (tools/s3_fault_proxy.py: resets,
short bodies, slow answers). A wrong byte fails the case and names its
seed; an error (EIO) where torch's loader reads the step is a failure too.

    python3 tests/e2e/exact_property.py --cases 1000 --seed 1   # the long run
    python3 tests/e2e/exact_property.py --cases 1 --seed 4711   # one case again

tests/e2e/test_exact_property.py runs a slice in CI.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load, load_file

_HERE = Path(__file__).resolve().parent
for p in (_HERE, _HERE.parent.parent / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import harness  # noqa: E402
from s3_server import BUCKET, upload_tree  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
NUMPY_NATIVE = {torch.float32, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint8, torch.bool}
VIEWS = ["plain", "plain", "transposed", "permuted", "offset_slice", "shared"]


def _random_tensor(rng: random.Random, g: torch.Generator, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    return (torch.randn(shape, generator=g) * rng.choice([0.01, 1.0, 100.0])).to(dtype)


def _shape(rng: random.Random, rank: int, elems: int) -> tuple:
    """A shape of `rank` dims whose product is about `elems`."""
    if rank == 0:
        return ()
    dims = [1] * rank
    left = max(1, elems)
    for i in range(rank - 1):
        dims[i] = max(1, int(round(left ** (1.0 / (rank - i)) * rng.uniform(0.5, 2.0))))
        left = max(1, left // dims[i])
    dims[-1] = left
    rng.shuffle(dims)
    return tuple(dims)


def make_state(seed: int, max_mib: float) -> tuple[dict, bool]:
    """The state dict of case `seed` (values, views and all) and whether it
    is saved through zstd."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(rng.randint(1, 6)):
        dtype = rng.choice(DTYPES)
        size = dtype.itemsize
        # Mostly small; some of a few MiB; now and then up to max_mib.
        mib = rng.choice([0.001, 0.01, 0.1, 0.5, 2, 6, max_mib if rng.random() < 0.3 else 3])
        elems = max(1, int(min(mib, max_mib) * (1 << 20) / size))
        view = rng.choice(VIEWS)
        rank = rng.choice([0, 1, 2, 2, 3]) if view == "plain" else (3 if view == "permuted" else 2)
        if rank == 0:
            elems = 1
        shape = _shape(rng, rank, elems)
        name = f"t{i}.{view}.{str(dtype).removeprefix('torch.')}"
        if view == "transposed":
            sd[name] = _random_tensor(rng, g, dtype, shape).t()
        elif view == "permuted":
            sd[name] = _random_tensor(rng, g, dtype, shape).permute(2, 0, 1)
        elif view == "offset_slice":
            skip = rng.randint(1, 3)
            sd[name] = _random_tensor(rng, g, dtype, (shape[0] + skip, shape[1]))[skip:]
        elif view == "shared":  # two views of one storage, saved as two items
            base = _random_tensor(rng, g, dtype, shape)
            sd[name] = base
            sd[name + ".also"] = base.t() if rng.random() < 0.5 else base[shape[0] // 2:]
        else:
            sd[name] = _random_tensor(rng, g, dtype, shape)
    return sd, rng.random() < 0.2


def save_step(seed: int, out: Path, max_mib: float) -> None:
    sd, zstd = make_state(seed, max_mib)
    extensions = None
    if zstd:
        from dcp_gen import ensure_zstd
        from torch.distributed.checkpoint._extension import ZStandard
        ensure_zstd()
        extensions = [ZStandard()]
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out), _extensions=extensions), no_dist=True)


def torch_loads(step: Path) -> dict:
    """The oracle: torch's own dcp.load of the step, into tensors of the
    shapes and dtypes its metadata names."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = dcp.FileSystemReader(str(step)).read_metadata()
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(step)), no_dist=True)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Tally:
    cases: int = 0
    tensors: int = 0
    bytes_compared: int = 0
    wrong: list = field(default_factory=list)  # (seed, where, what)

    def compare(self, seed: int, where: str, got: dict, expected: dict) -> None:
        if set(got) != set(expected):
            self.wrong.append((seed, where, f"names differ: {sorted(set(got) ^ set(expected))}"))
            return
        for k, e in expected.items():
            g = got[k]
            if g.dtype != e.dtype or tuple(g.shape) != tuple(e.shape):
                self.wrong.append((seed, where, f"{k}: {g.dtype}{tuple(g.shape)} vs {e.dtype}{tuple(e.shape)}"))
                continue
            n = int((_bytes(g) != _bytes(e)).sum())
            self.bytes_compared += e.numel() * e.element_size()
            if n:
                self.wrong.append((seed, where, f"{k}: {n} of {e.numel() * e.element_size()} bytes wrong"))


def _files(step_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(step_dir, "*.safetensors")))


def _load_file(d: str, rng: random.Random) -> dict:
    out = {}
    for f in _files(d):
        out.update({k: v.clone() for k, v in load_file(f).items()})  # clones: the mount must not stay busy
    return out


def _read(d: str, rng: random.Random) -> dict:
    out = {}
    for f in _files(d):
        with open(f, "rb") as fh:
            out.update(load(fh.read()))
    return out


def _safe_open(d: str, rng: random.Random) -> dict:
    out = {}
    for f in _files(d):
        with safe_open(f, framework="pt") as fh:
            keys = list(fh.keys())
            rng.shuffle(keys)
            out.update({k: fh.get_tensor(k) for k in keys})
    return out


def _ranges(d: str, rng: random.Random) -> dict:
    """Random-range preads of every byte (in a shuffled order of pieces of
    1 B to 3 MiB), put together and parsed by safetensors."""
    out = {}
    for f in _files(d):
        size = os.path.getsize(f)
        cuts = sorted({0, size, *(rng.randrange(size) for _ in range(rng.randint(1, 40)))})
        pieces = list(zip(cuts, cuts[1:]))
        rng.shuffle(pieces)
        buf = bytearray(size)
        fd = os.open(f, os.O_RDONLY)
        try:
            for b, e in pieces:
                for at in range(b, e, 3 << 20):
                    n = min(3 << 20, e - at)
                    got = os.pread(fd, n, at)
                    assert len(got) == n, (f, at, n, len(got))
                    buf[at:at + n] = got
        finally:
            os.close(fd)
        out.update(load(bytes(buf)))
    return out


READERS = {"load_file": _load_file, "read": _read, "safe_open": _safe_open, "ranges": _ranges}


def _npy(step_dir: str, expected: dict) -> dict:
    return {k: torch.from_numpy(np.load(os.path.join(step_dir, "tensors", k + ".npy"))) for k in expected}


def check_step(tally: Tally, seed: int, mnt_step: str, expected: dict, rng: random.Random, where: str) -> None:
    cons = os.path.join(mnt_step, "consolidated")
    first = rng.choice(sorted(READERS))
    for name in [first] + [r for r in sorted(READERS) if r != first]:
        try:
            tally.compare(seed, f"{where} {name}", READERS[name](cons, rng), expected)
        except Exception as e:  # an EIO where torch reads the step is a failure too
            tally.wrong.append((seed, f"{where} {name}", f"{type(e).__name__}: {e}"))
    # tensors/*.npy: numpy's own dtypes as saved, the others as float32.
    want = {k: (e if e.dtype in NUMPY_NATIVE else e.float()) for k, e in expected.items()}
    try:
        tally.compare(seed, f"{where} tensors/*.npy", _npy(mnt_step, expected), want)
    except Exception as e:
        tally.wrong.append((seed, f"{where} tensors/*.npy", f"{type(e).__name__}: {e}"))
    # consolidated.bf16/: floating tensors cast by torch, the others as saved.
    want = {k: (e.to(torch.bfloat16) if e.dtype.is_floating_point else e) for k, e in expected.items()}
    try:
        tally.compare(seed, f"{where} consolidated.bf16", _read(os.path.join(mnt_step, "consolidated.bf16"), rng),
                      want)
    except Exception as e:
        tally.wrong.append((seed, f"{where} consolidated.bf16", f"{type(e).__name__}: {e}"))


def run_batch(tally: Tally, seeds: list[int], work: Path, s3_client, s3_port: int, max_mib: float,
              faults: bool, batch_seed: int) -> None:
    """Saves the batch's steps under one root, uploads it, and reads every
    step through a fresh S3 mount (faulted if asked) and a local mount."""
    rng = random.Random(batch_seed)
    root = work / f"root-{batch_seed}"
    for s in seeds:
        save_step(s, root / f"step_{s}", max_mib)
    expected = {s: torch_loads(root / f"step_{s}") for s in seeds}
    prefix = f"prop-{batch_seed}-{int(time.time() * 1e6)}/"
    upload_tree(s3_client, str(root), prefix)
    proxy = None
    args = ["--index", str(work / f"index-s3-{batch_seed}"), "--part-size", rng.choice(["5MiB", "8MiB", "64MiB"])]
    if faults:
        from s3_fault_proxy import FaultProxy
        proxy = FaultProxy(s3_port, seed=batch_seed, p_slowdown=0.05, p_reset=0.05, p_truncate=0.05,
                           ranged_only=True)
        args += ["--endpoint-url", f"http://127.0.0.1:{proxy.port}"]
    try:
        with harness.Mounted(f"s3://{BUCKET}/{prefix.rstrip('/')}", *args, base_dir=str(work)) as m:
            for s in seeds:
                check_step(tally, s, m.p(f"step_{s}"), expected[s], rng, "s3" + (" faulted" if faults else ""))
    finally:
        if proxy is not None:
            proxy.close()
    with harness.Mounted(str(root), "--index", str(work / f"index-local-{batch_seed}"), base_dir=str(work)) as m:
        for s in seeds:
            check_step(tally, s, m.p(f"step_{s}"), expected[s], rng, "local")
    tally.cases += len(seeds)
    tally.tensors += sum(len(e) for e in expected.values())
    shutil.rmtree(root, ignore_errors=True)
    for key in [o["Key"] for o in s3_client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]:
        s3_client.delete_object(Bucket=BUCKET, Key=key)


def run(cases: int, seed: int, batch: int, max_mib: float, fault_share: float, work: Path, s3_client,
        s3_port: int, progress=print) -> Tally:
    tally = Tally()
    seeds = [seed + i for i in range(cases)]
    for n, at in enumerate(range(0, cases, batch)):
        faults = random.Random(seed * 7919 + n).random() < fault_share
        run_batch(tally, seeds[at:at + batch], work, s3_client, s3_port, max_mib, faults, seed * 100003 + n)
        progress(f"{tally.cases}/{cases} cases, {tally.tensors} tensors, {tally.bytes_compared} bytes compared, "
                 f"{len(tally.wrong)} wrong")
    return tally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1, help="case i's seed is SEED + i")
    ap.add_argument("--batch", type=int, default=20, help="steps per mount")
    ap.add_argument("--max-mib", type=float, default=80, help="largest tensor (over 64 MiB by default)")
    ap.add_argument("--fault-share", type=float, default=0.25, help="share of S3 batches through the fault proxy")
    a = ap.parse_args()
    import s3_server as s3
    work = Path(tempfile.mkdtemp(prefix="ckptfs-exact-"))
    # Room for a batch of the largest cases many times over: deleted
    # objects are reclaimed only when SeaweedFS vacuums a volume.
    (work / "seaweedfs").mkdir()
    server = s3.Server(work / "seaweedfs", volumes=64)
    os.environ.update(server.env())
    start = time.monotonic()
    try:
        t = run(a.cases, a.seed, a.batch, a.max_mib, a.fault_share, work, server.client, server.port)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"exact_property: {t.cases} cases (seeds {a.seed}..{a.seed + a.cases - 1}), {t.tensors} tensors, "
          f"{t.bytes_compared} bytes compared, {len(t.wrong)} wrong, in {time.monotonic() - start:.0f} s")
    for s, where, what in t.wrong[:50]:
        print(f"  seed {s}: {where}: {what}")
    return 1 if t.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
