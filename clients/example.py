"""Minimal treeserve example: server info, a tokenize/detokenize round trip, then a
tree-of-thought search run on the server (scored by logprob, then by the client).

    /usr/bin/python3 clients/example.py --target 127.0.0.1:50051
"""
import argparse
import os
import sys

# The treeserve package from this checkout (clients/python); an installed one works the same.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "python"))
from treeserve import TreeServeClient, is_idle  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--text", default="A tree of thoughts grows one branch at a time.")
    args = ap.parse_args()

    client = TreeServeClient(args.target, timeout=30)
    info = client.server_info()
    print("model=%s backend=%s page_size=%d kv_pages=%d/%d" % (
        info.model, info.backend, info.page_size, info.kv_pages_free, info.kv_pages_total))
    ids = client.tokenize(args.text)
    print("tokens:", ids)
    text = client.detokenize(ids)
    print("text:  ", text)
    if text != args.text:
        print("round trip mismatch", file=sys.stderr)
        return 1

    # Tree-of-thought BFS on the server: each level forks every kept node 3 ways, generates
    # one thought per child (batched together) and keeps the 2 best by mean token logprob.
    tree = client.create_tree("Q: " + args.text + "\nA:")
    done = None
    for msg in client.tree_search(tree.tree_id, expand=3, keep=2, depth=2, max_tokens=8,
                                  temperature=0.8, seed=1):
        if hasattr(msg, "candidates"):
            print("level %d: %s" % (msg.level, ", ".join(
                "%s<-%s %.2f" % (c.branch_id, c.parent_branch_id, c.score)
                for c in msg.candidates)))
        else:
            done = msg
    for leaf in done.leaves:
        print("kept %s (score %.3f): %r" % (leaf.branch_id, leaf.score, leaf.text))
    # The client may score instead: here the longest thought of each level wins.
    longest = list(client.tree_search(
        tree.tree_id, expand=2, keep=1, depth=2, max_tokens=8, temperature=0.8, seed=2,
        score=lambda level: {c.branch_id: len(c.text) for c in level.candidates}))[-1]
    print("longest-thought path: %r" % longest.leaves[0].text)
    client.delete_tree(tree.tree_id)
    if len(done.leaves) != 2 or len(longest.leaves) != 1:
        print("unexpected tree search results", file=sys.stderr)
        return 1
    if not is_idle(client.wait_idle()):
        print("KV pages still held after deleting the tree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
