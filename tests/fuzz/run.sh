#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/README.md) with clang in their own build dir (CPU
# only, ASan+UBSan) and runs each for a bounded time on its seed corpus. Fails on any crash,
# leak, sanitizer report, broken invariant or hang; the input that caused it is kept in
# <build>/fuzz-artifacts/<target>/ and the command to replay it is printed.
#
# usage: tests/fuzz/run.sh [--time SECONDS] [--jobs N] [--build-dir DIR] [--no-build] [TARGET...]
#   --time       seconds of fuzzing per target (default: $FUZZ_TIME, else 60)
#   --jobs       targets fuzzed at once (default: the number of cores)
#   --build-dir  default: build-fuzz
#   TARGET       fuzz_safetensors fuzz_model_config fuzz_server_config fuzz_tokenizer
#                fuzz_service (the default: these five), fuzz_tokenizer_json (README.md)
# The corpus each run grows is kept in <build>/fuzz-corpus/<target>/ and reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/../.."

time_s=${FUZZ_TIME:-60}
jobs=$(nproc)
build=build-fuzz
do_build=1
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time) time_s=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    fuzz_*) targets+=("$1"); shift ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
all=(fuzz_safetensors fuzz_model_config fuzz_server_config fuzz_tokenizer fuzz_service)
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")

if [ "$do_build" = 1 ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTREESERVE_FUZZ=ON \
    -DTREESERVE_CUDA=OFF -DTREESERVE_BUILD_BENCH=OFF -DTREESERVE_BUILD_CLIENTS=OFF >/dev/null
  cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"
fi

# Seeds: the committed corpus, the shipped configs for the config parsers, and fuzz_service's
# text sessions encoded to the binary Session it reads.
seeds_of() {
  local t=$1
  echo "tests/fuzz/corpus/$t"
  case "$t" in
    fuzz_server_config) echo configs/server ;;
    fuzz_model_config) echo configs/models ;;
  esac
}
encoded="$build/fuzz-seeds/fuzz_service"
rm -rf "$encoded" && mkdir -p "$encoded"
for f in tests/fuzz/corpus/fuzz_service/*.txtpb; do
  protoc --proto_path=. --encode=treeserve.fuzz.Session tests/fuzz/fuzz_service.proto \
    <"$f" >"$encoded/$(basename "$f" .txtpb)"
done

options_of() {
  case "$1" in
    fuzz_safetensors | fuzz_tokenizer_json) echo "-max_len=8192 -dict=tests/fuzz/json.dict" ;;
    fuzz_model_config | fuzz_server_config) echo "-max_len=4096 -dict=tests/fuzz/json.dict" ;;
    fuzz_tokenizer) echo "-max_len=256" ;;
    fuzz_service) echo "-max_len=4096" ;;
  esac
}

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
logs="$build/fuzz-logs"
mkdir -p "$logs"
run_one() {
  local t=$1 corpus="$build/fuzz-corpus/$1" artifacts="$build/fuzz-artifacts/$1"
  local seeds=()
  mapfile -t seeds < <(seeds_of "$t")
  [ "$t" = fuzz_service ] && seeds=("$encoded")
  mkdir -p "$corpus" "$artifacts"
  # shellcheck disable=SC2046  # options_of's words are separate flags
  "$build/fuzz/$t" -max_total_time="$time_s" -timeout=60 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" $(options_of "$t") \
    "$corpus" "${seeds[@]}" >"$logs/$t.log" 2>&1
}

touch "$logs/.start"
echo "fuzzing ${targets[*]} for ${time_s}s each, $jobs at a time (logs: $logs)"
failed=()
pids=()
names=()
wait_one() {
  local i=$1
  if wait "${pids[$i]}"; then
    echo "  ${names[$i]}: ok ($(grep -m1 -o 'Done [0-9]* runs' "$logs/${names[$i]}.log" || echo 'no summary'))"
  else
    failed+=("${names[$i]}")
    echo "  ${names[$i]}: FAILED"
  fi
}
for t in "${targets[@]}"; do
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait_one 0
    pids=("${pids[@]:1}")
    names=("${names[@]:1}")
  fi
  run_one "$t" &
  pids+=($!)
  names+=("$t")
done
for i in "${!pids[@]}"; do wait_one "$i"; done

if [ ${#failed[@]} -gt 0 ]; then
  for t in "${failed[@]}"; do
    echo "===== $t: last lines of $logs/$t.log"
    tail -n 60 "$logs/$t.log"
    find "$build/fuzz-artifacts/$t" -type f -newer "$logs/.start" |
      while read -r a; do echo "reproduce: $build/fuzz/$t $a"; done
  done
  echo "fuzzing FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzzing passed: ${targets[*]}"
