#!/usr/bin/env python3
"""Benchmark ckptfs on a generated sharded safetensors checkpoint.

Generates (numpy + safetensors, no torch) a checkpoint in the format of
torch's HuggingFaceStorageWriter(save_distributed=True): one
`shard-RRRRR-model-00001-of-00001.safetensors` per rank, each holding that
rank's chunks, placed by `saved_offsets` in `__metadata__.DCP_SHARDING_INFO`.
A Llama-like model: BF16 matrices split on dim 0 (q/k/v/gate/up/embed) or on
dim 1 (o_proj/down_proj: every row of the consolidated tensor is gathered
from all ranks), an F32 lm_head split on dim 0, F32 norms replicated (stored
by one rank, as torch does).

Then, in one run, it measures:
  - `ckptfs index` wall time (page cache dropped first, and again warm);
  - mount time: from starting `ckptfs mount -f` until the mountpoint answers
    (stat of consolidated/ entries succeeds);
  - `ckptfs export` of consolidated/ (the same read path, no FUSE);
  - sequential read throughput of every file in consolidated/ through the
    mount, cold (page cache dropped: source files and FUSE pages) and warm,
    next to the same bytes as real files written by `ckptfs export`;
  - the clients that load models, each next to the same bytes as real files
    (ckptfs export) in the same run, cold (best of --repeat, page cache
    dropped or the files evicted before each pass) and warm: sequential
    read(), safetensors `safe_open(...).get_tensor(k).clone()` of every
    tensor (page faults of a mapped file), `transformers.from_pretrained`;
    the tensors/ view of row-sharded vs column-sharded tensors; and a DCP
    checkpoint (.distcp, saved by torch over gloo ranks) the same way;
  - the mount daemon's peak RSS (VmHWM of the `ckptfs mount -f` process);
and checks that the virtual and exported files are identical (sha256) and
that every tensor in them equals what the generator wrote.

    python3 bench/bench_read.py [--dir DIR] [--size-gib 2.0] [--ranks 4] [--json]

Cold figures drop the page cache (`echo 3 > /proc/sys/vm/drop_caches`, root);
where that is refused (a container) every file involved (shards, exported
files, and the virtual files through the mount) is evicted with
posix_fadvise(DONTNEED) instead, and the run says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from common import (READ_CHUNK, REPO, Mounted, compare, drop_caches, ensure_checkpoint, file_digests,  # bench/common.py
                    files_under, from_pretrained_pass, fs_type, git_rev, machine, make_cold, proc_io, read_files,
                    read_pass, run_timed, safe_open_pass, verify_tensors, vm_field, write_hf_config)


def client_patterns(args, manifest: dict, ckpt: str, mnt: str, export: str, log) -> dict:
    """Sequential read(), safe_open, from_pretrained and the row/column
    tensors/ split, each virtual vs real, in the mounted checkpoint."""
    vdir = os.path.join(mnt, "consolidated")
    v_st = sorted(os.path.join(vdir, f) for f in os.listdir(vdir) if f.endswith(".safetensors"))
    r_st = sorted(os.path.join(export, os.path.basename(p)) for p in v_st)
    cold = v_st + r_st + files_under(ckpt)
    out = {"read": compare("sequential read()", lambda: read_pass(v_st), lambda: read_pass(r_st), cold,
                           args.repeat, log)}
    try:
        import torch  # noqa: F401
        out["safe_open"] = compare("safe_open + get_tensor", lambda: safe_open_pass(v_st),
                                   lambda: safe_open_pass(r_st), cold, args.repeat, log)
    except ImportError as e:
        out["safe_open"] = {"skipped": f"torch not importable: {e}"}
    if args.no_transformers:
        out["from_pretrained"] = {"skipped": "--no-transformers"}
    else:
        try:
            import transformers  # noqa: F401
            shutil.copy(os.path.join(vdir, "config.json"), os.path.join(export, "config.json"))
            from_pretrained_pass(export)  # untimed: the first call imports the model code (seconds)
            out["from_pretrained"] = compare("from_pretrained", lambda: from_pretrained_pass(vdir),
                                             lambda: from_pretrained_pass(export), cold, args.repeat, log)
        except ImportError as e:
            out["from_pretrained"] = {"skipped": f"transformers not importable: {e}"}
    # tensors/<fqn>.npy of row-sharded vs column-sharded BF16 matrices (virtual only).
    tdir = os.path.join(mnt, "tensors")
    rows = [os.path.join(tdir, f + ".npy") for f, (s, d, dim) in manifest["specs"].items()
            if d == "BF16" and dim == 0 and "embed" not in f]
    cols = [os.path.join(tdir, f + ".npy") for f, (s, d, dim) in manifest["specs"].items() if dim == 1]
    out["tensors_rows_vs_cols"] = compare("tensors/ columns vs rows (virtual)", lambda: read_pass(cols),
                                          lambda: read_pass(rows), cold + rows + cols, args.repeat, log)
    return out


def dcp_checkpoint(args, top: str, work: str, log) -> dict:
    """A DCP checkpoint saved by torch over gloo ranks (bench/bench_views.py's
    writer): consolidated/ read and safe_open'd, virtual vs exported."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_views
    from pathlib import Path
    ckpt = os.path.join(top, f"dcp-{args.dcp_layers}x{args.dcp_hidden}")
    if not os.path.exists(os.path.join(ckpt, ".metadata")):
        shutil.rmtree(ckpt, ignore_errors=True)
        log(f"  saving a DCP checkpoint with torch ({args.ranks} gloo ranks) in {ckpt}")
        secs = bench_views.write_checkpoint(Path(ckpt), args.ranks, args.dcp_layers, args.dcp_hidden)
        log(f"  saved in {secs:.1f} s")
    index, mnt, export = (os.path.join(work, "dcp-" + n) for n in ("index", "mnt", "export"))
    p = subprocess.run([args.bin, "export", ckpt, "consolidated", export, "--index", index],
                       capture_output=True)
    if p.returncode != 0:
        raise RuntimeError(f"ckptfs export (DCP) exited {p.returncode}: {p.stderr.decode()}")
    mount = Mounted(args.bin, ckpt, mnt, index, os.path.join(work, "dcp-mount.log"), args.mount_arg)
    out = {"dir": ckpt, "bytes": sum(os.path.getsize(f) for f in files_under(ckpt))}
    try:
        mount.start()
        vdir = os.path.join(mnt, "consolidated")
        v_st = sorted(os.path.join(vdir, f) for f in os.listdir(vdir) if f.endswith(".safetensors"))
        r_st = sorted(os.path.join(export, os.path.basename(f)) for f in v_st)
        cold = v_st + r_st + files_under(ckpt)
        out["read"] = compare("DCP sequential read()", lambda: read_pass(v_st), lambda: read_pass(r_st), cold,
                              args.repeat, log)
        out["safe_open"] = compare("DCP safe_open + get_tensor", lambda: safe_open_pass(v_st),
                                   lambda: safe_open_pass(r_st), cold, args.repeat, log)
        out["identical"] = file_digests(v_st) == file_digests(r_st)
        out["daemon_peak_rss_bytes"] = vm_field(mount.proc.pid, "VmHWM")
    finally:
        mount.stop()
    return out


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See docs/BENCHMARKS.md for how to read the figures.")
    ap.add_argument("--dir", help="work directory (the checkpoint is kept and reused there); "
                                  "default: a temporary directory, removed afterwards")
    ap.add_argument("--size-gib", type=float, default=2.0, help="tensor bytes to generate (default 2.0)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks (shard files) (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", os.path.join(REPO, "build", "ckptfs")),
                    help="ckptfs binary (default $CKPTFS_BIN or build/ckptfs)")
    ap.add_argument("--repeat", type=int, default=1, help="warm read passes; the best is reported")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the index and exported files")
    ap.add_argument("--mount-arg", action="append", default=[],
                    help="extra argument for `ckptfs mount` (repeatable), e.g. --mount-arg=--readahead-mib=0")
    ap.add_argument("--no-clients", action="store_true",
                    help="skip the safe_open / from_pretrained / tensors/ comparisons")
    ap.add_argument("--no-transformers", action="store_true", help="skip from_pretrained")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP checkpoint")
    ap.add_argument("--dcp-layers", type=int, default=12, help="layers of the DCP checkpoint (default 12)")
    ap.add_argument("--dcp-hidden", type=int, default=1024, help="hidden size of the DCP checkpoint (default 1024)")
    args = ap.parse_args(argv)

    def log(msg: str, end: str = "\n") -> None:
        print(msg, end=end, file=sys.stderr, flush=True)

    if not os.access(args.bin, os.X_OK):
        log(f"bench: no ckptfs binary at {args.bin} (build it, or pass --bin / set CKPTFS_BIN)")
        return 2

    # Ctrl-C and SIGTERM both unwind through the finally blocks below.
    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    own_dir = args.dir is None
    top = os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="ckptfs-bench-")
    ckpt = os.path.join(top, "checkpoint")
    work = os.path.join(top, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    index = os.path.join(work, "index")
    mnt = os.path.join(work, "mnt")
    export = os.path.join(work, "export")
    mount = Mounted(args.bin, ckpt, mnt, index, os.path.join(work, "mount.log"), args.mount_arg)
    version = subprocess.run([args.bin, "--version"], capture_output=True, text=True).stdout.strip()
    res: dict = {"machine": machine(), "ckptfs": {"bin": args.bin, "version": version, "repo_head": git_rev()},
                 "dir": top, "fs": fs_type(top), "notes": []}
    try:
        log(f"bench: checkpoint in {ckpt}")
        manifest = ensure_checkpoint(ckpt, args.size_gib, args.ranks, args.seed, log)
        write_hf_config(ckpt, manifest["dims"])
        shards = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
        shard_paths = [os.path.join(ckpt, f) for f in shards]
        res["checkpoint"] = {
            "tensor_bytes": manifest["tensor_bytes"], "tensors": manifest["tensors"],
            "ranks": manifest["ranks"], "dims": manifest["dims"],
            "files": len(shards), "file_bytes": sum(os.path.getsize(os.path.join(ckpt, f)) for f in shards)}

        cold_note = drop_caches()
        if cold_note:
            res["notes"].append(cold_note + ": for 'cold' figures the files involved were evicted with "
                                "posix_fadvise(DONTNEED) instead (index and mount times ran warm)")
        res["cold_cache"] = True
        res["cold_how"] = "drop_caches" if cold_note is None else "fadvise"

        # 1. index, cold then warm.
        secs, p = run_timed([args.bin, "index", ckpt, "--index", index, "-q"])
        if p.returncode != 0:
            raise RuntimeError(f"ckptfs index exited {p.returncode}: {p.stderr.decode()}")
        res["index_cold_s"] = secs
        secs, p = run_timed([args.bin, "index", ckpt, "--index", index, "-q"])
        res["index_warm_s"] = secs
        log(f"  index: {res['index_cold_s']:.3f} s cold, {res['index_warm_s']:.3f} s warm")

        # 2. export (the read path without FUSE) -> the real files to compare with.
        make_cold(shard_paths)
        secs, p = run_timed([args.bin, "export", ckpt, "consolidated", export, "--index", index])
        if p.returncode != 0:
            raise RuntimeError(f"ckptfs export exited {p.returncode}: {p.stderr.decode()}")
        exported = sorted(os.path.join(export, f) for f in os.listdir(export))
        res["export_s"] = secs
        res["consolidated_bytes"] = sum(os.path.getsize(p) for p in exported)
        res["export_MBps"] = res["consolidated_bytes"] / secs / 1e6
        log(f"  export: {secs:.2f} s ({res['export_MBps']:.0f} MB/s, cache dropped first)")

        # 3. cat > /dev/null: the read path (plan + pread + gather) without FUSE
        #    and without writing anything.
        names = [os.path.basename(p) for p in exported]
        cat = {}
        for label in ("cold", "warm"):
            if label == "cold":
                make_cold(shard_paths)
            t0 = time.monotonic()
            for name in names:
                p = subprocess.run([args.bin, "cat", ckpt, "consolidated/" + name, "--index", index],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                if p.returncode != 0:
                    raise RuntimeError(f"ckptfs cat exited {p.returncode}: {p.stderr.decode()}")
            cat[label + "_MBps"] = res["consolidated_bytes"] / (time.monotonic() - t0) / 1e6
        res["cat"] = cat
        log(f"  cat > /dev/null: {cat['cold_MBps']:.0f} MB/s cold, {cat['warm_MBps']:.0f} MB/s warm")

        # 4. mount.
        make_cold(shard_paths)
        mount.start()
        res["mount_s"] = mount.seconds
        log(f"  mount: {mount.seconds:.3f} s until the mountpoint answered")
        virtual = sorted(os.path.join(mnt, "consolidated", os.path.basename(p)) for p in exported)
        for v, e in zip(virtual, exported):
            if os.path.getsize(v) != os.path.getsize(e):
                raise RuntimeError(f"{v}: size {os.path.getsize(v)} != exported {os.path.getsize(e)}")

        # 5. reads: cold, then warm, virtual vs real.
        reads = {}
        for label, paths in (("virtual", virtual), ("exported", exported)):
            make_cold(virtual + exported + shard_paths)
            n, secs, _ = read_files(paths)
            cold = n / secs / 1e6
            passes = []
            rchar0 = proc_io(mount.proc.pid, "rchar")
            for _ in range(max(1, args.repeat)):
                n, secs, _ = read_files(paths)
                passes.append(n / secs / 1e6)
            warm = max(passes)
            reads[label] = {"bytes": n, "cold_MBps": cold, "warm_MBps": warm, "warm_passes_MBps": passes}
            if label == "virtual":
                # Bytes the daemon read from the shard files during the warm
                # passes: ~0 when the page cache served them (keep_cache).
                reads[label]["daemon_read_during_warm_bytes"] = proc_io(mount.proc.pid, "rchar") - rchar0
            log(f"  read {label}: {cold:.0f} MB/s cold, {warm:.0f} MB/s warm")
        res["read"] = reads
        if not args.no_clients:
            res["clients"] = client_patterns(args, manifest, ckpt, mnt, export, log)
        res["daemon_peak_rss_bytes"] = vm_field(mount.proc.pid, "VmHWM")
        res["daemon_rss_bytes"] = vm_field(mount.proc.pid, "VmRSS")

        res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]

        # 6. correctness: virtual == exported, and both == generated tensors.
        dv, de = file_digests(virtual), file_digests(exported)
        res["sha256_virtual"] = dv
        res["identical"] = dv == de
        bad = verify_tensors(export, manifest)
        res["tensors_verified"] = not bad
        if bad:
            res["notes"].append("tensor mismatches: " + "; ".join(bad[:5]))
        with open(mount.log_file) as f:
            errors = [l.strip() for l in f if l.strip()]
        if errors:
            res["notes"].append(f"mount log has {len(errors)} line(s), first: {errors[0]}")
        mount.stop()
        if not args.no_dcp:
            try:
                res["dcp"] = dcp_checkpoint(args, top, work, log)
            except ImportError as e:
                res["dcp"] = {"skipped": f"torch not importable: {e}"}
        res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except KeyboardInterrupt:
        log("\nbench: interrupted; cleaning up")
        mount.stop()
        return 130
    finally:
        mount.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        if own_dir and not args.keep:
            shutil.rmtree(top, ignore_errors=True)

    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(format_table(res, args))
    ok = res["identical"] and res["tensors_verified"] and res.get("dcp", {}).get("identical", True)
    return 0 if ok else 1


def format_table(r: dict, args) -> str:
    ck = r["checkpoint"]
    m = r["machine"]
    mb = lambda b: f"{b / 1e6:,.0f} MB"
    rss = r.get("daemon_peak_rss_bytes")
    lines = [
        f"ckptfs benchmark  ({r['ckptfs']['bin']}, repo at {r['ckptfs']['repo_head']})",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM, kernel {m['kernel']}; "
        f"load average {m['loadavg_start'][0]:.2f} at start, {m.get('loadavg_end', ['?'])[0]} at end",
        f"checkpoint: {ck['tensors']} tensors, {ck['tensor_bytes'] / 2**30:.2f} GiB in {ck['files']} shard files "
        f"({ck['ranks']} ranks; BF16 split on dim 0 and dim 1, F32 dim 0 and replicated), on {r['fs']}",
        f"consolidated/: {mb(r['consolidated_bytes'])}; cold runs: "
        f"{'page cache dropped' if r['cold_how'] == 'drop_caches' else 'files evicted with fadvise(DONTNEED)'}"
        f"; mount args: {' '.join(args.mount_arg) or '(defaults)'}",
        "",
        f"{'step':<44}{'time':>10}",
        f"{'ckptfs index (cold cache)':<44}{r['index_cold_s']:>9.3f}s",
        f"{'ckptfs index (warm)':<44}{r['index_warm_s']:>9.3f}s",
        f"{'ckptfs mount -f until the mountpoint answers':<44}{r['mount_s']:>9.3f}s",
        f"{'ckptfs export consolidated (cold cache)':<44}{r['export_s']:>9.2f}s"
        f"   ({r['export_MBps']:,.0f} MB/s, incl. writing the copy)",
        "",
        f"{'sequential read, ' + str(READ_CHUNK >> 20) + ' MiB read() calls':<44}{'cold':>11}{'warm':>11}",
        f"{'  consolidated/ via the FUSE mount':<44}{r['read']['virtual']['cold_MBps']:>6,.0f} MB/s"
        f"{r['read']['virtual']['warm_MBps']:>6,.0f} MB/s",
        f"{'  same bytes as real files (ckptfs export)':<44}{r['read']['exported']['cold_MBps']:>6,.0f} MB/s"
        f"{r['read']['exported']['warm_MBps']:>6,.0f} MB/s",
        f"{'  ckptfs cat > /dev/null (no FUSE)':<44}{r['cat']['cold_MBps']:>6,.0f} MB/s"
        f"{r['cat']['warm_MBps']:>6,.0f} MB/s",
        "",
        f"mount daemon peak RSS (VmHWM): {rss / 2**20:,.1f} MiB" if rss else "mount daemon peak RSS: unknown",
        f"bytes the daemon read from shard files during the warm passes: "
        f"{r['read']['virtual']['daemon_read_during_warm_bytes'] / 1e6:,.1f} MB (0 = served by the page cache)",
        f"virtual == exported (sha256): {'yes' if r['identical'] else 'NO'}; "
        f"every tensor == generated: {'yes' if r['tensors_verified'] else 'NO'}",
    ]
    lines += format_ratios(r)
    for n in r["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def format_ratios(r: dict) -> list[str]:
    """The virtual-vs-real comparisons: seconds and the ratio of speeds
    (bytes/s virtual / bytes/s real; the same bytes on both sides except for
    tensors/ rows vs columns)."""
    rows = []
    for key, label in (("read", "sequential 1 MiB read()"), ("safe_open", "safe_open + get_tensor().clone()"),
                       ("from_pretrained", "transformers from_pretrained"),
                       ("tensors_rows_vs_cols", "tensors/ column- vs row-sharded")):
        rows.append((label, r.get("clients", {}).get(key)))
    for key, label in (("read", "DCP: sequential 1 MiB read()"), ("safe_open", "DCP: safe_open + get_tensor")):
        rows.append((label, r.get("dcp", {}).get(key)))
    lines = ["", f"{'virtual vs real file (best s, ratio of speeds)':<40}{'cold':>24}{'warm':>24}"]
    for label, c in rows:
        if c is None:
            continue
        if "skipped" in c:
            lines.append(f"  {label:<38}skipped: {c['skipped']}")
            continue
        b = c["best"]
        lines.append(f"  {label:<38}{b['cold_v_s']:>7.2f} / {b['cold_r_s']:<6.2f}{c['cold_ratio']:>6.2f}x"
                     f"{b['warm_v_s']:>10.2f} / {b['warm_r_s']:<6.2f}{c['warm_ratio']:>6.2f}x")
    if "dcp" in r and "bytes" in r["dcp"]:
        lines.append(f"  (DCP checkpoint: {r['dcp']['bytes'] / 1e6:,.0f} MB of .distcp; "
                     f"virtual == exported: {'yes' if r['dcp'].get('identical') else 'NO'})")
    if "tensors_rows_vs_cols" in r.get("clients", {}):
        lines.append("  (tensors/ row: 'virtual' = column-sharded matrices, 'real' = row-sharded ones, both virtual)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
