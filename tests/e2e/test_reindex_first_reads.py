"""Fresh `--reindex` mounts of a root of several small checkpoints, read at
once from many threads, serve exactly the source's tensors every time.

The root holds what users mix in one folder: a GPT-2 saved with
`safetensors.torch.save_model` (its tied `transformer.wte.weight` dropped,
only `lm_head.weight` stored), two Hugging Face folders, a
`pytorch_model.bin`, a Lightning `.ckpt` and a DeepSpeed model-states file.
Each round mounts it anew with `--reindex` (a new index, a new daemon),
reads every `consolidated/model.safetensors` in parallel threads as the
first reads of the mount while transformers loads the GPT-2 from the mount,
then compares every tensor with the source read by safetensors or
torch.load, and the GPT-2's logits with the saved model's.

Run: CKPTFS_BIN=build/ckptfs python3 -m pytest tests/e2e/test_reindex_first_reads.py -q
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_model

import families_gen
from harness import Mounted

ROUNDS = 5
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])


@pytest.fixture(scope="module")
def mixed_root(tmp_path_factory):
    """The root and, per checkpoint directory, the tensors its source holds."""
    from transformers import GPT2Config, GPT2LMHeadModel
    root = tmp_path_factory.mktemp("mixed") / "root"
    want: dict[str, dict[str, torch.Tensor]] = {}
    torch.manual_seed(7)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()
    (root / "gpt2").mkdir(parents=True)
    gpt2.config.save_pretrained(root / "gpt2")
    save_model(gpt2, str(root / "gpt2" / "model.safetensors"))
    want["gpt2"] = load_file(str(root / "gpt2" / "model.safetensors"))
    with torch.no_grad():
        logits = gpt2(IDS).logits
    for name in ("llama", "qwen2"):
        _, model = families_gen.build(name)
        model.save_pretrained(root / "hf" / name)
        want[f"hf/{name}"] = load_file(str(root / "hf" / name / "model.safetensors"))
    config, gemma = families_gen.build("gemma")
    (root / "bin" / "gemma").mkdir(parents=True)
    config.save_pretrained(root / "bin" / "gemma")
    torch.save(gemma.state_dict(), root / "bin" / "gemma" / "pytorch_model.bin")
    want["bin/gemma"] = torch.load(root / "bin" / "gemma" / "pytorch_model.bin", weights_only=True)
    families_gen.write_lightning_and_deepspeed(str(root / "train"))
    want["train/lightning"] = torch.load(root / "train" / "lightning" / "last.ckpt", weights_only=False)["state_dict"]
    ds = "train/deepspeed/global_step10"
    want[ds] = torch.load(root / ds / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    return root, want, logits


def _first_reads(m: Mounted, dirs: list[str]) -> dict[str, bytes | BaseException]:
    got: dict[str, bytes | BaseException] = {}
    start = threading.Barrier(len(dirs))

    def read(d: str) -> None:
        start.wait()
        try:
            with open(m.p(d, "consolidated", "model.safetensors"), "rb") as f:
                got[d] = f.read()
        except BaseException as e:  # judged below
            got[d] = e
    threads = [threading.Thread(target=read, args=(d,)) for d in dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def _differences(served: bytes, want: dict[str, torch.Tensor]) -> list[str]:
    got = st_load(served)
    out = [f"{k}: missing" for k in want if k not in got and k != "lm_head.weight"]
    for k, t in want.items():
        if k in got and not torch.equal(got[k], t):
            out.append(f"{k}: other values")
    return out


def test_fresh_reindex_mounts_serve_the_sources_under_concurrent_first_reads(mixed_root, tmp_path):
    from transformers import GPT2LMHeadModel
    root, want, logits = mixed_root
    dirs = sorted(want)
    for r in range(ROUNDS):
        with Mounted(str(root), "--reindex", base_dir=str(tmp_path), index_dir=str(tmp_path / f"index{r}")) as m:
            loaded: dict = {}
            loader = threading.Thread(target=lambda: loaded.update(
                model=GPT2LMHeadModel.from_pretrained(m.p("gpt2", "consolidated")).eval()))
            loader.start()
            got = _first_reads(m, dirs)
            loader.join()
            for d in dirs:
                assert not isinstance(got[d], BaseException), (r, d, got[d])
                assert _differences(got[d], want[d]) == [], (r, d, _differences(got[d], want[d]))
            # save_model kept lm_head.weight alone; the view serves exactly that.
            assert sorted(st_load(got["gpt2"])) == sorted(want["gpt2"])
            model = loaded.pop("model")
            assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
            with torch.no_grad():
                assert torch.equal(model(IDS).logits, logits), f"round {r}: other logits than the saved model's"
            # Its weights map the mount's file: held, they would keep the
            # mount busy, and each round would end in seconds of unmount
            # retries and then a lazy unmount.
            del model
