#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test: the GoogleTest suites
# (ctest) and the end-to-end suites with real FUSE mounts and real torch,
# safetensors, numpy and transformers (pytest). Exit status non-zero on any
# failure. In CI (CI=true) nothing may skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh

if [ ! -e /dev/fuse ]; then
  echo "ckptfs tests: /dev/fuse is missing; the mount tests need it (modprobe fuse)" >&2
  exit 1
fi

printf '\n== unit tests (ctest)\n'
ctest --test-dir build --output-on-failure -j2

printf '\n== end-to-end tests (pytest)\n'
export CKPTFS_BIN="$PWD/build/ckptfs"
export BYTECHECKPOINT_SITE=${BYTECHECKPOINT_SITE:-$PWD/build/bcp-site}
python3 -m pytest tests/e2e -q -p no:cacheprovider -ra

# --- fuzzing -------------------------------------------------------------------
# Every libFuzzer target of tests/fuzz/ for a short bounded run (FUZZ_SECONDS
# each, default 20); clang is installed by tools/fuzz.sh when missing.
printf '\n== fuzzing (tools/fuzz.sh)\n'
bash tools/fuzz.sh
