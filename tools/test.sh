#!/usr/bin/env bash
# Installs what is needed, builds, and runs the tests: the GoogleTest suites
# (ctest), the end-to-end suites with real FUSE mounts and real torch,
# safetensors, numpy and transformers (pytest), and the fuzzers. Exit status
# non-zero on any failure. In CI (CI=true) everything runs and nothing may
# skip.
#
#   bash tools/test.sh                # everything
#   bash tools/test.sh --quick        # the quick tier (under 5 minutes on 2 cores):
#                                     # ctest + the e2e files of conftest.QUICK, no fuzzing
#   bash tools/test.sh --no-setup     # skip tools/setup.sh (installs, pip install .):
#                                     # for a tree already set up; still runs ninja
#   bash tools/test.sh -- -k s3       # arguments after -- go to both pytest runs
#
# The e2e tests run in three passes: side by side on CKPTFS_TEST_JOBS
# pytest-xdist workers (default 3; each worker takes whole files, so a
# file's module fixtures, its S3 server say, are made once; the slowest
# first, conftest's SLOW_FIRST, so none starts last), then the tests
# marked `serial` alone, one after the other: those bound the daemon's RSS,
# a time or a thread count, or load the whole machine, so they must not
# share it with the side-by-side pass (tests/e2e/conftest.py lists them and
# why, in SERIAL); beside them, the serial tests that bound a time spent
# waiting on stalled servers (marked `waits` too, conftest's SERIAL_WAITING),
# beside each other on 2 workers: those sleep, loading nothing.
# The passes share the generated checkpoints ($CKPTFS_TEST_CKPTS). One test:
#   python3 -m pytest tests/e2e/test_mount.py -k consolidated -q -p no:cacheprovider
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0 setup=1 pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --no-setup) setup=0 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "tools/test.sh: unknown argument $1 (--quick, --no-setup, -- PYTEST_ARGS)" >&2; exit 2 ;;
  esac
  shift
done
if [ "${CI:-}" = true ] && [ $quick = 1 ]; then
  echo "tools/test.sh: CI runs everything; --quick is for developers" >&2
  exit 2
fi

if [ $setup = 1 ]; then
  bash tools/setup.sh
else
  ninja -C build
fi

if [ ! -e /dev/fuse ]; then
  echo "ckptfs tests: /dev/fuse is missing; the mount tests need it (modprobe fuse)" >&2
  exit 1
fi

# pytest exits 5 when it selected nothing: fine only when -- PYTEST_ARGS chose.
run_pytest() {
  local rc=0
  "$@" || rc=$?
  if [ $rc = 5 ] && [ ${#pytest_args[@]} -gt 0 ]; then echo "(no test of this pass selected)"; return 0; fi
  return $rc
}

start=$(date +%s)
printf '\n== unit tests (ctest)\n'
ctest --test-dir build --output-on-failure -j2

export CKPTFS_BIN="$PWD/build/ckptfs"
export BYTECHECKPOINT_SITE=${BYTECHECKPOINT_SITE:-$PWD/build/bcp-site}
jobs=${CKPTFS_TEST_JOBS:-3}
# The checkpoints every pass shares, generated once (conftest._generation).
if [ -z "${CKPTFS_TEST_CKPTS:-}" ]; then
  CKPTFS_TEST_CKPTS=$(mktemp -d /tmp/ckptfs-test-ckpts.XXXXXX)
  trap 'rm -rf "$CKPTFS_TEST_CKPTS"' EXIT
fi
export CKPTFS_TEST_CKPTS
pytest=(python3 -m pytest tests/e2e -q -p no:cacheprovider -ra)
if [ $quick = 1 ]; then
  printf '\n== end-to-end tests, quick tier (pytest --quick, %s workers)\n' "$jobs"
  run_pytest "${pytest[@]}" --quick -n "$jobs" --dist loadfile --no-loadscope-reorder -m "not serial" ${pytest_args[@]+"${pytest_args[@]}"}
  printf '\n== quick tier passed in %s s\n' $(( $(date +%s) - start ))
  exit 0
fi

printf '\n== end-to-end tests, side by side (pytest -m "not serial", %s workers)\n' "$jobs"
run_pytest "${pytest[@]}" -n "$jobs" --dist loadfile --no-loadscope-reorder -m "not serial" --durations=20 ${pytest_args[@]+"${pytest_args[@]}"}
# The tests that wait on stalls sleep through almost all of their time, so
# they run beside the serial pass, their output shown after it.
waits_log=$(mktemp /tmp/ckptfs-test-waits.XXXXXX)
run_pytest "${pytest[@]}" -m waits -n 2 --dist loadfile --durations=5 ${pytest_args[@]+"${pytest_args[@]}"} \
  >"$waits_log" 2>&1 &
waits_pid=$!
printf '\n== end-to-end tests that need the machine to themselves (pytest -m "serial and not waits")\n'
serial_rc=0
run_pytest "${pytest[@]}" -m "serial and not waits" --durations=10 ${pytest_args[@]+"${pytest_args[@]}"} || serial_rc=$?
waits_rc=0
wait $waits_pid || waits_rc=$?
printf '\n== end-to-end tests that wait on stalls, run beside the serial pass (pytest -m waits, 2 workers)\n'
cat "$waits_log"
rm -f "$waits_log"
if [ $serial_rc != 0 ] || [ $waits_rc != 0 ]; then exit 1; fi
printf '\n== tests passed in %s s (load average now %s)\n' $(( $(date +%s) - start )) "$(cut -d' ' -f1-3 /proc/loadavg)"

# --- fuzzing -------------------------------------------------------------------
# Every libFuzzer target of tests/fuzz/ for a short bounded run (FUZZ_SECONDS
# each, default 20); clang is installed by tools/fuzz.sh when missing.
printf '\n== fuzzing (tools/fuzz.sh)\n'
bash tools/fuzz.sh
