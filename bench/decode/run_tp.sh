#!/usr/bin/env bash
# Tensor-parallel GPU runs, from the repo root of a GPU machine:
#   bench/decode/run_tp.sh [tests|bench|e2e|all] [BUILD_DIR]     (default: all build-tp)
# tests: the TP GPU tests (TP=2, and TP=4 when 4 devices exist, against TP=1), the
#        sequence-parallel attention tests (2 and 4 GPUs against one) and the single-GPU
#        backend tests (N=1 shares the sharded weight loader);
# bench: bench_decode at TP=1, 2 and 4 (as many as there are devices), then the TP=2/TP=1
#        step ratio per workload (target: <= 0.65 for fewshot b=50), the few-shot steps at
#        TP=2 with NCCL all-reduces only (--nccl-all-reduce, the comparison for the default
#        peer-to-peer all-reduce), bench_sequence_parallel over 2 and 4 GPUs (both
#        combines), and one TREESERVE_PROFILE=1 run at TP=2 (per-phase GPU time, the
#        all-reduces included);
# e2e:   the tree-API e2e suite against `treeserve --backend cuda --tensor-parallel 2` on the
#        tiny model (needs the treeserve binary and its gRPC libraries; not part of all).
# Needs only the binaries and the tiny model of BUILD_DIR. Everything goes to
# $OUT (default ./tp-out): *.log, the benches' JSON, summary.txt.
# $TPS picks the bench's rank counts (default "1 2 4", those above the device count
# skipped) and $BENCH_ARGS adds bench_decode flags (e.g. "--workloads fewshot --steps 8"),
# to split the bench over several calls.
set -uo pipefail
stage=${1:-all}
B=${2:-build-tp}
OUT=${OUT:-tp-out}
mkdir -p "$OUT"
# NVLink multicast stays off (the backend also sets this before NCCL starts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TREESERVE_TINY_MODEL_DIR=${TREESERVE_TINY_MODEL_DIR:-$PWD/$B/tiny-llama}

# libnccl.so.2: the CUDA toolkit's, else the one in PyTorch's nvidia-nccl wheel.
if ldd "$B/bin/bench_decode" | grep -q 'libnccl.*not found'; then
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  export LD_LIBRARY_PATH=${nccl_dir}:${LD_LIBRARY_PATH:-}
  echo "libnccl from ${nccl_dir}" | tee -a "$OUT/summary.txt"
fi
gpus=$(nvidia-smi -L | wc -l)
{ nvidia-smi -L; nvidia-smi topo -m; } > "$OUT/devices.txt" 2>&1
echo "devices: $gpus" | tee -a "$OUT/summary.txt"

status=0
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  for t in tensor_parallel_gpu_tests sequence_parallel_gpu_tests cuda_backend_gpu_tests; do
    "$B/tests/gpu/$t" --gtest_output="json:$OUT/$t.json" > "$OUT/$t.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=$rc
    echo "$t: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$t.log" | tr '\n' ' ')" |
      tee -a "$OUT/summary.txt"
  done
fi

if [ "$stage" = e2e ]; then
  TREESERVE_E2E_BACKEND=cuda TREESERVE_E2E_TENSOR_PARALLEL=2 \
    TREESERVE_E2E_MODEL=$TREESERVE_TINY_MODEL_DIR TREESERVE_E2E_BINARY=$PWD/$B/bin/treeserve \
    "$B/tests/e2e/tree_api_e2e_test" > "$OUT/tree_api_e2e_tp2.log" 2>&1 || status=$?
  echo "tree_api_e2e_test at TP=2: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tree_api_e2e_tp2.log" | tr '\n' ' ')" |
    tee -a "$OUT/summary.txt"
fi

if [ "$stage" = bench ] || [ "$stage" = all ]; then
  for tp in ${TPS:-1 2 4}; do
    [ "$tp" -gt "$gpus" ] && continue
    # shellcheck disable=SC2086
    "$B/bin/bench_decode" --tensor-parallel "$tp" --json "$OUT/bench_tp$tp.json" \
      ${BENCH_ARGS:-} > "$OUT/bench_tp$tp.log" 2>&1 || status=$?
    cat "$OUT/bench_tp$tp.log"
  done
  if [ "$gpus" -ge 2 ] && [ -x "$B/bench/tree_attention/bench_sequence_parallel" ]; then
    # Sequence-parallel attention over 2 GPUs (and 4 where present), both combines.
    for w in 2 4; do
      [ "$w" -gt "$gpus" ] && continue
      "$B/bench/tree_attention/bench_sequence_parallel" --world $w --json "$OUT/sp_w$w.json" \
        > "$OUT/sp_w$w.log" 2>&1 || status=$?
      "$B/bench/tree_attention/bench_sequence_parallel" --world $w --nccl-combine \
        > "$OUT/sp_w${w}_nccl.log" 2>&1 || status=$?
      grep -E '^P=' "$OUT/sp_w$w.log" | sed "s/^/SP world $w: /" | tee -a "$OUT/summary.txt"
    done
  fi
  if [ "$gpus" -ge 2 ]; then
    # For comparison: the same few-shot steps with every all-reduce through NCCL.
    "$B/bin/bench_decode" --tensor-parallel 2 --workloads fewshot --nccl-all-reduce \
      > "$OUT/bench_tp2_nccl.log" 2>&1 || status=$?
    grep -E '^fewshot' "$OUT/bench_tp2_nccl.log" | sed 's/^/NCCL all-reduces: /' | tee -a "$OUT/summary.txt"
  fi
  if [ "$gpus" -ge 2 ] && [ -z "${NO_PROFILE:-}" ]; then
    TREESERVE_PROFILE=1 "$B/bin/bench_decode" --tensor-parallel 2 --workloads fewshot \
      --steps 8 > "$OUT/profile_tp2.log" 2>&1 || status=$?
  fi
  python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
runs = {}
for tp in (1, 2, 4):
    path = os.path.join(out, f"bench_tp{tp}.json")
    if os.path.exists(path):
        runs[tp] = {r["name"]: r for r in json.load(open(path))["results"]}
if 1 not in runs:
    sys.exit("no TP=1 bench result")
for tp in sorted(t for t in runs if t > 1):
    print(f"TP={tp} vs TP=1 (step ms; all-reduce share = 1 - no-comm step / step):")
    for name, one in runs[1].items():
        r = runs[tp].get(name)
        if r:
            print(f"  {name:36s} {one['step_ms']:8.3f} -> {r['step_ms']:8.3f}  "
                  f"ratio {r['step_ms'] / one['step_ms']:.3f}  "
                  f"all-reduce {100 * r.get('allreduce_share', 0):5.1f}%")
PY
fi
exit $status
