"""Minimal treeserve example: server info, then a tokenize/detokenize round trip.

    /usr/bin/python3 clients/example.py --target 127.0.0.1:50051
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from treeserve_client import TreeServeClient  # noqa: E402


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
