#!/usr/bin/env bash
# Serving load tests on a GPU machine: every workload at full scale, each against a fresh CUDA
# server with prefix sharing on and then off (clients/compare_prefix_sharing.sh driving the C++
# client treeserve_loadtest, so no gRPC for Python is needed). All JSON results, server logs,
# each comparison's printout and a markdown summary table (summary.md) go to OUT_DIR.
#
# usage: bench/serving/run_gpu.sh BIN_DIR MODEL_DIR OUT_DIR
#   BIN_DIR    holds treeserve and treeserve_loadtest (e.g. build-cuda/bin)
#   MODEL_DIR  a checkpoint, or a shape-only dir (config.json + tokenizer.model, no
#              *.safetensors), which is served with --random-weights $RANDOM_WEIGHTS_SEED
# environment:
#   SERVER_ARGS    arguments for both servers (default "--backend cuda --model MODEL_DIR", plus
#                  "--random-weights SEED" for a shape-only MODEL_DIR)
#   BASE_CONFIG    preset both servers start from (default configs/server/gpu-h100.json); the
#                  script writes copies with prefix sharing on / off (kv_cache.prefix_sharing
#                  and engine.attention tree / baseline; no metrics listener) to OUT_DIR/configs/
#   RANDOM_WEIGHTS_SEED  default 1
#   WORKLOADS      default "fewshot tot tot_server speculative multilevel multidoc multichain
#                  multifewshot"; tot_server is tot with --server-side-search (one TreeSearch
#                  per problem instead of client-driven Branch/Generate/Prune)
#   LOADTEST_ARGS  extra treeserve_loadtest arguments for every run (e.g. "--time-budget 600")
#   ARGS_<workload>  extra arguments for one workload, replacing the defaults below (e.g.
#                  ARGS_multilevel="--warmup 16"); defaults: --warmup 8 for multilevel,
#                  multidoc, multifewshot; --warmup 4 for multichain
#   WORKLOADS_DIR  folder holding deft-templates/ (default bench/workloads)
#   READY_TIMEOUT  seconds to wait for each server (default 900: loading an 8B model)
#   SCALE          full (default) or small: a dry run on a CPU box is
#                  SCALE=small SERVER_ARGS="--backend cpu" BASE_CONFIG=configs/server/default.json
# Calls with the same OUT_DIR add up (summary.md covers every workload run into it), so a long
# list can be split over several calls with WORKLOADS.
# Exit status: 0 when every comparison of this call ran without request errors, else 1.
set -euo pipefail
if [[ $# -ne 3 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
bin_dir=$(realpath "$1") model_dir=$(realpath "$2") out=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out/configs"
out=$(realpath "$out")
for b in treeserve treeserve_loadtest; do
  [[ -x "$bin_dir/$b" ]] || { echo "error: no executable $bin_dir/$b" >&2; exit 2; }
done
[[ -f "$model_dir/config.json" ]] || { echo "error: $model_dir has no config.json" >&2; exit 2; }
py=$(command -v python3 || true)
[[ -n "$py" ]] || { echo "error: python3 (standard library only) is needed" >&2; exit 2; }

if [[ -z "${SERVER_ARGS:-}" ]]; then
  SERVER_ARGS="--backend cuda --model $model_dir"
  if ! compgen -G "$model_dir/*.safetensors" >/dev/null; then
    SERVER_ARGS+=" --random-weights ${RANDOM_WEIGHTS_SEED:-1}"
  fi
fi
base_config=${BASE_CONFIG:-$root/configs/server/gpu-h100.json}
scale=${SCALE:-full}
workloads=${WORKLOADS:-fewshot tot tot_server speculative multilevel multidoc multichain multifewshot}
workloads_dir=${WORKLOADS_DIR:-$root/bench/workloads}

# The two presets differ in prefix sharing only: off is kv_cache.prefix_sharing false (no
# radix reuse across trees) and engine.attention baseline (each branch reads its whole path).
for sharing in true false; do
  "$py" - "$base_config" "$sharing" "$out/configs/sharing-$sharing.json" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg.setdefault("kv_cache", {})["prefix_sharing"] = sys.argv[2] == "true"
cfg.setdefault("engine", {})["attention"] = "tree" if sys.argv[2] == "true" else "baseline"
cfg.setdefault("server", {})["metrics_listen"] = ""  # two servers in a row: no fixed port
json.dump(cfg, open(sys.argv[3], "w"), indent=1)
EOF
done

device=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1 ||
  true)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "device: ${device:-unknown (no nvidia-smi)}"
  echo "server args: $SERVER_ARGS"
  echo "base config: $base_config"
  echo "loadtest args: ${LOADTEST_ARGS:-}"
} >"$out/run.txt"
cat "$out/run.txt"

failed=0
touch "$out/status.txt"  # calls sharing OUT_DIR add up; a rerun of a workload replaces it
for w in $workloads; do
  if [[ $w == tot* || $w == speculative ]] && [[ ! -d $workloads_dir/deft-templates ]]; then
    echo "SKIP $w: no $workloads_dir/deft-templates (set WORKLOADS_DIR)"
    echo "$w skipped" >>"$out/status.txt"
    continue
  fi
  var=ARGS_$w
  case $w in
    multilevel | multidoc | multifewshot) default_args="--warmup 8" ;;
    multichain) default_args="--warmup 4" ;;
    *) default_args="" ;;
  esac
  extra=${!var-$default_args}
  workload=$w
  [[ $w != tot_server ]] || { workload=tot extra="--server-side-search $extra"; }
  mkdir -p "$out/$w"
  echo "== $w ($scale scale) $extra ${LOADTEST_ARGS:-}"
  rc=0
  # shellcheck disable=SC2086  # word lists
  LOADTEST="$bin_dir/treeserve_loadtest" OUT_DIR="$out/$w" KEEP_GOING=1 PYTHON="$py" \
    SERVER_ARGS="$SERVER_ARGS" SHARING_CONFIG="$out/configs/sharing-true.json" \
    NO_SHARING_CONFIG="$out/configs/sharing-false.json" READY_TIMEOUT="${READY_TIMEOUT:-900}" \
    "$root/clients/compare_prefix_sharing.sh" "$bin_dir/treeserve" --workload "$workload" \
    --scale "$scale" --workloads-dir "$workloads_dir" --quiet $extra ${LOADTEST_ARGS:-} \
    2>&1 | tee "$out/$w/compare.txt" || rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "$w ok" >>"$out/status.txt"
  else
    echo "$w failed ($rc)" >>"$out/status.txt"
    failed=1
  fi
done

"$py" - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(w, name):
    p = os.path.join(out, w, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
def ms(s): return "-" if s is None or s.get("p50") is None else "%.1f" % (1000 * s["p50"])
def on_off(on, off, f):
    return "%s / %s" % (f(on) if on else "-", f(off) if off else "-")
status = dict(l.split(" ", 1) for l in open(os.path.join(out, "status.txt")).read().split("\n") if l)
scale = next((r["scale"] for w in status for r in (load(w, "on"), load(w, "off")) if r), "?")
lines = ["# Serving load tests, %s scale: prefix sharing on / off" % scale, ""]
lines += ["    " + l for l in open(os.path.join(out, "run.txt")).read().splitlines()]
lines += ["", "| workload | throughput on / off (gen tok/s) | speedup | TTFT p50 on / off (ms) | "
          "ITL p50 on / off (ms) | request latency p50 on / off (ms) | KV pages peak on / off | "
          "cached / prompt tokens (on) | errors on / off |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for w, st in status.items():
    on, off = load(w, "on"), load(w, "off")
    if not on and not off:
        lines.append("| %s | %s | | | | | | | |" % (w, st))
        continue
    speed = ("%.2f×" % (on["throughput_tok_s"] / off["throughput_tok_s"])
             if on and off and off["throughput_tok_s"] > 0 else "-")
    lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        w, on_off(on, off, lambda r: "%.1f" % r["throughput_tok_s"]), speed,
        on_off(on, off, lambda r: ms(r["ttft_s"])), on_off(on, off, lambda r: ms(r["itl_s"])),
        on_off(on, off, lambda r: ms(r["request_latency_s"])),
        on_off(on, off, lambda r: str(r["kv_pages"]["max"])),
        "%d / %d" % (on["cached_tokens"], on["prompt_tokens"]) if on else "-",
        on_off(on, off, lambda r: str(len(r["errors"])))))
lines += ["", "Parameters: " + ", ".join(
    "%s: %s" % (w, " ".join("%s=%s" % kv for kv in sorted(load(w, "on")["params"].items())))
    for w in status if load(w, "on"))]
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
echo "results: $out (summary.md, <workload>/on.json, off.json, server-*.log, compare.txt)"
exit $failed
