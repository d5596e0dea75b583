#!/usr/bin/env bash
# usage: run_memcheck.sh TEST_BINARY GTEST_FILTER
# ctest's memcheck tests (label gpu): compute-sanitizer's memcheck over a subset of a GPU test
# binary, failing on any error it reports or on a failing test. Without compute-sanitizer or
# without a CUDA device it says so and exits 77, which ctest reports as skipped.
set -u
bin=$1
filter=$2
sanitizer=$(command -v compute-sanitizer || true)
if [ -z "$sanitizer" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
fi
if [ -z "$sanitizer" ]; then
  echo "compute-sanitizer not found: memcheck skipped"
  exit 77
fi
if ! nvidia-smi -L > /dev/null 2>&1; then
  echo "no CUDA device: memcheck skipped"
  exit 77
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$sanitizer" --tool memcheck --error-exitcode 1 --print-limit 20 "$bin" \
  --gtest_filter="$filter" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# The tests skip themselves where the process sees no device (CUDA_VISIBLE_DEVICES=...).
if [ "$rc" = 0 ] && grep -q "GPU test skipped" "$log"; then
  echo "the tests saw no CUDA device: memcheck skipped"
  exit 77
fi
exit "$rc"
