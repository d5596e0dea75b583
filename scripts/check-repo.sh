#!/usr/bin/env bash
# Repository check: the tree states the present and stands on its own.
# - no tracked file name carries a date, and no patch (.diff/.patch) files are tracked;
# - no tracked text refers to paths outside the repository (../shared);
# - no tracked text speaks of development sessions or numbered issues/tasks;
# - README.md stays short (at most 300 lines) and every docs/ file it maps exists.
# Vendored third-party data (bench/workloads/deft-templates) is excluded from the text checks.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
problem() {
  echo "check-repo: $*" >&2
  fail=1
}

files=$(git ls-files --cached --others --exclude-standard | while read -r f; do
  [ -e "$f" ] && echo "$f"
done)

dated=$(echo "$files" | grep -E '(^|/)[^/]*20[0-9]{2}-[0-9]{2}-[0-9]{2}[^/]*$|\.(diff|patch)$' || true)
[ -z "$dated" ] || problem "dated or patch files in the tree:"$'\n'"$dated"

text=$(echo "$files" | grep -v -E '^bench/workloads/deft-templates/|^scripts/check-repo\.sh$' |
  grep -v -E '\.(png|jpg|gz|bin|safetensors|model)$' || true)
# shellcheck disable=SC2086
outside=$(grep -n -I -E '\.\./shared\b' $text 2>/dev/null || true)
[ -z "$outside" ] || problem "references to paths outside the repository:"$'\n'"$outside"

history_words='\b(first|second|third|fourth|fifth|[a-z]+tieth|[a-z]+teenth|twenty[a-z-]*|[0-9]+(st|nd|rd|th)) session\b|\b(this|last|next|previous|earlier|later) session\b|\bsession [0-9]+\b|\b(issue|task)s? #?[0-9]+\b'
# shellcheck disable=SC2086
talk=$(grep -n -I -i -E "$history_words" $text 2>/dev/null || true)
[ -z "$talk" ] || problem "words about development sessions or numbered issues:"$'\n'"$talk"

lines=$(wc -l <README.md)
[ "$lines" -le 300 ] || problem "README.md has $lines lines (at most 300)"
for doc in $(grep -o -E '\(docs/[A-Za-z0-9_.-]+\.md\)' README.md | tr -d '()' | sort -u); do
  [ -f "$doc" ] || problem "README.md maps $doc, which does not exist"
done

[ $fail -eq 0 ] && echo "repository check OK ($(echo "$files" | wc -l) files)"
exit $fail
