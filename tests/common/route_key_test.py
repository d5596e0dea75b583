"""The Python package's routing keys (clients/python/treeserve/routing.py) on the fixed vectors
of route_key_vectors.json, which the C++ test (route_key_test.cpp) checks common/route_key.h
against: both sides give the same keys. Also route_of_tree on tree ids.

    /usr/bin/python3 tests/common/route_key_test.py <source dir>
"""
import importlib.util
import json
import os
import sys
import unittest

SOURCE_DIR = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..")


def load_routing():
    # By path: the module is standard library only, and the package's __init__ would need the
    # gRPC stubs.
    path = os.path.join(SOURCE_DIR, "clients", "python", "treeserve", "routing.py")
    spec = importlib.util.spec_from_file_location("treeserve_routing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


routing = load_routing()


def key_of_vector(v):
    repeat = v.get("repeat", 1)
    n = v.get("prefix_bytes", routing.ROUTE_PREFIX_BYTES)
    if v["kind"] == "text":
        return routing.route_key(v["text"] * repeat, route_prefix_bytes=n)
    if v["kind"] == "ids":
        ids = list(range(v["range"])) if "range" in v else v["ids"]
        return routing.route_key(ids, route_prefix_ids=v.get("prefix_ids",
                                                             routing.ROUTE_PREFIX_IDS))
    messages = [{"role": m["role"], "content": m["content"] * repeat} for m in v["messages"]]
    return routing.route_key(messages=messages, route_prefix_bytes=n)


class RouteKeyTest(unittest.TestCase):
    def test_fixed_vectors(self):
        with open(os.path.join(SOURCE_DIR, "tests", "common", "route_key_vectors.json"),
                  encoding="utf-8") as f:
            vectors = json.load(f)["vectors"]
        self.assertGreaterEqual(len(vectors), 10)
        for v in vectors:
            self.assertEqual(key_of_vector(v), v["key"], v)

    def test_messages_forms(self):
        # Objects with role/content attributes (the gRPC ChatMessage) and OpenAI's text parts
        # (joined by newlines, as the server joins them) give the dict's key.
        class Msg:
            def __init__(self, role, content):
                self.role, self.content = role, content
        want = routing.route_key(messages=[{"role": "user", "content": "a\nb"}])
        self.assertEqual(routing.route_key(messages=[Msg("user", "a\nb")]), want)
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        self.assertEqual(routing.route_key(messages=[{"role": "user", "content": parts}]), want)
        self.assertEqual(len(want), 16)

    def test_shared_prefix_shares_a_key(self):
        head = "p" * routing.ROUTE_PREFIX_BYTES
        self.assertEqual(routing.route_key(head + "x"), routing.route_key(head + "y"))
        self.assertNotEqual(routing.route_key("x"), routing.route_key("y"))
        self.assertNotEqual(routing.route_key("1"), routing.route_key([1]))
        with self.assertRaises(ValueError):
            routing.route_key()

    def test_route_of_tree(self):
        tid = "t_3f2a9c0d1e2b4a5c.r1.9a8b7c6d." + "0123456789abcdef" * 2
        self.assertEqual(routing.route_of_tree(tid), "3f2a9c0d1e2b4a5c")
        self.assertEqual(routing.replica_of_tree(tid), "r1")
        dotted = "t_user.42.local.0123abcd." + "a" * 32
        self.assertEqual(routing.route_of_tree(dotted), "user.42")
        self.assertEqual(routing.replica_of_tree(dotted), "local")
        for bad in ("", "t_unknown", "t_" + "Q" * 22, "b_abc", "t_.r1.0123abcd.x"):
            self.assertIsNone(routing.route_of_tree(bad), bad)
            self.assertIsNone(routing.replica_of_tree(bad), bad)


if __name__ == "__main__":
    unittest.main()
