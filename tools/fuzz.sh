#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang (ASan + UBSan) into
# build-fuzz/ and runs each, one after the other, from its seed corpus
# (tests/fuzz/corpus/<target>/) for a bounded time. Exits non-zero when a
# target crashes, leaks, times out or runs out of memory; the input that did
# it is left in build-fuzz/artifacts/.
#
#   bash tools/fuzz.sh                          # every target, 20 s each
#   FUZZ_SECONDS=600 bash tools/fuzz.sh torch_zip_fuzz
#
# Environment: FUZZ_SECONDS (per target, default 20), FUZZ_BUILD_DIR (default
# build-fuzz). Inputs found during a run go to build-fuzz/corpus/<target>/,
# never into the committed seeds. Installs clang and libclang-rt-dev (Debian)
# when -fsanitize=fuzzer cannot link.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-20}
build=${FUZZ_BUILD_DIR:-build-fuzz}
targets=(pickle_fuzz safetensors_header_fuzz torch_zip_fuzz dcp_metadata_fuzz)
[ $# -eq 0 ] || targets=("$@")

log() { printf '\n== %s\n' "$*" >&2; }
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

# clang links libFuzzer from compiler-rt, a separate Debian package.
can_fuzz() {
  command -v clang++ >/dev/null &&
    printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' |
      clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o /dev/null 2>/dev/null
}
if ! can_fuzz; then
  log "installing clang and libclang-rt-dev (for -fsanitize=fuzzer)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang libclang-rt-dev >/dev/null
  can_fuzz || { echo "fuzz.sh: clang still cannot link -fsanitize=fuzzer" >&2; exit 1; }
fi

log "building ${targets[*]} into $build/"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DCKPTFS_FUZZ=ON -DCKPTFS_BUILD_TESTS=OFF >/dev/null
ninja -C "$build" "${targets[@]}"

failed=()
for t in "${targets[@]}"; do
  seeds="tests/fuzz/corpus/$t"
  [ -d "$seeds" ] || { echo "fuzz.sh: no seed corpus $seeds" >&2; exit 1; }
  mkdir -p "$build/corpus/$t" "$build/artifacts"
  log "$t: ${seconds} s from $seeds"
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb bounds memory
  # bombs below the machine's size. The first corpus directory receives new
  # inputs, the second (the seeds) is only read.
  if ! "$build/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$build/artifacts/$t-" "$build/corpus/$t" "$seeds" 2>"$build/$t.log"; then
    failed+=("$t")
    tail -n 40 "$build/$t.log" >&2
  fi
  grep -E '^stat::number_of_executed_units|^stat::peak_rss_mb' "$build/$t.log" | sed "s/^/$t /" >&2 || true
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: findings in ${failed[*]} (inputs in $build/artifacts/, logs in $build/<target>.log)" >&2
  exit 1
fi
log "fuzzing: no findings in ${targets[*]}"
