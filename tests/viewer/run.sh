#!/usr/bin/env bash
# The tree viewer (server/viewer) in a headless browser against the real server:
#  1. npm installs playwright-core, pinned by package-lock.json, into BUILD_DIR/viewer_test
#     (never the source tree); the browser is Debian's /usr/bin/chromium;
#  2. treeserve starts on the tiny model, CPU backend, gRPC and HTTP on free loopback ports,
#     with a random API key ($TREESERVE_API_KEY);
#  3. viewer_test.mjs opens /viewer, enters the key, creates a tree over the HTTP API, forks it
#     4 ways, streams a generation, prunes 2 forks and deletes the tree, asserting what the
#     page shows at each step;
#  4. the server must exit cleanly on SIGTERM.
# Screenshots: BUILD_DIR/viewer_test/artifacts/viewer.png (the pruned tree, one branch open),
# viewer-streaming.png (mid-stream) and, when it fails, viewer-failure.png.
# Exits 77 (ctest: skipped) when node, npm or chromium is missing, the server was built
# without its HTTP listener, or the npm registry is unreachable, unless
# TREESERVE_REQUIRE_NPM=1 (CI), which makes that a failure.
# usage: run.sh SOURCE_DIR BUILD_DIR [MAX_TOKENS]
set -euo pipefail
src=$1 build=$2 max_tokens=${3:-}
here=$src/tests/viewer
work=$build/viewer_test
TEST_NAME="viewer test" REQUIRE_VAR=TREESERVE_REQUIRE_NPM
# shellcheck source=../common/npm_test_lib.sh
source "$src/tests/common/npm_test_lib.sh"
require_node
[ -x /usr/bin/chromium ] || skip "/usr/bin/chromium is not installed (apt-get install chromium)"
"$build/bin/treeserve" --help | grep -q -- --http-listen ||
  skip "$build/bin/treeserve has no --http-listen"
rm -rf "$work/artifacts"
npm_install "$work" "$here"/package.json "$here"/package-lock.json "$here"/viewer_test.mjs
log=$work/server.log
start_server "$log"

status=0
node "$work/viewer_test.mjs" "$base" "$key" "$work/artifacts" $max_tokens || status=$?
if [ $status -ne 0 ]; then
  echo "== server log"
  tail -n 50 "$log"
  echo "viewer test failed; screenshots in $work/artifacts"
  exit $status
fi
stop_server
echo "server exited cleanly; screenshots in $work/artifacts"
