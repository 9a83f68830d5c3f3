#!/usr/bin/env bash
# Installs what is needed, builds, then runs the main job on a built-in demo:
# real torch writes a small Llama-style model as a sharded checkpoint (2 gloo
# ranks, torch's Hugging Face storage writer), ckptfs indexes and mounts it,
# and transformers loads MNT/consolidated/ and reproduces the logits.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec python3 tools/demo.py "$@"
