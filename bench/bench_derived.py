#!/usr/bin/env python3
"""Figures for the derived views (dtype casts; LoRA merges where served).

Builds, once, under --dir: a Llama-shaped fp32 model of about --size-gb
(transformers save_pretrained: one HF folder) and a PEFT LoRA adapter of
rank 16 on every linear layer of it (peft save_pretrained, lora_B random so
the merge is not a no-op). Then, each on a fresh mount with the page cache
dropped before every timed pass (needs root):

1. Sequential read of `consolidated.bf16/` vs `consolidated/` of the same
   model (1 MiB read() calls, every safetensors file): seconds, and the
   ratio of speeds in output bytes per second and in seconds (goal: the
   bf16 view takes at most 1/0.7 the time of the plain one).
2. Loading a bf16 model: `from_pretrained(MNT/base/consolidated.bf16)` vs
   transformers loading the fp32 folder with dtype=bfloat16 (what an eval
   does without ckptfs).
3. The merge: `PeftModel.from_pretrained(base).merge_and_unload()` +
   `save_pretrained` + `from_pretrained` of what it saved, vs
   `from_pretrained(MNT/adapter/merged.bf16)` (goal <= 0.5x). When the mount
   serves no `merged.bf16/` (the mount log says why),
   the ckptfs side is reported as "not served", never timed on something
   else.
4. The daemon's peak RSS (VmHWM) over each mount.

    sudo python3 bench/bench_derived.py [--dir /tmp/ckptfs-bench-derived] [--size-gb 1.0] [--json]

The figures belong in docs/BENCHMARKS.md, measured on a quiet machine.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py: Mounted, drop_caches, read_files, vm_field)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BIN = os.path.join(ROOT, "build", "ckptfs")


def llama_config(size_gb: float, hidden: int, vocab: int):
    """A Llama config whose fp32 weights take about size_gb * 1e9 bytes."""
    from transformers import LlamaConfig
    inter = hidden * 11 // 4
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * inter)  # attention + MLP, fp32
    embed = 2 * 4 * vocab * hidden
    layers = max(1, round((size_gb * 1e9 - embed) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                       tie_word_embeddings=False)


def build(out: str, size_gb: float, hidden: int, vocab: int, log) -> tuple[str, str]:
    """(base folder, adapter folder) under `out`, made once."""
    import torch
    import peft
    from transformers import LlamaForCausalLM
    base, adapter = os.path.join(out, "base"), os.path.join(out, "adapter")
    if os.path.exists(os.path.join(adapter, "adapter_config.json")):
        return base, adapter
    log(f"building a ~{size_gb} GB fp32 Llama and an r=16 LoRA adapter under {out}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(size_gb, hidden, vocab)).float()
    model.save_pretrained(base)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    model.save_pretrained(adapter)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = "../base"  # relative: found inside the mounted root
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return base, adapter


def cold() -> None:
    why = common.drop_caches()
    if why:
        raise SystemExit(f"bench_derived needs root to drop the page cache between passes ({why})")


def safetensors_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


class Mount:
    """A fresh `ckptfs mount -f` of `root` (own index) for one measurement."""

    def __init__(self, binary: str, root: str, work: str, name: str, extra=()):
        self.m = common.Mounted(binary, root, os.path.join(work, "mnt-" + name), os.path.join(work, "index-" + name),
                               os.path.join(work, name + ".log"), list(extra))

    def __enter__(self):
        self.m.start(probe="base")
        return self

    def p(self, *rel: str) -> str:
        return os.path.join(self.m.mnt, *rel)

    def peak_rss(self) -> int | None:
        return common.vm_field(self.m.proc.pid, "VmHWM")

    def __exit__(self, *exc):
        self.m.stop()


def timed(fn):
    t0 = time.monotonic()
    out = fn()
    return time.monotonic() - t0, out


def sequential_reads(binary: str, root: str, work: str) -> dict:
    out = {}
    for view in ("consolidated", "consolidated.bf16"):
        with Mount(binary, root, work, "seq-" + view) as m:
            files = safetensors_files(m.p("base", view))
            cold()
            n, seconds, _ = common.read_files(files)
            out[view] = {"bytes": n, "seconds": seconds, "MBps": n / seconds / 1e6, "peak_rss": m.peak_rss()}
    plain, cast = out["consolidated"], out["consolidated.bf16"]
    out["time_ratio"] = cast["seconds"] / plain["seconds"]
    out["goal"] = "consolidated.bf16/ read in at most 1/0.7 of consolidated/'s time"
    return out


def load_bf16(binary: str, root: str, base: str, work: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    out = {}
    cold()
    out["transformers_cast_on_load_s"], model = timed(
        lambda: AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16))
    del model
    gc.collect()
    with Mount(binary, root, work, "load-bf16") as m:
        cold()
        out["ckptfs_consolidated_bf16_s"], model = timed(
            lambda: AutoModelForCausalLM.from_pretrained(m.p("base", "consolidated.bf16"), dtype="auto"))
        out["peak_rss"] = m.peak_rss()
    del model
    gc.collect()
    return out


def merge(binary: str, root: str, base: str, adapter: str, work: str) -> dict:
    import torch
    import peft
    from transformers import AutoModelForCausalLM
    out = {}
    saved = os.path.join(work, "merged-by-peft")

    def peft_path():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
        merged.to(torch.bfloat16).save_pretrained(saved)
        del model, merged
        gc.collect()
        return AutoModelForCausalLM.from_pretrained(saved, dtype="auto")

    cold()
    out["peft_merge_save_load_s"], model = timed(peft_path)
    del model
    shutil.rmtree(saved, ignore_errors=True)
    gc.collect()
    with Mount(binary, root, work, "merged") as m:
        view = m.p("adapter", "merged.bf16")
        if not os.path.isdir(view):
            out["ckptfs_merged_bf16_s"] = "not served (see the mount log: " + m.m.log_file + ")"
            return out
        cold()
        out["ckptfs_merged_bf16_s"], model = timed(lambda: AutoModelForCausalLM.from_pretrained(view, dtype="auto"))
        out["peak_rss"] = m.peak_rss()
        out["ratio"] = out["ckptfs_merged_bf16_s"] / out["peft_merge_save_load_s"]
        out["goal"] = "ratio <= 0.5"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-derived", help="where the model and adapter are built (kept)")
    ap.add_argument("--size-gb", type=float, default=1.0, help="fp32 size of the base model")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (smaller for a smoke run)")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    ap.add_argument("--bin", default=DEFAULT_BIN, help="the ckptfs binary")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr))
    os.makedirs(args.dir, exist_ok=True)
    base, adapter = build(args.dir, args.size_gb, args.hidden, args.vocab, log)
    work = tempfile.mkdtemp(prefix="bench-derived-")
    try:
        result = {"machine": common.machine(), "size_gb": args.size_gb}
        log("sequential reads: consolidated/ vs consolidated.bf16/")
        result["sequential"] = sequential_reads(args.bin, args.dir, work)
        log("loading bf16: transformers' cast on load vs consolidated.bf16/")
        result["load_bf16"] = load_bf16(args.bin, args.dir, base, work)
        log("merging: peft merge_and_unload + save + load vs merged.bf16/")
        result["merge"] = merge(args.bin, args.dir, base, adapter, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
