#!/usr/bin/env bash
# Installs what is needed, builds, then runs the main job on a built-in demo:
# a small Llama trains on 2 gloo ranks and saves a checkpoint every few steps
# (torch.distributed.checkpoint through ckptfs.torch.StorageWriter) into a root that ckptfs has mounted live,
# and straight to a local S3 server (StorageWriter("s3://...")) under a live
# `ckptfs mount s3://`; an eval loop loads each new step from
# MNT/step_N/consolidated/ with transformers as soon as it appears and checks
# the logits bit for bit; the same step in bf16 (cast on read), and the step
# from the S3 mount once its upload commits.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec python3 tools/demo.py "$@"
