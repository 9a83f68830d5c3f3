#!/usr/bin/env python3
"""How the kernel holds a file in its page cache: 4 KiB (order-0) folios or
large ones. Needs root (/proc/kpageflags and page frame numbers).

Maps the first --mib MiB of each file, touches every page (so they are
cached; cold pages are read in through the file's own path), and classifies
each page by its flags: part of a large folio (compound head or tail) or a
folio of its own. A FUSE file and the ext4 shard behind it tell whether the
warm gap of docs/BENCHMARKS.md is the kernel's folio size.

    python3 bench/page_cache_folios.py /mnt/ckpt/consolidated/model.safetensors shard.safetensors
"""
import argparse
import mmap
import os
import struct
import sys

PAGE = mmap.PAGESIZE
KPF_COMPOUND_HEAD = 1 << 15
KPF_COMPOUND_TAIL = 1 << 16
PFN_MASK = (1 << 55) - 1
PRESENT = 1 << 63


def mapping_start(path: str) -> int:
    real = os.path.realpath(path)
    starts = [int(line.split("-", 1)[0], 16) for line in open("/proc/self/maps")
              if line.rstrip("\n").endswith(" " + real)]
    if not starts:
        raise SystemExit(f"{path}: mapping not found in /proc/self/maps")
    return min(starts)


def classify(path: str, mib: int) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = min(os.fstat(fd).st_size, mib << 20) // PAGE
        if pages == 0:
            raise SystemExit(f"{path}: smaller than a page")
        m = mmap.mmap(fd, pages * PAGE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        sum(m[i * PAGE] for i in range(pages))  # fault every page in
        base = mapping_start(path) // PAGE
        counts = {"pages": pages, "order0": 0, "large_folio_heads": 0, "in_large_folios": 0, "not_present": 0}
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            for i in range(pages):
                pm.seek((base + i) * 8)
                entry = struct.unpack("<Q", pm.read(8))[0]
                if not entry & PRESENT:
                    counts["not_present"] += 1
                    continue
                kf.seek((entry & PFN_MASK) * 8)
                flags = struct.unpack("<Q", kf.read(8))[0]
                if flags & (KPF_COMPOUND_HEAD | KPF_COMPOUND_TAIL):
                    counts["in_large_folios"] += 1
                    counts["large_folio_heads"] += bool(flags & KPF_COMPOUND_HEAD)
                else:
                    counts["order0"] += 1
        return counts
    finally:
        m.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--mib", type=int, default=64, help="MiB of each file to look at (default 64)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root: page frame numbers are hidden from other users")
    print(f"kernel {os.uname().release}")
    for path in args.files:
        c = classify(path, args.mib)
        if c["not_present"] == c["pages"]:
            raise SystemExit(f"{path}: no page frame visible (run as root)")
        print(f"{path}: {c['pages']} pages: {c['order0']} in 4 KiB folios, {c['in_large_folios']} in "
              f"{c['large_folio_heads']} large folios, {c['not_present']} not present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
