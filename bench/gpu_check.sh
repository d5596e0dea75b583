#!/usr/bin/env bash
# One-GPU check and benchmark pass, from the repo root of a GPU machine:
#   bench/gpu_check.sh [tests|sanitize|e2e|bench|ncu|all] [BUILD_DIR]  (default: all build)
# tests: every GPU test binary (label gpu: kernels, backend vs CPU, graphs vs eager, sampling);
# sanitize: compute-sanitizer memcheck on the backend tests (graphs, forked trees, row
#        kernels, sliced argmax), the sampling tests and the attention tests of long runs,
#        graph grids, workload shapes and the decode kernel; racecheck on the attention's graph
#        and decode-kernel tests and on two sampling tests (clusters share shared memory);
# e2e:   the tree-API, tree-search and random-weights e2e suites against
#        `treeserve --backend cuda` on the tiny model, with CUDA graphs off and on;
# bench: bench_decode few-shot b=50 with CUDA graphs off and on (same binary, back to back),
#        then every workload with graphs on (JSON), bench_tree_attention (JSON), again with
#        --no-decode-kernel (the baseline's plans in stage 1), and its few-shot cases split
#        into the shared prompt alone and the branches alone;
# ncu:   per-kernel GPU times of one few-shot b=50 step (graphs on), summed per kernel.
# Needs BUILD_DIR's binaries (bin/, tests/gpu/, tests/e2e/, bench/tree_attention/), its tiny
# model (tiny-llama/) and lib/libtreeserve_spm.so; put the non-CUDA shared libraries the
# binaries need on LD_LIBRARY_PATH. Everything goes to $OUT (default ./gpu-out): *.log,
# *.json, summary.txt; with PACK=1 all of them packed into $OUT/gpu-check.tgz instead (one
# file to copy back from a remote machine).
set -uo pipefail
stage=${1:-all}
B=${2:-build}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export TREESERVE_TINY_MODEL_DIR=${TREESERVE_TINY_MODEL_DIR:-$PWD/$B/tiny-llama}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt" | tee -a "$OUT/summary.txt"
status=0
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

if [ "$stage" = tests ] || [ "$stage" = all ]; then
  for t in "$B"/tests/gpu/*_gpu_tests; do
    name=$(basename "$t")
    timeout 300 "$t" --gtest_output="json:$OUT/$name.json" > "$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=$rc
    note "$name: exit $rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$name.log" | tr '\n' ' ')"
  done
fi

if [ "$stage" = sanitize ] || [ "$stage" = all ]; then
  san() {  # name tool binary gtest-filter
    timeout 400 compute-sanitizer --tool "$2" --error-exitcode 99 "$B/tests/gpu/$3" \
      --gtest_filter="$4" > "$OUT/sanitize-$1.log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && status=$rc
    note "compute-sanitizer $2 $3 ($4): exit $rc $(grep -E 'ERROR SUMMARY' "$OUT/sanitize-$1.log" | tail -1)"
  }
  san backend memcheck cuda_backend_gpu_tests '*Graph*:*ForkedTree*:*ArgmaxOnly*:*SingleSequenceMatchesCpuFp16*'
  san sampling memcheck cuda_sampling_gpu_tests '*'
  san sampling-race racecheck cuda_sampling_gpu_tests 'DeviceSampling.Greedy*:DeviceSampling.Sampled*'
  san attention racecheck tree_attention_gpu_tests 'TreeAttentionGraph.*:*DecodeKernel*'
  san attention-mem memcheck tree_attention_gpu_tests \
    '*LongRuns*:TreeAttentionGraph.*:*Workload*:*DecodeKernel*'
fi

if [ "$stage" = e2e ] || [ "$stage" = all ]; then
  for graphs in 0 1; do
    for t in tree_api_e2e_test tree_search_e2e_test random_weights_e2e_test; do
      log="$OUT/$t.graphs$graphs.log"
      TREESERVE_E2E_BACKEND=cuda TREESERVE_E2E_BINARY=$PWD/$B/bin/treeserve \
        TREESERVE_E2E_MODEL=$TREESERVE_TINY_MODEL_DIR TREESERVE_E2E_CUDA_GRAPHS=$graphs \
        timeout 300 "$B/tests/e2e/$t" > "$log" 2>&1
      rc=$?
      [ $rc -ne 0 ] && status=$rc
      note "$t (cuda graphs $graphs): exit $rc $(grep -E '^\[  (PASSED|FAILED) ' "$log" | tr '\n' ' ')"
    done
  done
fi

decode=("$B/bin/bench_decode" --config configs/models/llama-3-8b.json)
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  for graphs in --no-graphs --graphs; do
    timeout 300 "${decode[@]}" --workloads fewshot --fewshot-branches 50 --steps 16 $graphs \
      > "$OUT/decode-b50$graphs.txt" 2>&1
    note "bench_decode b=50 $graphs: exit $? $(grep -E '^fewshot' "$OUT/decode-b50$graphs.txt")"
  done
  timeout 400 "${decode[@]}" --graphs --json "$OUT/decode.json" > "$OUT/decode.txt" 2>&1
  note "bench_decode (all workloads, graphs): exit $?"
  tail -16 "$OUT/decode.txt" | tee -a "$OUT/summary.txt"
  timeout 300 "$B/bench/tree_attention/bench_tree_attention" --json "$OUT/tree_attention.json" \
    > "$OUT/tree_attention.txt" 2>&1
  note "bench_tree_attention: exit $?"
  timeout 300 "$B/bench/tree_attention/bench_tree_attention" --no-decode-kernel \
    > "$OUT/tree_attention-no-decode-kernel.txt" 2>&1
  note "bench_tree_attention --no-decode-kernel: exit $?"
  # Few-shot b=50 and P=16000 apart: the shared prompt alone (one-token branches) and the
  # branches alone (a 16-token prompt).
  timeout 200 "$B/bench/tree_attention/bench_tree_attention" --few-shot 4000,50,1 \
    --few-shot 16,50,200 --few-shot 16000,64,1 --few-shot 16,64,200 \
    > "$OUT/tree_attention_parts.txt" 2>&1
  note "bench_tree_attention parts: exit $? $(grep -E '32/8' "$OUT/tree_attention_parts.txt" |
    awk '{printf "%s %s %s us; ", $2, $4, $11}')"
fi

if [ "$stage" = ncu ] || [ "$stage" = all ]; then
  timeout 300 ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv "${decode[@]}" --workloads fewshot \
    --fewshot-branches 50 --steps 2 --graphs --profile-last-step > "$OUT/ncu_step.csv" \
    2> "$OUT/ncu_step.err"
  note "ncu step: exit $?"
  python3 - "$OUT/ncu_step.csv" <<'PY' | tee -a "$OUT/summary.txt"
import collections, csv, re, sys
rows = list(csv.reader(open(sys.argv[1])))
header = None
kernels = collections.OrderedDict()
for r in rows:
    if r and r[0] == "ID":
        header = r
        continue
    if header and len(r) == len(header):
        d = dict(zip(header, r))
        v = float(d["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
        kernels[d["ID"]] = (d["Kernel Name"], v * scale.get(d["Metric Unit"], 1.0))
items = list(kernels.values())
# One profiled step per run of bench_decode (tree attention, then the baseline, then the
# tree again with GEMM tuning off): each starts with its embedding kernel; anything before the
# first is shown on its own.
starts = [i for i, (name, _) in enumerate(items) if "embed" in name]
bounds = ([0] if not starts or starts[0] > 0 else []) + starts + [len(items)]
names = ["tree", "baseline", "tree, GEMM tuning off"]
labels = (["before the first step"] if not starts or starts[0] > 0 else []) + \
    [names[k] if k < len(names) else f"step {k + 1}" for k in range(len(starts))]
for part, lo, hi in zip(labels, bounds, bounds[1:]):
    sub = items[lo:hi]
    agg = collections.OrderedDict()
    for name, us in sub:
        name = re.sub(r"\(.*", "", name).replace("void ", "")[:70]
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += us
    print(f"== {part}: {len(sub)} kernels, {sum(u for _, u in sub) / 1000:.3f} ms")
    for name, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {n:4d} {us / 1000:8.3f} ms {us / n:9.2f} us  {name}")
PY
fi
note "overall status: $status"
if [ "${PACK:-0}" = 1 ]; then
  tar czf /tmp/gpu-check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu-check.tgz "$OUT/"
fi
exit $status
