#!/usr/bin/env bash
# The Python package (clients/python) installed the documented way, and its command line
# against a live treeserve that requires a bearer token:
#   python3 -m venv --system-site-packages V && V/bin/pip install --no-index \
#       --no-build-isolation ./clients/python
# run in a copy of the sources (clients/python and proto/ under one root, so the build leaves
# nothing in the checkout); then treeserve-cli info / generate -n 3 / tree / delete, the
# token from $TREESERVE_TOKEN, and the errors (unknown tree -> NOT_FOUND, wrong token ->
# UNAUTHENTICATED, both exit 1). Also: a build without the proto fails with a clear message,
# TREESERVE_PROTO points the build at it, the installed stubs were generated at build time
# (importing the package generates nothing), and the version is CMakeLists.txt's.
# usage: python_package_test.sh TREESERVE_BINARY PYTHON3 SOURCE_DIR
set -euo pipefail
bin=$1 py=$2 src=$3
tmp=$(mktemp -d)
pid=
trap '[[ -n "$pid" ]] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT
failed=0
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
show() { sed 's/^/    /' "$1"; }

for m in venv grpc grpc_tools setuptools; do
  "$py" -c "import $m" 2>/dev/null ||
    { echo "FAIL: $py cannot import $m (scripts/install-deps.sh installs it)"; exit 1; }
done

# Sources: the package and the proto, laid out as in the repository; and the package alone.
mkdir -p "$tmp/src/clients" "$tmp/alone"
for d in "$tmp/src/clients" "$tmp/alone"; do
  cp -r "$src/clients/python" "$d/"
  rm -rf "$d/python/build" "$d/python/"*.egg-info "$d/python/treeserve/__pycache__"
done
cp -r "$src/proto" "$tmp/src/"
venv=$tmp/venv
"$py" -m venv --system-site-packages "$venv"
pip=("$venv/bin/pip" install -q --no-index --no-build-isolation)
cd "$tmp"

# 1. No proto beside the package: the build stops with a message naming TREESERVE_PROTO.
rc=0
(cd "$tmp/alone" && env -u TREESERVE_PROTO "${pip[@]}" ./python) >"$tmp/noproto.out" 2>&1 || rc=$?
if [[ $rc -eq 0 ]] ||
   ! grep -q "treeserve.proto not found.*TREESERVE_PROTO" "$tmp/noproto.out"; then
  fail "build without the proto: expected a clear error (exit $rc)"; show "$tmp/noproto.out"
fi
# 2. TREESERVE_PROTO points the same build at it.
rc=0
(cd "$tmp/alone" && TREESERVE_PROTO=$tmp/src/proto/treeserve.proto "${pip[@]}" ./python) \
  >"$tmp/envproto.out" 2>&1 || rc=$?
[[ $rc -eq 0 ]] || { fail "build with TREESERVE_PROTO (exit $rc)"; show "$tmp/envproto.out"; }
# 3. The documented command, in the source layout (reinstalls over 2).
rc=0
(cd "$tmp/src" && env -u TREESERVE_PROTO "${pip[@]}" ./clients/python) >"$tmp/install.out" 2>&1 ||
  rc=$?
if [[ $rc -ne 0 ]]; then
  echo "FAIL: pip install ./clients/python (exit $rc)"; show "$tmp/install.out"; exit 1
fi
cli=$venv/bin/treeserve-cli
[[ -x $cli ]] || { echo "FAIL: no $cli after the install"; exit 1; }

# The stubs are in the installed package; importing it writes no cache.
export TREESERVE_PY_STUBS=$tmp/stub-cache
"$venv/bin/python" - "$venv" <<'EOF' || fail "installed package layout"
import os, sys
import treeserve, treeserve.treeserve_pb2 as pb2, treeserve.treeserve_pb2_grpc as pb2_grpc
pkg = os.path.dirname(treeserve.__file__)
assert pkg.startswith(os.path.realpath(sys.argv[1])), "treeserve imported from %s" % pkg
for m in (pb2, pb2_grpc):
    assert os.path.dirname(m.__file__) == pkg, "%s not in the package" % m.__file__
assert treeserve.pb is pb2 and hasattr(pb2_grpc, "TreeServeStub")
assert not os.path.exists(os.environ["TREESERVE_PY_STUBS"]), "stubs generated on import"
EOF
want=$(sed -n 's/^project(treeserve .*VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")
got=$("$cli" --version 2>&1 || true)
[[ "$got" == "treeserve-cli $want" ]] ||
  fail "version: '$got', CMakeLists.txt says '$want' (clients/python/treeserve/__init__.py)"

# The server, with a bearer token.
echo '{"server": {"auth_token": "e2e-token"}}' >"$tmp/auth.json"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
log=$tmp/server.log
"$bin" --backend cpu --config "$tmp/auth.json" --listen "127.0.0.1:$port" >"$log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
  grep -q "ready" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited early"; exit 1; }
  sleep 0.1
done
export TREESERVE_TOKEN=e2e-token
t=(--target "127.0.0.1:$port")

# info, through the console script and python -m.
rc=0
"$cli" "${t[@]}" info >"$tmp/info.out" 2>&1 || rc=$?
if [[ $rc -ne 0 ]] || ! grep -q "^backend: cpu$" "$tmp/info.out" ||
   ! grep -q "^kv_pages_total: [1-9]" "$tmp/info.out"; then
  fail "info (exit $rc)"; show "$tmp/info.out"
fi
rc=0
"$venv/bin/python" -m treeserve "${t[@]}" info >"$tmp/info-m.out" 2>&1 || rc=$?
[[ $rc -eq 0 ]] && grep -q "^model: " "$tmp/info-m.out" ||
  { fail "python -m treeserve info (exit $rc)"; show "$tmp/info-m.out"; }

# generate -n 3: three branches stream tokens, in tagged lines as they arrive.
rc=0
"$cli" "${t[@]}" generate "Q: name three prime numbers.
A:" -n 3 --max-tokens 8 --temperature 0.8 --seed 7 >"$tmp/gen.out" 2>"$tmp/gen.err" || rc=$?
read -r tags lines < <(sed -n 's/^\[\([^]]*\)\] .*/\1/p' "$tmp/gen.out" | sort | uniq -c |
                       awk '{n++; s+=$1} END {print n+0, s+0}')
counted=$(grep -cE "^branch [^ ]+: [1-9][0-9]* tokens, FINISH_" "$tmp/gen.out" || true)
if [[ $rc -ne 0 || $tags -ne 3 || $lines -le 3 || $counted -ne 3 ]]; then
  fail "generate -n 3: exit $rc, $tags branches tagged in $lines lines, $counted summaries"
  show "$tmp/gen.out"; show "$tmp/gen.err"
fi

# A kept tree: tree shows the root and its 2 live children; delete; then NOT_FOUND.
rc=0
"$cli" "${t[@]}" generate "Once upon a time" -n 2 --max-tokens 4 --keep-tree \
  >"$tmp/keep.out" 2>&1 || rc=$?
tree=$(sed -n 's/^kept tree \([^ ]*\) .*/\1/p' "$tmp/keep.out")
if [[ $rc -ne 0 || -z "$tree" ]]; then
  fail "generate --keep-tree (exit $rc)"; show "$tmp/keep.out"
else
  rc=0
  "$cli" "${t[@]}" tree "$tree" >"$tmp/tree.out" 2>&1 || rc=$?
  totals="^tree $tree: 3 branches (3 live), [1-9][0-9]* tokens, [1-9][0-9]* KV pages$"
  kids=$(grep -cE "^  [^ ]+  parent [^ ]+  length [1-9][0-9]*  live$" "$tmp/tree.out" || true)
  if [[ $rc -ne 0 || $kids -ne 2 ]] || ! grep -q "$totals" "$tmp/tree.out"; then
    fail "tree $tree (exit $rc)"; show "$tmp/tree.out"
  fi
  "$cli" "${t[@]}" delete "$tree" >"$tmp/delete.out" 2>&1 ||
    { fail "delete $tree"; show "$tmp/delete.out"; }
fi
for id in "${tree:-t0}" no-such-tree; do
  rc=0
  "$cli" "${t[@]}" tree "$id" >"$tmp/nf.out" 2>&1 || rc=$?
  [[ $rc -eq 1 ]] && grep -q "NOT_FOUND" "$tmp/nf.out" ||
    { fail "tree $id: expected exit 1 and NOT_FOUND (exit $rc)"; show "$tmp/nf.out"; }
done

# tokenize / detokenize round trip.
ids=$("$cli" "${t[@]}" tokenize "A tree of thoughts" 2>&1) || fail "tokenize: $ids"
text=$("$cli" "${t[@]}" detokenize $ids 2>&1) || fail "detokenize: $text"
[[ "$text" == "A tree of thoughts" ]] || fail "round trip: '$ids' -> '$text'"

# A wrong token, and a server that is not there.
rc=0
"$cli" "${t[@]}" --token wrong info >"$tmp/auth.out" 2>&1 || rc=$?
[[ $rc -eq 1 ]] && grep -q "UNAUTHENTICATED" "$tmp/auth.out" ||
  { fail "wrong token: expected exit 1 and UNAUTHENTICATED (exit $rc)"; show "$tmp/auth.out"; }
rc=0
"$cli" --target 127.0.0.1:1 info >"$tmp/down.out" 2>&1 || rc=$?
[[ $rc -eq 1 ]] && grep -q "UNAVAILABLE" "$tmp/down.out" ||
  { fail "no server: expected exit 1 and UNAVAILABLE (exit $rc)"; show "$tmp/down.out"; }

[[ ! -e $TREESERVE_PY_STUBS ]] || fail "the installed CLI generated stubs into $TREESERVE_PY_STUBS"

kill -TERM $pid
rc=0
wait $pid || rc=$?
pid=
[[ $rc -eq 0 ]] || { fail "server exit status $rc"; tail -n 20 "$log"; }
[[ $failed -eq 0 ]] && echo "python package: all checks passed"
[[ $failed -eq 0 ]]
