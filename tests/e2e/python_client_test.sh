#!/usr/bin/env bash
# Runs clients/example.py (the README's client example) against a live treeserve. It imports
# the treeserve package from the checkout (clients/python), whose stubs are generated into
# $TREESERVE_PY_STUBS (here a temp folder) on first use.
# usage: python_client_test.sh TREESERVE_BINARY PYTHON3 SOURCE_DIR
set -euo pipefail
bin=$1 py=$2 src=$3
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
tmp=$(mktemp -d)
log=$tmp/server.log
"$bin" --backend cpu --listen 127.0.0.1:$port >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 1 300); do
  grep -q "ready" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited early"; exit 1; }
  sleep 0.1
done
export TREESERVE_PY_STUBS=$tmp/stubs
"$py" "$src/clients/example.py" --target 127.0.0.1:$port
kill -TERM $pid
wait $pid
echo "server exited cleanly"
