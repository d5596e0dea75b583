#!/usr/bin/env bash
# treeserve's HTTP API through OpenAI's own Node client against the real server:
#  1. npm installs the `openai` package and `typescript`, pinned by package-lock.json, into
#     BUILD_DIR/http_test (never the source tree);
#  2. treeserve starts on the tiny model, CPU backend, gRPC and HTTP on free loopback ports,
#     with a random API key (the SDK sends it as its Bearer key) and chat_template.jinja (the
#     tiny model has no chat template of its own);
#  3. openai_sdk_test.mjs runs completions and chat completions (whole and streamed, n = 3,
#     logprobs, the token_ids extension), the errors, and a stream it aborts (the pool must be
#     idle again), saving every response object the SDK hands back to responses.json;
#  4. the server must exit cleanly on SIGTERM;
#  5. sdk_types_gen.mjs writes each saved object as a fresh object literal of the SDK's declared
#     type (sdk_types_check.ts) and `tsc --noEmit --strict` checks it: a missing required
#     field, a value outside the declared type or a property the SDK does not declare fails,
#     except the extensions sdk_extensions.ts lists. The errors are printed with the response
#     each one is in (the generated file stays in BUILD_DIR/http_test).
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
npm_install "$work" "$here"/package.json "$here"/package-lock.json "$here"/openai_sdk_test.mjs \
  "$here"/sdk_types_gen.mjs "$here"/sdk_extensions.ts
log=$work/server.log
start_server "$log" --chat-template "$here/chat_template.jinja"

status=0
TREESERVE_API_KEY=$key node "$work/openai_sdk_test.mjs" "$base" "$work/responses.json" || status=$?
if [ $status -ne 0 ]; then
  echo "== server log"
  tail -n 50 "$log"
  exit $status
fi
stop_server
echo "server exited cleanly"

cd "$work"
node sdk_types_gen.mjs responses.json sdk_types_check.ts
if ! node_modules/.bin/tsc --noEmit --strict --target es2022 --module nodenext --pretty false \
  sdk_extensions.ts sdk_types_check.ts >tsc.log 2>&1; then
  head -n 40 tsc.log
  echo "($(grep -c ': error TS' tsc.log) errors in all: $work/tsc.log)"
  echo "== the responses with type errors (errors, the response)"
  # Each error's line -> the `// "where"` comment above its object in sdk_types_check.ts.
  awk -F'[(,]' 'NR == FNR { if ($0 ~ /^\/\/ "/) w = $0; where[FNR] = w; next }
                /: error TS/ { print where[$2] }' sdk_types_check.ts tsc.log | sort | uniq -c
  echo "the responses do not type-check against the openai SDK's types"
  exit 1
fi
echo "every response type-checks against the openai SDK's types"
