#!/usr/bin/env bash
# Runs one load-test workload against treeserve twice — prefix sharing on (the default preset)
# and off (configs/server/no-prefix-sharing.json) — each on a fresh server on a free loopback
# port, one after the other, and prints the two results side by side.
#
# usage: clients/compare_prefix_sharing.sh TREESERVE_BINARY [loadtest.py arguments...]
#   e.g. clients/compare_prefix_sharing.sh build-cli/bin/treeserve --workload multilevel --scale small
# environment:
#   LOADTEST           the load-test client: a treeserve_loadtest binary (the C++ port, same
#                      arguments and JSON; then PYTHON needs no grpcio), default loadtest.py
#   PYTHON             interpreter with python3-grpcio (default /usr/bin/python3, else python3)
#   SERVER_ARGS        extra arguments for both servers (default "--backend cpu"; on a GPU
#                      e.g. "--backend cuda --kv-cache-bytes 42949672960")
#   SHARING_CONFIG     server preset with sharing on (default: the binary's built-in defaults)
#   NO_SHARING_CONFIG  preset with sharing off (default configs/server/no-prefix-sharing.json)
#   READY_TIMEOUT      seconds to wait for each server to be ready (default 600)
#   OUT_DIR            where the JSON results and server logs go (default: a temp folder)
#   KEEP_GOING         1: a load test that fails (request errors) but wrote its JSON does not
#                      stop the other one; both are printed, then exit status 1
set -euo pipefail
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
bin=$(realpath "$1"); shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
py=${PYTHON:-/usr/bin/python3}
[[ -n "${PYTHON:-}" || -x "$py" ]] || py=python3
if [[ -n "${LOADTEST:-}" ]]; then
  [[ -x "$LOADTEST" ]] || { echo "error: LOADTEST=$LOADTEST is not an executable" >&2; exit 2; }
  loadtest=("$(realpath "$LOADTEST")")
else
  loadtest=("$py" "$here/loadtest.py")
fi
server_args=${SERVER_ARGS:---backend cpu}
sharing_config=${SHARING_CONFIG:-}
no_sharing_config=${NO_SHARING_CONFIG:-$root/configs/server/no-prefix-sharing.json}
ready_timeout=${READY_TIMEOUT:-600}
out=${OUT_DIR:-$(mktemp -d /tmp/treeserve-compare.XXXXXX)}
mkdir -p "$out"
[[ -x "$bin" ]] || { echo "error: $bin is not an executable treeserve binary" >&2; exit 2; }
[[ -f "$no_sharing_config" ]] || { echo "error: no preset $no_sharing_config" >&2; exit 2; }

pid=""
stop_server() {  # SIGTERM, then wait; a graceful shutdown exits 0
  [[ -n "$pid" ]] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  local rc=0
  wait "$pid" || rc=$?
  pid=""
  [[ $rc -eq 0 ]] || echo "warning: server exited with status $rc" >&2
}
trap stop_server EXIT

# run_one NAME CONFIG: start a server with CONFIG (empty = defaults), run the load test, stop.
run_one() {
  local name=$1 config=$2 port log
  shift 2
  port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  log="$out/server-$name.log"
  # shellcheck disable=SC2086  # SERVER_ARGS is a list of words
  "$bin" ${config:+--config "$config"} $server_args --listen "127.0.0.1:$port" >"$log" 2>&1 &
  pid=$!
  local waited=0
  until grep -q "ready" "$log"; do
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "error: server ($name) exited" >&2; exit 1; }
    (( waited++ < ready_timeout * 10 )) || { echo "error: server ($name) not ready" >&2; exit 1; }
    sleep 0.1
  done
  echo "== prefix sharing $name: server on 127.0.0.1:$port (log $log)"
  local rc=0
  rm -f "$out/$name.json"  # a stale file must not pass for this run's
  "${loadtest[@]}" --target "127.0.0.1:$port" --json "$out/$name.json" "$@" || rc=$?
  stop_server
  [[ $rc -eq 0 ]] && return 0
  echo "error: load test against the '$name' server failed ($rc)" >&2
  [[ "${KEEP_GOING:-}" == 1 && -f "$out/$name.json" ]] || exit 1
  failures=$((failures + 1))
}
failures=0

run_one on "$sharing_config" "$@"
run_one off "$no_sharing_config" "$@"

"$py" - "$out/on.json" "$out/off.json" <<'EOF'
import json, sys
on, off = (json.load(open(p)) for p in sys.argv[1:3])
def ms(x): return "-" if x is None else "%.1f ms" % (1000 * x)
rows = [
    ("throughput (gen tok/s)", lambda r: "%.1f" % r["throughput_tok_s"]),
    ("generated tokens", lambda r: str(r["generated_tokens"])),
    ("wall", lambda r: "%.2f s" % r["wall_s"]),
    ("TTFT p50", lambda r: ms(r["ttft_s"]["p50"])),
    ("TTFT p99", lambda r: ms(r["ttft_s"]["p99"])),
    ("ITL p50", lambda r: ms(r["itl_s"]["p50"])),
    ("ITL p99", lambda r: ms(r["itl_s"]["p99"])),
    ("request latency p50", lambda r: ms(r["request_latency_s"]["p50"])),
    ("KV pages in use peak", lambda r: str(r["kv_pages"]["max"])),
    ("KV pages in use mean", lambda r: "%.1f" % (r["kv_pages"]["mean"] or 0)),
    ("KV pages incl. cache peak", lambda r: str(r["kv_pages"]["peak_occupied"])),
    ("prompt / cached tokens", lambda r: "%d / %d" % (r["prompt_tokens"], r["cached_tokens"])),
    ("errors", lambda r: str(len(r["errors"]))),
]
print()
print("workload %s (scale %s), backend %s, model %s" % (
    on["workload"], on["scale"], on["server"]["backend"], on["server"]["model"]))
print("%-28s %18s %18s" % ("", "sharing on", "sharing off"))
for label, f in rows:
    print("%-28s %18s %18s" % (label, f(on), f(off)))
if off["throughput_tok_s"] > 0:
    print("%-28s %18s" % ("throughput on/off", "%.2fx" % (on["throughput_tok_s"] /
                                                          off["throughput_tok_s"])))
EOF
echo "results: $out/on.json $out/off.json"
[[ $failures -eq 0 ]]
