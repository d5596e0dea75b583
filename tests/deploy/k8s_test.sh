#!/usr/bin/env bash
# The Kubernetes manifests (deploy/kustomization.yaml) against Kubernetes' schemas, offline:
# k8s_validate.mjs with kubernetes-models, yaml and typescript from npm (pinned by
# package-lock.json, installed at test time into BUILD_DIR/deploy_test, never the source tree).
# Exits 77 (ctest: skipped) without node, npm or the npm registry, unless
# TREESERVE_REQUIRE_NPM=1 (CI).
# usage: k8s_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
here=$src/tests/deploy
work=$build/deploy_test
TEST_NAME="Kubernetes manifest test" REQUIRE_VAR=TREESERVE_REQUIRE_NPM
# shellcheck source=../common/npm_test_lib.sh
source "$src/tests/common/npm_test_lib.sh"
require_node
npm_install "$work" "$here"/package.json "$here"/package-lock.json "$here"/k8s_validate.mjs
node "$work/k8s_validate.mjs" "$src" "$work"
