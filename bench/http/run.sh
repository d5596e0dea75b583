#!/usr/bin/env bash
# HTTP overhead: starts treeserve on the tiny model (CPU backend) with gRPC and HTTP on free
# loopback ports and runs bench_http against both (docs/benchmarks.md, "HTTP API overhead").
# The figures land on stdout and, with --save, in bench/results/bench_http.txt under a line
# naming the device, the date and the commit.
# usage: bench/http/run.sh [BUILD_DIR] [--save] [bench_http flags]
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$src/build}
shift || true
save=0
if [ "${1:-}" = --save ]; then
  save=1
  shift
fi
for bin in treeserve bench_http; do
  [ -x "$build/bin/$bin" ] || { echo "no $build/bin/$bin: cmake --build $build --target $bin" >&2; exit 1; }
done
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
grpc_port=$(free_port)
http_port=$(free_port)
log=$(mktemp)
"$build/bin/treeserve" --backend cpu --listen 127.0.0.1:$grpc_port \
  --http-listen 127.0.0.1:$http_port >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 300); do
  grep -q " ready: " "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
header="device: $(nproc) cores, $cpu (CPU backend, tiny model); date: $(date -u +%Y-%m-%d); commit: $(git -C "$src" describe --always --dirty)"
out=$("$build/bin/bench_http" --grpc 127.0.0.1:$grpc_port --http 127.0.0.1:$http_port "$@")
printf '%s\n\n%s\n' "$header" "$out"
if [ $save = 1 ]; then
  printf '%s\n\n%s\n' "$header" "$out" >"$src/bench/results/bench_http.txt"
  echo "saved to bench/results/bench_http.txt"
fi
kill -TERM $pid
wait $pid
