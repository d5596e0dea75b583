"""treeserve-cli: a small command line over treeserve's gRPC API.

    treeserve-cli info
    treeserve-cli generate "Q: name three primes. A:" -n 3 --max-tokens 32 --temperature 0.8
    treeserve-cli generate "Once upon a time" -n 2 --keep-tree   # prints the tree id at the end
    treeserve-cli tree t0
    treeserve-cli tokenize "A tree of thoughts"
    treeserve-cli detokenize 442 495 260 362
    treeserve-cli delete t0

Also `python3 -m treeserve ...`. The bearer token comes from --token or $TREESERVE_TOKEN.
Exit status: 0; 1 when the server answers with an error (its gRPC status code and message
are printed) or cannot be reached; 2 on a usage error; 130 on Ctrl-C.
"""
import argparse
import os
import sys

DEFAULT_TARGET = "127.0.0.1:50051"


def _parser():
    from . import __version__
    ap = argparse.ArgumentParser(prog="treeserve-cli", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version="treeserve-cli " + __version__)
    ap.add_argument("--target", default=DEFAULT_TARGET,
                    help="server HOST:PORT (default %s)" % DEFAULT_TARGET)
    ap.add_argument("--token", default=os.environ.get("TREESERVE_TOKEN"),
                    help="bearer token (default $TREESERVE_TOKEN)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="deadline of each call in seconds (default none)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sub.add_parser("info", help="server info: model, backend, KV pool, live trees")

    g = sub.add_parser("generate", help="decode n branches from a prompt, streaming their "
                       "tokens as they arrive (one line per run of one branch's tokens)")
    g.add_argument("prompt", metavar="PROMPT", help="prompt text ('-': read it from stdin)")
    g.add_argument("-n", type=int, default=1, help="branches forked from the prompt (default 1)")
    g.add_argument("--max-tokens", type=int, default=32, help="per branch (default 32)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None, help="same seed, same tokens")
    g.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop string (repeatable)")
    g.add_argument("--keep-tree", action="store_true",
                   help="create a tree and keep it (its id is printed; `tree`, `delete` take "
                        "it) instead of a one-shot call whose tree the server deletes")

    t = sub.add_parser("tree", help="a tree's branches: parents, lengths, live/pruned, pages")
    t.add_argument("tree_id", metavar="TREE_ID")

    d = sub.add_parser("delete", help="delete a tree")
    d.add_argument("tree_id", metavar="TREE_ID")

    k = sub.add_parser("tokenize", help="text -> token ids")
    k.add_argument("text", metavar="TEXT")

    dk = sub.add_parser("detokenize", help="token ids -> text")
    dk.add_argument("ids", metavar="ID", nargs="+",
                    help="token ids (separate arguments or comma-separated)")
    return ap


def _out(s=""):
    sys.stdout.write(s)
    sys.stdout.flush()


_ESCAPES = {i: "\\x%02x" % i for i in list(range(32)) + [127]}
_ESCAPES.update({ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def _escape(text):
    """Streamed text on one line: backslash, newline, tab and other control characters
    escaped (\\n, \\t, \\x00), so every line stays tagged with its branch."""
    return text.translate(_ESCAPES)


def cmd_info(client, args):
    info = client.server_info()
    for f in info.DESCRIPTOR.fields:
        print("%s: %s" % (f.name, getattr(info, f.name)))
    return 0


def cmd_generate(client, args):
    from .client import finish_reason_name
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = {"max_tokens": args.max_tokens, "stop": args.stop}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.keep_tree:
        tree = client.create_tree(prompt)
        print("tree %s: prompt %d tokens (%d cached)" % (tree.tree_id, tree.prompt_tokens,
                                                          tree.cached_tokens))
        branches = ([tree.root_branch_id] if args.n == 1 else
                    client.branch(tree.tree_id, tree.root_branch_id, args.n))
        call = client.generate(tree.tree_id, branches, **sampling)
    else:
        tree = None
        call = client.generate(prompt=prompt, n=args.n, **sampling)

    # One output line per run of consecutive messages of one branch: "[BRANCH] text", text
    # with newlines escaped, written token by token as the messages arrive.
    order, counts, texts, finish = [], {}, {}, {}
    current = None
    try:
        for m in call:
            b = m.branch_id
            if b not in counts:
                order.append(b)
                counts[b], texts[b] = 0, []
            if m.token_id >= 0:
                if b != current:
                    _out(("\n" if current is not None else "") + "[%s] " % b)
                    current = b
                _out(_escape(m.text))
                counts[b] += 1
                texts[b].append(m.text)
            if m.finish_reason:
                finish[b] = m.finish_reason
    except BaseException:
        call.cancel()
        raise
    finally:
        if current is not None:
            _out("\n")
    for b in order:
        print("branch %s: %d tokens, %s: %r" % (
            b, counts[b], finish_reason_name(finish.get(b, 0)), "".join(texts[b])))
    if tree is not None:
        print("kept tree %s (treeserve-cli tree %s; treeserve-cli delete %s)" % (
            tree.tree_id, tree.tree_id, tree.tree_id))
    return 0


def cmd_tree(client, args):
    info = client.get_tree(args.tree_id)
    live = sum(1 for b in info.branches if b.live)
    print("tree %s: %d branches (%d live), %d tokens, %d KV pages" % (
        info.tree_id, len(info.branches), live, info.total_tokens, info.kv_pages))
    ids = {b.branch_id for b in info.branches}
    children = {}
    for b in info.branches:
        parent = b.parent_branch_id if b.parent_branch_id in ids else ""
        children.setdefault(parent, []).append(b)

    def show(b, depth):
        print("%s%s  parent %s  length %d  %s" % (
            "  " * depth, b.branch_id, b.parent_branch_id or "-", b.length,
            "live" if b.live else "pruned"))
        for c in children.get(b.branch_id, []):
            show(c, depth + 1)
    for b in children.get("", []):
        show(b, 0)
    return 0


def cmd_delete(client, args):
    r = client.delete_tree(args.tree_id)
    print("deleted %s: %d tokens freed" % (args.tree_id, r.freed_tokens))
    return 0


def cmd_tokenize(client, args):
    print(" ".join(str(i) for i in client.tokenize(args.text)))
    return 0


def cmd_detokenize(client, args):
    ids = [int(i) for a in args.ids for i in a.replace(",", " ").split()]
    print(client.detokenize(ids))
    return 0


COMMANDS = {"info": cmd_info, "generate": cmd_generate, "tree": cmd_tree,
            "delete": cmd_delete, "tokenize": cmd_tokenize, "detokenize": cmd_detokenize}


def main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "detokenize":
        try:
            [int(i) for a in args.ids for i in a.replace(",", " ").split()]
        except ValueError as e:
            ap.error("detokenize: token ids are integers: %s" % e)
    if args.command == "generate" and args.n < 1:
        ap.error("generate: -n must be >= 1")
    import grpc
    from .client import TreeServeClient
    client = TreeServeClient(args.target, auth_token=args.token, timeout=args.timeout)
    try:
        return COMMANDS[args.command](client, args)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        detail = e.details() if hasattr(e, "details") else str(e)
        print("treeserve-cli: %s failed on %s: %s: %s" % (
            args.command, args.target, code.name if code else "error", detail),
            file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("treeserve-cli: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    finally:
        client.channel.close()


if __name__ == "__main__":
    sys.exit(main())
