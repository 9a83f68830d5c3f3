#!/usr/bin/env bash
# GPU checks of the writer (not part of CI, which has no GPU): on a machine
# with a CUDA GPU, builds ckptfs with CUDA and NCCL, then
#   1. runs the collective conformance suite, which adds NCCL (world sizes
#      1..number of GPUs) to the thread group when a GPU is visible;
#   2. runs ckptfs_gpu_check: pinned D2H bandwidth, the CUDA stager's
#      throughput on a device buffer (bytes and CRC32C checked), the NCCL
#      collective at world size 1.
#
#   bash tools/gpu_test.sh [GIB]      # GIB: device buffer size (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_test.sh: no GPU visible (nvidia-smi -L failed)" >&2
  exit 1
fi
nvidia-smi -L
bash tools/setup.sh
grep -q "CKPTFS_HAVE_CUDA" build/build.ninja || { echo "gpu_test.sh: build/ has no CUDA (toolkit not found?)" >&2; exit 1; }
grep -q "CKPTFS_HAVE_NCCL" build/build.ninja || { echo "gpu_test.sh: build/ has no NCCL (headers not found?)" >&2; exit 1; }

printf '\n== collective conformance (threads + nccl)\n'
./build/writer/ckptfs_writer_tests --gtest_filter='All/CollectiveConformance.*'
./build/writer/ckptfs_writer_tests --gtest_list_tests --gtest_filter='*nccl*' | grep -q nccl \
  || { echo "gpu_test.sh: the NCCL collective was not tested" >&2; exit 1; }

printf '\n== stager with the CUDA engine\n'
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
./build/writer/ckptfs_gpu_check "$dir" "${1:-2}"
