#!/usr/bin/env bash
# Tokenizer throughput on one core: builds Llama 3's tokenizer.json from llama3-tokenizer-js's
# data (tests/tokenizer_ref/run.sh does the npm install; run it, or ctest -R
# tokenizer_reference, first) and runs bench_tokenizer over three corpora: prose (this
# repository's docs/ and README), code (its C++ sources) and the 12,000 test strings (mixed
# scripts, emoji, whitespace runs, special tokens).
# usage: bench/tokenizer/run.sh [BUILD_DIR] [Google Benchmark flags]
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$src/build}
shift || true
work=$build/tokenizer_ref
[ -f "$work/llama3/tokenizer.json" ] || {
  echo "no $work/llama3/tokenizer.json: run tests/tokenizer_ref/run.sh (ctest -R tokenizer_reference) first" >&2
  exit 1
}
cat "$src"/README.md "$src"/docs/*.md >"$work/prose.txt"
cat "$src"/models/*.cpp "$src"/scheduler/*.cpp "$src"/server/*.cpp >"$work/code.txt"
taskset -c 0 "$build/bench/tokenizer/bench_tokenizer" --tokenizer "$work/llama3/tokenizer.json" \
  --corpus "prose=$work/prose.txt" --corpus "code=$work/code.txt" \
  --corpus "mixed=$work/strings.jsonl" --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true "$@"
