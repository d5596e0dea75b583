#!/usr/bin/env bash
# The tokenizer against references nobody here wrote, then a live server on the same files.
#  1. npm installs @huggingface/tokenizers (Hugging Face's JavaScript implementation of
#     tokenizer.json) and llama3-tokenizer-js (Meta's Llama 3 vocabulary and merges), pinned
#     by package-lock.json, into BUILD_DIR/tokenizer_ref (never the source tree);
#  2. make_llama3_dir.mjs writes a Llama-3-style model directory from that data;
#  3. gen_strings.mjs writes 12,000 seeded strings; reference.mjs and treeserve_tokenize
#     encode and decode them; compare.mjs wants identical ids and decodes, decode(encode(s))
#     == s, and streamed text equal to the decode;
#  4. the same for the sentencepiece-style layouts (Llama 2's legacy normalizers and
#     decoders, the Metaspace pre-tokenizer): make_spm_json.mjs exports the tiny test model's
#     sentencepiece vocabulary as transformers' converter does, and the legacy export's ids
#     must also equal sentencepiece's own on the tiny model's tokenizer.model;
#  5. treeserve serves the Llama 3 directory with random weights; serve_check.py drives it over
#     gRPC and the log must name tokenizer.json and generation_config.json's EOS ids.
# Exits 77 (ctest: skipped) when node/npm are missing or the registry is unreachable, unless
# TREESERVE_REQUIRE_TOKENIZER_REF=1 (CI), which makes that a failure.
# usage: run.sh SOURCE_DIR BUILD_DIR PYTHON3
set -euo pipefail
src=$1 build=$2 py=$3
here=$src/tests/tokenizer_ref
work=$build/tokenizer_ref
TEST_NAME="tokenizer reference test" REQUIRE_VAR=TREESERVE_REQUIRE_TOKENIZER_REF
# shellcheck source=../common/npm_test_lib.sh
source "$src/tests/common/npm_test_lib.sh"
require_node
npm_install "$work" "$here"/package.json "$here"/package-lock.json "$here"/*.mjs

echo "== Llama 3 tokenizer.json"
dir=$work/llama3
node "$work/make_llama3_dir.mjs" "$dir"
node "$work/gen_strings.mjs" 45 12000 >"$work/strings.jsonl"
node "$work/reference.mjs" "$dir" "$work/strings.jsonl" >"$work/reference.jsonl"
"$build/bin/treeserve_tokenize" --model "$dir" --input "$work/strings.jsonl" \
  --output "$work/treeserve.jsonl"
node "$work/compare.mjs" "$work/strings.jsonl" "$work/reference.jsonl" "$work/treeserve.jsonl"

echo "== sentencepiece-style tokenizer.json (the tiny model's vocabulary)"
node "$work/make_spm_json.mjs" "$build/tiny-llama/tokenizer.vocab" "$work/spm"
"$build/bin/treeserve_tokenize" --model "$build/tiny-llama/tokenizer.model" \
  --input "$work/strings.jsonl" --output "$work/sentencepiece.jsonl"
for layout in legacy metaspace mistral; do
  echo "-- $layout"
  node "$work/reference.mjs" "$work/spm/$layout" "$work/strings.jsonl" >"$work/reference_$layout.jsonl"
  "$build/bin/treeserve_tokenize" --model "$work/spm/$layout/tokenizer.json" \
    --input "$work/strings.jsonl" --output "$work/treeserve_$layout.jsonl"
  if [ $layout = legacy ]; then
    flags=(--ids-also "$work/sentencepiece.jsonl")
  else
    flags=(--no-round-trip)
  fi
  node "$work/compare.mjs" "$work/strings.jsonl" "$work/reference_$layout.jsonl" \
    "$work/treeserve_$layout.jsonl" "${flags[@]}"
done

echo "== treeserve --model $dir --random-weights 1"
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
log=$work/server.log
"$build/bin/treeserve" --model "$dir" --random-weights 1 --backend cpu \
  --listen 127.0.0.1:$port >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  grep -q "ready" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited early"; exit 1; }
  sleep 0.1
done
grep -q "tokenizer: $dir/tokenizer.json" "$log" || { cat "$log"; echo "no tokenizer.json log line"; exit 1; }
grep -q "generation ends on EOS ids \[128001, 128008, 128009\] (generation_config.json)" "$log" ||
  { cat "$log"; echo "no EOS log line"; exit 1; }
export TREESERVE_PY_STUBS=$work/stubs
"$py" "$here/serve_check.py" 127.0.0.1:$port "$src" "$work/strings.jsonl" "$work/treeserve.jsonl"
kill -TERM $pid
wait $pid
echo "server exited cleanly"
