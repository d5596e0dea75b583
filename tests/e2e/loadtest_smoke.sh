#!/usr/bin/env bash
# Smoke test of clients/loadtest.py: every workload at --scale small (with a time budget)
# against a live CPU treeserve; checks exit codes, the JSON results (sane figures, no errors,
# the pool back to idle), --plot (a PNG where matplotlib is installed, a clear error where it
# is not) and that the server stops on SIGTERM with exit 0. loadtest.py imports the treeserve
# package from clients/python, its stubs generated into $TREESERVE_PY_STUBS (a temp folder).
# usage: loadtest_smoke.sh TREESERVE_BINARY PYTHON3 SOURCE_DIR
# The DeFT templates come from SOURCE_DIR/bench/workloads; a workload that needs them, pointed
# at a folder without them, must fail with a clear message.
set -euo pipefail
bin=$1 py=$2 src=$3
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
export TREESERVE_PY_STUBS=$tmp/stubs
lt=("$py" "$src/clients/loadtest.py" --target "127.0.0.1:$port" --scale small --time-budget 5)

passed=0 failed=0 skipped=0
check() {  # check NAME JSON: the results file has sane fields
  "$py" "$src/tests/e2e/check_loadtest_result.py" "$2"
}

# Every workload of clients/loadtest_presets.json ("NAME NEEDS_DATA" lines, the file's order; on
# fd 3, so that nothing the loop runs can read them).
while read -r w needs <&3; do
  rc=0
  "${lt[@]}" --workload $w --workloads-dir "$workloads_dir" --json "$tmp/$w.json" \
    >"$tmp/$w.out" 2>&1 || rc=$?
  if [[ $rc -eq 0 ]] && check $w "$tmp/$w.json"; then
    passed=$((passed + 1))
  else
    echo "FAIL $w (exit $rc)"; cat "$tmp/$w.out"
    failed=$((failed + 1))
  fi
done 3< <("$py" -c 'import json, sys
for name, w in json.load(open(sys.argv[1]))["workloads"].items():
    print(name, int(w["needs_data"]))' "$src/clients/loadtest_presets.json")

# tot with the BFS run on the server (one TreeSearch call per problem).
rc=0
"${lt[@]}" --workload tot --server-side-search --workloads-dir "$workloads_dir" \
  --json "$tmp/tot-server.json" >"$tmp/tot-server.out" 2>&1 || rc=$?
if [[ $rc -eq 0 ]] && check tot "$tmp/tot-server.json"; then
  passed=$((passed + 1))
else
  echo "FAIL tot --server-side-search (exit $rc)"; cat "$tmp/tot-server.out"
  failed=$((failed + 1))
fi

# A workload that needs the templates, pointed at a folder without them: a clear error.
rc=0
"${lt[@]}" --workload tot --workloads-dir "$tmp/nowhere" >"$tmp/nowhere.out" 2>&1 || rc=$?
if [[ $rc -ne 0 ]] && grep -q "deft-templates" "$tmp/nowhere.out"; then
  passed=$((passed + 1))
else
  echo "FAIL tot without templates: expected a clear error (exit $rc)"; cat "$tmp/nowhere.out"
  failed=$((failed + 1))
fi

# --plot: with matplotlib, a PNG; without it (here its import is blocked by a stand-in
# package on PYTHONPATH), a clear error before any load runs.
if "$py" -c 'import matplotlib' 2>/dev/null; then
  rc=0
  "${lt[@]}" --workload fewshot --plot "$tmp/fewshot.png" >"$tmp/plot.out" 2>&1 || rc=$?
  is_png='import sys; sys.exit(open(sys.argv[1], "rb").read(8) != b"\x89PNG\r\n\x1a\n")'
  if [[ $rc -eq 0 ]] && "$py" -c "$is_png" "$tmp/fewshot.png" 2>/dev/null; then
    passed=$((passed + 1))
  else
    echo "FAIL --plot: expected a PNG (exit $rc)"; cat "$tmp/plot.out"; failed=$((failed + 1))
  fi
else
  echo "skip --plot PNG: $py has no matplotlib (Debian: apt-get install python3-matplotlib)"
  skipped=$((skipped + 1))
fi
mkdir -p "$tmp/no-matplotlib/matplotlib"
echo 'raise ImportError("blocked by the test")' >"$tmp/no-matplotlib/matplotlib/__init__.py"
rc=0
PYTHONPATH="$tmp/no-matplotlib${PYTHONPATH:+:$PYTHONPATH}" \
  "${lt[@]}" --workload fewshot --plot "$tmp/x.png" >"$tmp/noplot.out" 2>&1 || rc=$?
if [[ $rc -ne 0 ]] && grep -q "needs matplotlib" "$tmp/noplot.out" && [[ ! -e $tmp/x.png ]] &&
   ! grep -q "throughput" "$tmp/noplot.out"; then
  passed=$((passed + 1))
else
  echo "FAIL --plot without matplotlib: expected a clear error (exit $rc)"; cat "$tmp/noplot.out"
  failed=$((failed + 1))
fi

kill -TERM $pid
rc=0
wait $pid || rc=$?
if [[ $rc -eq 0 ]]; then
  passed=$((passed + 1)); echo "server exited cleanly"
else
  echo "FAIL server exit status $rc"; tail -n 20 "$log"; failed=$((failed + 1))
fi
echo "loadtest smoke: $passed passed, $failed failed, $skipped skipped"
[[ $failed -eq 0 ]]
