# Shared by the tests that drive treeserve with npm packages (tests/http, tests/viewer,
# tests/tokenizer_ref). Source it after setting:
#   TEST_NAME    words for the skip message ("openai SDK test")
#   REQUIRE_VAR  the variable that turns a skip into a failure (TREESERVE_REQUIRE_NPM)
# Functions:
#   skip WHY...                 exit 77 (ctest: skipped), or 1 when $REQUIRE_VAR is 1
#   require_node                skip without node and npm
#   npm_install WORK FILES...   copy FILES into WORK and `npm ci` there (pinned by the
#                               package-lock.json among FILES); skip when the registry is
#                               unreachable, fail when npm ci fails otherwise
#   start_server LOG ARGS...    start BUILD/bin/treeserve (CPU backend, gRPC and HTTP on free
#                               loopback ports, a random $TREESERVE_API_KEY) with ARGS; sets
#                               pid, key, base (the HTTP address); fails unless GET /ready
#                               answers 200 within a minute; kills the server on exit
#   stop_server                 SIGTERM, and the server must exit 0

skip() {
  echo "$TEST_NAME skipped: $*"
  if [ "${!REQUIRE_VAR:-0}" = 1 ]; then
    echo "$REQUIRE_VAR=1: a skip is a failure"
    exit 1
  fi
  exit 77
}

require_node() {
  command -v node >/dev/null || skip "node is not installed"
  command -v npm >/dev/null || skip "npm is not installed"
}

npm_install() {
  local work=$1
  shift
  mkdir -p "$work"
  cp "$@" "$work"/
  if ! (cd "$work" && npm ci --no-audit --no-fund --loglevel=error >npm.log 2>&1); then
    cat "$work/npm.log"
    (cd "$work" && npm ping >/dev/null 2>&1) || skip "the npm registry is unreachable"
    echo "npm ci failed"
    exit 1
  fi
}

free_port() {
  node -e 'const s = require("net").createServer().listen(0, "127.0.0.1",
             () => { console.log(s.address().port); s.close(); });'
}

start_server() {
  local log=$1
  shift
  local grpc_port http_port
  grpc_port=$(free_port)
  http_port=$(free_port)
  key=$(node -e 'console.log(require("crypto").randomBytes(18).toString("base64url"))')
  TREESERVE_API_KEY=$key "$build/bin/treeserve" --backend cpu --listen 127.0.0.1:$grpc_port \
    --http-listen 127.0.0.1:$http_port "$@" >"$log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  base=http://127.0.0.1:$http_port
  for _ in $(seq 1 300); do
    if node -e 'fetch(process.argv[1]).then((r) => process.exit(r.status === 200 ? 0 : 1),
                                            () => process.exit(1))' "$base/ready"; then
      return 0
    fi
    kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited early"; exit 1; }
    sleep 0.2
  done
  cat "$log"
  echo "GET /ready never answered 200"
  exit 1
}

stop_server() {
  kill -TERM $pid
  wait $pid
  trap - EXIT
}
