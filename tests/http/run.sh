#!/usr/bin/env bash
# treeserve's HTTP API through OpenAI's own Node client against the real server:
#  1. npm installs the `openai` package, pinned by package-lock.json, into BUILD_DIR/http_test
#     (never the source tree);
#  2. treeserve starts on the tiny model, CPU backend, gRPC and HTTP on free loopback ports,
#     with a random API key (the SDK sends it as its Bearer key) and chat_template.jinja (the
#     tiny model has no chat template of its own);
#  3. openai_sdk_test.mjs runs completions and chat completions (whole and streamed, n = 3,
#     logprobs), the errors, and a stream it aborts (the pool must be idle again);
#  4. the server must exit cleanly on SIGTERM.
# Exits 77 (ctest: skipped) when node or npm is missing or the npm registry is unreachable,
# unless TREESERVE_REQUIRE_NPM=1 (CI), which makes that a failure.
# usage: run.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
here=$src/tests/http
work=$build/http_test
TEST_NAME="openai SDK test" REQUIRE_VAR=TREESERVE_REQUIRE_NPM
# shellcheck source=../common/npm_test_lib.sh
source "$src/tests/common/npm_test_lib.sh"
require_node
npm_install "$work" "$here"/package.json "$here"/package-lock.json "$here"/openai_sdk_test.mjs
log=$work/server.log
start_server "$log" --chat-template "$here/chat_template.jinja"

status=0
TREESERVE_API_KEY=$key node "$work/openai_sdk_test.mjs" "$base" || status=$?
if [ $status -ne 0 ]; then
  echo "== server log"
  tail -n 50 "$log"
  exit $status
fi
stop_server
echo "server exited cleanly"
