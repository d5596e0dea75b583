#!/usr/bin/env bash
# clang-format check. With a git revision argument, only the C++ files changed since it;
# without one, every tracked C++ file (a superset of any change).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ge 1 ]; then
  files=$(git diff --name-only --diff-filter=ACMR "$1" -- '*.h' '*.cpp' '*.cu' '*.cuh')
else
  files=$(git ls-files -- '*.h' '*.cpp' '*.cu' '*.cuh')
fi
[ -z "$files" ] && { echo "no C++ files to check"; exit 0; }
# shellcheck disable=SC2086
clang-format --dry-run --Werror $files
echo "format OK ($(echo "$files" | wc -l) files)"
