#!/usr/bin/env bash
# The proxies' configs, offline: HAProxy's (deploy/haproxy/haproxy.cfg) parses (`haproxy -c`,
# replica addresses on loopback) and its health check's frames are the gRPC request they claim
# to be (grpc_health_frames.py); nginx's (deploy/nginx/nginx.conf) passes `nginx -t` with its
# replica names rewritten to loopback (nginx resolves upstream names when it loads).
# Exits 77 (ctest: skipped) without haproxy or nginx, unless TREESERVE_REQUIRE_PROXY=1 (CI).
# usage: proxy_configs_test.sh SOURCE_DIR PYTHON3
set -euo pipefail
src=$1 py=$2
PATH=$PATH:/usr/sbin:/sbin
for tool in haproxy nginx; do
  if ! command -v $tool >/dev/null; then
    echo "proxy config test skipped: $tool is not installed (Debian: apt-get install $tool)"
    [ "${TREESERVE_REQUIRE_PROXY:-0}" = 1 ] && { echo "TREESERVE_REQUIRE_PROXY=1: a skip is a failure"; exit 1; }
    exit 77
  fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

TREESERVE_REPLICA_1=127.0.0.1:50061 TREESERVE_REPLICA_2=127.0.0.1:50062 \
  TREESERVE_REPLICA_3=127.0.0.1:50063 haproxy -c -q -f "$src/deploy/haproxy/haproxy.cfg"
echo "haproxy -c: OK ($(haproxy -v | head -n 1))"
"$py" "$src/tests/deploy/grpc_health_frames.py" "$src/deploy/haproxy/haproxy.cfg"

sed -E 's/\breplica-([0-9]+):50051\b/127.0.0.1:5006\1/' "$src/deploy/nginx/nginx.conf" \
  >"$tmp/nginx.conf"
grep -q "server 127.0.0.1:50061" "$tmp/nginx.conf" || { echo "nginx.conf: no replica-1:50051"; exit 1; }
nginx -t -q -p "$tmp" -c "$tmp/nginx.conf" -g "pid $tmp/nginx.pid;"
echo "nginx -t: OK ($(nginx -v 2>&1))"
