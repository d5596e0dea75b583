#!/usr/bin/env bash
# Smoke test of treeserve_loadtest (clients/cpp, the C++ port of clients/loadtest.py): every
# workload at --scale small (with a time budget) against a live CPU treeserve; checks exit codes,
# the JSON (requests done, tokens generated, no errors, sane TTFT/ITL/KV figures, the pool back
# to idle), the usage errors (exit 2 with a clear message), that both clients offer exactly the
# workloads of clients/loadtest_presets.json (the presets file they share), and — when this
# python3 has grpcio — that loadtest.py reads the same prompts for the same --seed (its run hits
# the radix cache the C++ run filled), runs with the same params and writes the same JSON keys.
# Stops the server with SIGTERM expecting exit 0.
# usage: loadtest_cpp_smoke.sh TREESERVE_BINARY TREESERVE_LOADTEST PYTHON3 SOURCE_DIR
# python3 needs only its standard library (free port, JSON checks). The DeFT templates come from
# SOURCE_DIR/bench/workloads.
set -euo pipefail
bin=$1 lt_bin=$2 py=$3 src=$4
workloads_dir=$src/bench/workloads
tmp=$(mktemp -d)
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
log=$tmp/server.log
"$bin" --backend cpu --listen "127.0.0.1:$port" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 1 300); do
  grep -q "ready" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited early"; exit 1; }
  sleep 0.1
done
lt=("$lt_bin" --target "127.0.0.1:$port" --scale small --time-budget 5)
presets=$src/clients/loadtest_presets.json

passed=0 failed=0 skipped=0
pass() { passed=$((passed + 1)); }
fail() { echo "FAIL $*"; failed=$((failed + 1)); }

check() {  # check JSON: the results file has sane fields
  "$py" "$src/tests/e2e/check_loadtest_result.py" "$1"
}

# expect_usage_error NAME PATTERN ARGS...: exit status 2 and PATTERN in the output.
expect_usage_error() {
  local name=$1 pattern=$2 rc=0
  shift 2
  "$@" >"$tmp/usage.out" 2>&1 || rc=$?
  if [[ $rc -eq 2 ]] && grep -q -- "$pattern" "$tmp/usage.out"; then
    pass
  else
    fail "$name: expected exit 2 and '$pattern', got $rc"; cat "$tmp/usage.out"
  fi
}

# Every workload of the presets file ("NAME NEEDS_DATA" lines, the file's order), and tot_server:
# tot as one server-side TreeSearch per problem (--server-side-search).
runs=()
while read -r w needs; do
  runs+=("$w $needs")
  [[ $w != tot ]] || runs+=("tot_server $needs")
done < <("$py" -c 'import json, sys
for name, w in json.load(open(sys.argv[1]))["workloads"].items():
    print(name, int(w["needs_data"]))' "$presets")
for run in "${runs[@]}"; do
  read -r w needs <<<"$run"
  args=(--workload "$w")
  [[ $w != tot_server ]] || args=(--workload tot --server-side-search)
  rc=0
  "${lt[@]}" "${args[@]}" --workloads-dir "$workloads_dir" --json "$tmp/$w.json" \
    >"$tmp/$w.out" 2>&1 || rc=$?
  if [[ $rc -eq 0 ]] && grep -q "throughput:" "$tmp/$w.out" && check "$tmp/$w.json"; then
    pass
  else
    fail "$w (exit $rc)"; cat "$tmp/$w.out"
  fi
done

# same_workloads NAME HELP_FILE: the --workload choices HELP_FILE lists are the presets file's
# workloads, no more and no fewer (a workload added to one client or to the file alone fails).
same_workloads() {
  if "$py" - "$presets" "$2" <<'EOF'; then
import json, re, sys
names = set(json.load(open(sys.argv[1]))["workloads"])
m = re.search(r"--workload (?:TEXT:)?\{([^}]*)\}", open(sys.argv[2]).read())
assert m, "no --workload choices in the --help output"
offered = set(m.group(1).split(","))
assert offered == names, "only in loadtest_presets.json: %s; only in the client: %s" % (
    sorted(names - offered), sorted(offered - names))
EOF
    pass
  else
    fail "$1 offers other workloads than clients/loadtest_presets.json"; cat "$2"
  fi
}
rc=0
"$lt_bin" --help >"$tmp/cpp-help.out" 2>&1 || rc=$?
[[ $rc -eq 0 ]] || fail "treeserve_loadtest --help (exit $rc)"
same_workloads treeserve_loadtest "$tmp/cpp-help.out"

# Usage errors: exit 2 with a message that says what is wrong, and no load run.
expect_usage_error "unknown workload" "workload" "${lt[@]}" --workload nosuch
expect_usage_error "--plot" "plot_loadtest.py" "${lt[@]}" --workload fewshot --plot "$tmp/x.png"
expect_usage_error "levels/fanout" "same count" "${lt[@]}" --workload multilevel --fanout 1,2
expect_usage_error "no templates" "deft-templates" \
  "${lt[@]}" --workload tot --workloads-dir "$tmp/nowhere"
expect_usage_error "no server" "cannot reach treeserve" \
  "$lt_bin" --target "127.0.0.1:1" --workload fewshot

# The same prompts as loadtest.py: with python3-grpcio, run the C++ client twice with one seed
# (the second run finds every prompt in the radix cache), then loadtest.py with that seed: it
# must find exactly as many cached tokens as the C++ rerun did (with other prompts it would
# miss at least every private question), run with the same params, and its JSON has no key
# the C++ one lacks. First, loadtest.py offers the presets file's workloads too.
if "$py" -c 'import grpc, grpc_tools' 2>/dev/null; then
  export TREESERVE_PY_STUBS=$tmp/stubs
  rc=0
  "$py" "$src/clients/loadtest.py" --help >"$tmp/py-help.out" 2>&1 || rc=$?
  [[ $rc -eq 0 ]] || fail "loadtest.py --help (exit $rc)"
  same_workloads loadtest.py "$tmp/py-help.out"
  for w in multidoc multilevel; do
    rc=0
    for _ in 1 2; do
      "${lt[@]}" --workload $w --seed 4242 --json "$tmp/cpp-$w.json" --quiet || rc=$?
    done
    "$py" "$src/clients/loadtest.py" --target "127.0.0.1:$port" --scale small --seed 4242 \
      --workload $w --json "$tmp/py-$w.json" --quiet || rc=$?
    if [[ $rc -eq 0 ]] && "$py" - "$tmp/cpp-$w.json" "$tmp/py-$w.json" <<'EOF'; then
import json, sys
c, p = (json.load(open(f)) for f in sys.argv[1:3])
missing = sorted(set(p) - set(c))
assert not missing, "keys only loadtest.py writes: %s" % missing
assert c["params"] == p["params"], ("params differ", c["params"], p["params"])
assert c["prompt_tokens"] == p["prompt_tokens"], (c["prompt_tokens"], p["prompt_tokens"])
assert p["cached_tokens"] == c["cached_tokens"], (
    "loadtest.py found %d cached tokens, the C++ rerun %d: the prompts differ" % (
        p["cached_tokens"], c["cached_tokens"]))
print("%s: loadtest.py after the C++ runs, same seed: cached %d of %d prompt tokens, as the "
      "C++ rerun" % (c["workload"], p["cached_tokens"], p["prompt_tokens"]))
EOF
      pass
    else
      fail "same prompts as loadtest.py ($w)"
    fi
  done
else
  echo "SKIP cross-check with loadtest.py: $py has no grpcio"
  skipped=$((skipped + 1))
fi

kill -TERM $pid
rc=0
wait $pid || rc=$?
if [[ $rc -eq 0 ]]; then
  pass; echo "server exited cleanly"
else
  fail "server exit status $rc"; tail -n 20 "$log"
fi
echo "loadtest C++ smoke: $passed passed, $failed failed, $skipped skipped"
[[ $failed -eq 0 ]]
