"""TreeServeHTTPClient (clients/python/treeserve/http.py) against the real server: the tree API
(create, fork, generate whole and streamed, detail, verify, prune, list, delete), completions
and chat completions whole and streamed, errors as TreeServeHTTPError, a key, and a stream left
early (the pool idle again).

usage: python3 python_http_client_test.py TREESERVE_BINARY SOURCE_DIR
"""
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest

BIN, SRC = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(SRC, "clients", "python"))
os.environ.setdefault("TREESERVE_PY_STUBS", tempfile.mkdtemp(prefix="treeserve-stubs-"))
from treeserve import TreeServeHTTPClient, TreeServeHTTPError  # noqa: E402

KEY = "python-http-key"
PROMPT = "Once upon a time, in a quiet village, there lived"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        port = free_port()
        cls.log = tempfile.NamedTemporaryFile(prefix="treeserve-", suffix=".log", delete=False)
        cls.server = subprocess.Popen(
            [BIN, "--backend", "cpu", "--listen", "127.0.0.1:%d" % free_port(),
             "--http-listen", "127.0.0.1:%d" % port,
             "--chat-template", os.path.join(SRC, "tests", "http", "chat_template.jinja")],
            stdout=cls.log, stderr=subprocess.STDOUT, env=dict(os.environ, TREESERVE_API_KEY=KEY))
        cls.client = TreeServeHTTPClient("http://127.0.0.1:%d" % port, api_key=KEY, timeout=60)
        for _ in range(300):
            try:
                if cls.client.ready():
                    return
            except OSError:
                pass
            if cls.server.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready: " + open(cls.log.name).read())

    @classmethod
    def tearDownClass(cls):
        cls.server.terminate()
        assert cls.server.wait(30) == 0, open(cls.log.name).read()

    def tearDown(self):
        s = self.client.wait_idle()
        self.assertEqual(s["live_trees"], 0, s)
        self.assertEqual(s["kv_pages_free"] + s["kv_pages_evictable"], s["kv_pages_total"], s)

    def test_tree_api(self):
        c = self.client
        tree = c.create_tree(PROMPT, lease_ms=30000)
        self.assertEqual(tree["lease_ms"], 30000)
        kids = c.branch(tree["id"], tree["root_branch_id"], n=3)
        self.assertEqual(len(kids), 3)
        whole = c.generate(tree["id"], kids, max_tokens=5)
        self.assertEqual([len(b["token_ids"]) for b in whole["branches"]], [5, 5, 5])
        events = list(c.generate(tree["id"], kids[:2], append=" Then", max_tokens=3, stream=True))
        self.assertEqual(sorted({e["branch_id"] for e in events}), sorted(kids[:2]))
        self.assertEqual(sum(1 for e in events if e["finish_reason"] == "length"), 2)
        info = c.get_tree(tree["id"], detail=True)
        self.assertEqual(info["live_branches"], 4)
        self.assertEqual(info["branches"][0]["text"], PROMPT)
        self.assertTrue(all(b["state"] == "idle" for b in info["branches"]))
        v = c.verify(tree["id"], kids[2], tokens=[5, 6], parents=[-1, 0])
        self.assertIn("bonus_token", v)
        self.assertEqual(c.prune(tree["id"], [kids[0]])["pruned_branches"], 1)
        self.assertEqual([t["id"] for t in c.list_trees()["data"]], [tree["id"]])
        page = c.get_tree(tree["id"], page_size=2)
        self.assertEqual(len(page["branches"]), 2)
        self.assertTrue(page["next_page_token"])
        with self.assertRaises(TreeServeHTTPError) as e:
            c.prune(tree["id"], [kids[0]])
        self.assertEqual((e.exception.status, e.exception.code, e.exception.param),
                         (404, "NOT_FOUND", "branch_id"))
        self.assertGreater(c.delete_tree(tree["id"])["freed_tokens"], 0)
        # A tree from chat messages.
        chat = c.create_tree(messages=[{"role": "user", "content": "Hello"}])
        self.assertGreater(chat["prompt_tokens"], 2)
        c.delete_tree(chat["id"])

    def test_completions(self):
        c = self.client
        whole = c.completions(PROMPT, n=3, max_tokens=6, temperature=0, logprobs=1)
        self.assertEqual(len(whole["choices"]), 3)
        self.assertEqual(len(whole["choices"][0]["logprobs"]["tokens"]), 6)
        self.assertIn("cached_tokens", whole["usage"]["prompt_tokens_details"])
        text = "".join(ch["choices"][0]["text"]
                       for ch in c.completions(PROMPT, max_tokens=6, temperature=0, stream=True)
                       if ch["choices"])
        self.assertEqual(text, whole["choices"][0]["text"])
        messages = [{"role": "user", "content": "Tell me a story."}]
        chat = c.chat_completions(messages, n=2, max_tokens=5, temperature=0)
        self.assertEqual([ch["message"]["role"] for ch in chat["choices"]],
                         ["assistant", "assistant"])
        deltas = "".join(ch["choices"][0]["delta"].get("content", "")
                         for ch in c.chat_completions(messages, max_tokens=5, temperature=0,
                                                      stream=True)
                         if ch["choices"])
        self.assertEqual(deltas, chat["choices"][0]["message"]["content"])

    def test_errors_and_leaving_a_stream(self):
        c = self.client
        with self.assertRaises(TreeServeHTTPError) as e:
            c.completions(PROMPT, temperature="hot")
        self.assertEqual((e.exception.status, e.exception.param), (400, "temperature"))
        with self.assertRaises(TreeServeHTTPError) as e:
            TreeServeHTTPClient(c.base_url, api_key="wrong").server_info()
        self.assertEqual((e.exception.status, e.exception.code), (401, "UNAUTHENTICATED"))
        # Leaving the generator closes the connection: the server stops the generation.
        stream = c.completions(PROMPT, n=4, max_tokens=4000, temperature=1.0, stream=True)
        for i, _ in enumerate(stream):
            if i == 4:
                break
        stream.close()
        s = c.wait_idle(timeout=10)
        self.assertEqual(s["live_branches"], 0, s)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
