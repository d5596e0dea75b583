#!/usr/bin/env bash
# Runs clients/example.py (the README's client example) against a live treeserve. It imports
# the treeserve package from the checkout (clients/python), whose stubs are generated into
# $TREESERVE_PY_STUBS (here a temp folder) on first use.
# usage: python_client_test.sh TREESERVE_BINARY PYTHON3 SOURCE_DIR
set -euo pipefail
bin=$1 py=$2 src=$3
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
tmp=$(mktemp -d)
log=$tmp/server.log
"$bin" --backend cpu --listen 127.0.0.1:$port \
  --chat-template "$src/tests/models/chat_templates/chatml.jinja" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 1 300); do
  grep -q "ready" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited early"; exit 1; }
  sleep 0.1
done
export TREESERVE_PY_STUBS=$tmp/stubs
"$py" "$src/clients/example.py" --target 127.0.0.1:$port
# The client's lease and GetTree paging parameters, and the old call forms.
PYTHONPATH="$src/clients/python" "$py" - 127.0.0.1:$port <<'PY'
import sys
from treeserve import TreeServeClient
c = TreeServeClient(sys.argv[1])
t = c.create_tree("Once upon a time", lease_ms=30000)
assert t.lease_ms == 30000, t
kids = c.branch(t.tree_id, t.root_branch_id, 5)
first = c.get_tree(t.tree_id, page_size=2)
assert len(first.branches) == 2 and first.next_page_token and first.live_branches == 6, first
assert first.expires_at_unix_ms > 0
ids = [b.branch_id for b in c.tree_branches(t.tree_id, page_size=2)]
assert ids == [t.root_branch_id] + kids, ids
assert len(c.get_tree(t.tree_id).branches) == 6
d = c.create_tree("Once upon a time")
assert d.lease_ms == 600000, d
listed = [x.tree_id for x in c.trees(page_size=1)]
assert listed == [t.tree_id, d.tree_id], listed
assert c.list_trees(page_size=1).next_page_token
for tree in (t, d):
    c.delete_tree(tree.tree_id)
assert list(c.trees()) == []
print("lease, paging and listing ok")
# A chat prompt: rendered by the server's template, its routing key from the messages.
from treeserve import route_key
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
m = c.create_tree(msgs)
assert m.prompt_tokens > 0, m
assert m.tree_id.startswith("t_" + route_key(messages=msgs) + "."), m.tree_id
text = "".join(r.text for r in c.generate(m.tree_id, [m.root_branch_id], max_tokens=4))
assert isinstance(text, str)
c.delete_tree(m.tree_id)
print("chat messages ok")
PY
kill -TERM $pid
wait $pid
echo "server exited cleanly"
