#!/usr/bin/env bash
# The tree API over JSON driven by curl against the real server (tiny model, CPU backend, an
# API key), as docs/http-api.md shows it: create a tree, fork it, generate (streamed as
# server-sent events, and whole), read it with detail, verify, prune, list, delete, and the
# error cases with their HTTP statuses and OpenAI-shaped bodies. python3 reads the JSON.
# usage: tree_api_curl.sh TREESERVE_BINARY
set -euo pipefail
bin=$1
command -v curl >/dev/null || { echo "curl is not installed"; exit 1; }
tmp=$(mktemp -d)
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
http_port=$(free_port)
key=curl-test-key
TREESERVE_API_KEY=$key "$bin" --backend cpu --listen 127.0.0.1:$(free_port) \
  --http-listen 127.0.0.1:$http_port >"$tmp/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
H=http://127.0.0.1:$http_port
for _ in $(seq 1 300); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' $H/ready || true)" = 200 ] && break
  kill -0 $pid 2>/dev/null || { cat "$tmp/server.log"; echo "server exited early"; exit 1; }
  sleep 0.1
done

fail() {
  echo "FAILED: $*"
  tail -n 30 "$tmp/server.log"
  exit 1
}
# call METHOD PATH [BODY]: prints the body; the status goes to $tmp/status.
call() {
  curl -s -o "$tmp/body" -w '%{http_code}' -X "$1" -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' ${3:+-d "$3"} "$H$2" >"$tmp/status"
  cat "$tmp/body"
}
status() { cat "$tmp/status"; }
# field JSON EXPR: a Python expression over the parsed JSON `j`.
field() { python3 -c "import json,sys; j=json.loads(sys.argv[1]); print($2)" "$1"; }
expect() {  # expect WHAT ACTUAL WANTED
  [ "$2" = "$3" ] || fail "$1: got '$2', want '$3'"
}

echo "== create, fork, generate"
tree=$(call POST /v1/trees '{"prompt": "Once upon a time", "lease_ms": 60000}')
expect "create status" "$(status)" 200
id=$(field "$tree" 'j["id"]')
root=$(field "$tree" 'j["root_branch_id"]')
expect "lease" "$(field "$tree" 'j["lease_ms"]')" 60000
kids=$(call POST /v1/trees/$id/branch "{\"branch_id\": \"$root\", \"n\": 3}")
expect "branch status" "$(status)" 200
ids=$(field "$kids" 'json.dumps(j["branch_ids"])')
expect "forks" "$(field "$kids" 'len(j["branch_ids"])')" 3

# Streamed: one event per token per branch, then [DONE].
curl -sN -H "Authorization: Bearer $key" -d "{\"branch_ids\": $ids, \"max_tokens\": 4, \"stream\": true}" \
  $H/v1/trees/$id/generate >"$tmp/sse"
python3 - "$tmp/sse" <<'PY' || fail "generate SSE"
import json, sys
events = [l[6:] for l in open(sys.argv[1]).read().split("\n") if l.startswith("data: ")]
assert events[-1] == "[DONE]", events[-1]
per = {}
for e in events[:-1]:
    m = json.loads(e)
    per.setdefault(m["branch_id"], []).append(m)
assert len(per) == 3, per.keys()
for msgs in per.values():
    assert len(msgs) == 4, msgs
    assert all(isinstance(m["token_id"], int) for m in msgs)
    assert msgs[-1]["finish_reason"] == "length", msgs[-1]
    assert all(m["finish_reason"] is None for m in msgs[:-1])
PY
whole=$(call POST /v1/trees/$id/generate "{\"branch_ids\": $ids, \"append\": \" The end\", \"max_tokens\": 3, \"temperature\": 0.8, \"seed\": 5}")
expect "generate status" "$(status)" 200
expect "whole branches" "$(field "$whole" 'len(j["branches"])')" 3
expect "whole tokens" "$(field "$whole" 'sorted({len(b["token_ids"]) for b in j["branches"]})')" "[3]"

echo "== read, verify, prune, list"
info=$(call GET "/v1/trees/$id?detail=1")
expect "get status" "$(status)" 200
expect "live" "$(field "$info" 'j["live_branches"]')" 4
expect "root text" "$(field "$info" 'j["branches"][0]["text"]')" "Once upon a time"
expect "states" "$(field "$info" 'sorted({b["state"] for b in j["branches"]})')" "['idle']"
expect "finish" "$(field "$info" '[b["finish_reason"] for b in j["branches"][1:]]')" \
  "['length', 'length', 'length']"
first=$(field "$kids" 'j["branch_ids"][0]')
v=$(call POST /v1/trees/$id/verify "{\"branch_id\": \"$first\", \"tokens\": [5, 6], \"parents\": [-1, 0]}")
expect "verify status" "$(status)" 200
field "$v" 'j["bonus_token"] >= 0' >/dev/null
p=$(call POST /v1/trees/$id/prune "{\"branch_ids\": [\"$first\"]}")
expect "prune status" "$(status)" 200
expect "pruned" "$(field "$p" 'j["pruned_branches"]')" 1
list=$(call GET /v1/trees)
expect "list" "$(field "$list" '[t["id"] for t in j["data"]]')" "['$id']"
expect "list branches" "$(field "$list" 'j["data"][0]["live_branches"]')" 3

echo "== errors"
e=$(call POST /v1/trees/$id/prune "{\"branch_ids\": [\"$first\"]}")
expect "pruned again" "$(status) $(field "$e" 'j["error"]["code"]') $(field "$e" 'j["error"]["param"]')" \
  "404 NOT_FOUND branch_id"
e=$(call POST /v1/trees/t_nope/branch "{\"branch_id\": \"$root\"}")
expect "unknown tree" "$(status) $(field "$e" 'j["error"]["type"]')" "404 not_found_error"
e=$(call POST /v1/trees/$id/branch '{"branch_id": 7}')
expect "wrong type" "$(status) $(field "$e" 'j["error"]["param"]')" "400 branch_id"
e=$(call POST /v1/trees/$id/generate '{"branch_ids": [], "max_tokens": 2}')
expect "no branches" "$(status) $(field "$e" 'j["error"]["param"]')" "400 branch_ids"
e=$(call POST /v1/trees/$id/generate "{\"branch_ids\": [\"$root\"], \"temperature\": -2}")
expect "bad temperature" "$(status) $(field "$e" 'j["error"]["param"]')" "400 temperature"
e=$(call POST /v1/trees '{"prompt": "x"')
expect "bad JSON" "$(status) $(field "$e" 'j["error"]["code"]')" "400 INVALID_ARGUMENT"
e=$(curl -s -w ' %{http_code}' $H/v1/trees)
expect "no key" "${e##* }" 401
e=$(curl -s -o /dev/null -w '%{http_code}' $H/v1/nothing)
expect "no route" "$e" 404

echo "== delete"
d=$(call DELETE /v1/trees/$id)
expect "delete status" "$(status)" 200
field "$d" 'j["freed_tokens"] > 0' | grep -q True || fail "freed_tokens"
call DELETE /v1/trees/$id >/dev/null
expect "deleted again" "$(status)" 404
s=$(call GET /v1/server)
expect "idle" "$(field "$s" '(j["live_trees"], j["kv_pages_free"] + j["kv_pages_evictable"] == j["kv_pages_total"])')" \
  "(0, True)"

kill -TERM $pid
wait $pid
trap 'rm -rf "$tmp"' EXIT
echo "tree API over curl: ok; server exited cleanly"
