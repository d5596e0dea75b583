"""TreeServeHTTPClient: treeserve's HTTP API (docs/http-api.md) with the Python standard
library only (urllib, json): OpenAI's completions and chat completions, the tree API, the
server's gauges. Streamed calls are generators over the server-sent events; leaving one early
closes the connection, and the server stops that generation.

    from treeserve import TreeServeHTTPClient
    c = TreeServeHTTPClient("http://127.0.0.1:8000")
    tree = c.create_tree("Once upon a time")
    kids = c.branch(tree["id"], tree["root_branch_id"], n=3)
    for event in c.generate(tree["id"], kids, max_tokens=16, stream=True):
        print(event["branch_id"], event["text"])

Errors raise TreeServeHTTPError with the HTTP status and OpenAI's error fields (message,
type, param, code: the gRPC code's name).

Every call on a tree carries the header x-treeserve-route with the tree's routing key (read
from its id), and tree creation and completions the key of their prompt or messages, so a
proxy in front of several replicas sends each call where its tree lives (routing.py).
"""
import json
import urllib.error
import urllib.parse
import urllib.request

from .routing import (ROUTE_HEADER, ROUTE_PREFIX_BYTES, ROUTE_PREFIX_IDS, route_key,
                      route_of_tree)


class TreeServeHTTPError(Exception):
    """An error answer: `status` (HTTP), `code` (the gRPC code's name, e.g. NOT_FOUND),
    `param` (the field at fault, or None), `type` and `message`."""

    def __init__(self, status, error):
        self.status = status
        self.code = error.get("code")
        self.param = error.get("param")
        self.type = error.get("type")
        self.message = error.get("message", "")
        super().__init__("HTTP %s %s: %s" % (status, self.code, self.message))


def _error_of(status, body):
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": body.decode("utf-8", "replace") if isinstance(body, bytes) else body}
    return TreeServeHTTPError(status, error)


class TreeServeHTTPClient:
    """One method per route; keyword arguments are the request's JSON fields.

    base_url: a server's HTTP listener, or a proxy's in front of several replicas.
    route_prefix_bytes / route_prefix_ids: how much of a prompt its routing key hashes (N bytes
    of text or messages, M token ids)."""

    def __init__(self, base_url="http://127.0.0.1:8000", api_key=None, timeout=None,
                 ssl_context=None, route_prefix_bytes=ROUTE_PREFIX_BYTES,
                 route_prefix_ids=ROUTE_PREFIX_IDS):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.ssl_context = ssl_context
        self.route_prefix_bytes = route_prefix_bytes
        self.route_prefix_ids = route_prefix_ids

    def prompt_route(self, prompt=None, messages=None):
        """The routing key of a prompt (text, token ids, OpenAI's one-element batch of either)
        or of chat messages, with this client's N and M; None when there is none."""
        if messages is None and isinstance(prompt, list) and prompt and \
                isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if messages is None and prompt is None:
            return None
        return route_key(prompt, messages=messages, route_prefix_bytes=self.route_prefix_bytes,
                         route_prefix_ids=self.route_prefix_ids)

    # ---- transport

    def _open(self, method, path, body=None, route=None):
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", "Bearer " + self.api_key)
        if route:
            req.add_header(ROUTE_HEADER, route)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout, context=self.ssl_context)
        except urllib.error.HTTPError as e:
            raise _error_of(e.code, e.read()) from None

    def _json(self, method, path, body=None, route=None):
        with self._open(method, path, body, route) as r:
            # A slow whole answer may start with spaces (the server's keep-alive); JSON allows them.
            value = json.loads(r.read())
        if isinstance(value, dict) and "error" in value and len(value) == 1:
            raise TreeServeHTTPError(200, value["error"])  # failed after the answer started
        return value

    def _events(self, path, body, route=None):
        """Yields each server-sent event's JSON until [DONE]; an error event raises."""
        with self._open("POST", path, body, route) as r:
            for raw in r:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue  # blank separators and ": keep-alive" comments
                data = line[6:]
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise TreeServeHTTPError(200, event["error"])
                yield event

    @staticmethod
    def _fields(fields, **extra):
        out = {k: v for k, v in fields.items() if v is not None}
        out.update({k: v for k, v in extra.items() if v is not None})
        return out

    # ---- server

    def health(self):
        return self._json("GET", "/health")

    def ready(self):
        """True once the model is loaded (GET /ready answers 200)."""
        try:
            self._json("GET", "/ready")
            return True
        except TreeServeHTTPError as e:
            if e.status == 503:
                return False
            raise

    def models(self):
        return self._json("GET", "/v1/models")["data"]

    def server_info(self):
        """The pool's gauges (GET /v1/server)."""
        return self._json("GET", "/v1/server")

    def wait_idle(self, timeout=5.0, interval=0.05):
        """Polls server_info() until no tree is live and every page is free or evictable, or
        `timeout` passes; returns the last gauges."""
        import time
        end = time.monotonic() + timeout
        while True:
            s = self.server_info()
            idle = (s["live_trees"] == 0 and
                    s["kv_pages_free"] + s["kv_pages_evictable"] == s["kv_pages_total"])
            if idle or time.monotonic() >= end:
                return s
            time.sleep(interval)

    # ---- OpenAI

    def completions(self, prompt, stream=False, model="", **fields):
        """POST /v1/completions: the completion, or (stream=True) a generator of its chunks."""
        body = self._fields(fields, model=model, prompt=prompt, stream=stream or None)
        route = self.prompt_route(prompt)
        if stream:
            return self._events("/v1/completions", body, route)
        return self._json("POST", "/v1/completions", body, route)

    def chat_completions(self, messages, stream=False, model="", **fields):
        """POST /v1/chat/completions: the chat completion, or (stream=True) its chunks."""
        body = self._fields(fields, model=model, messages=list(messages), stream=stream or None)
        route = self.prompt_route(messages=body["messages"])
        if stream:
            return self._events("/v1/chat/completions", body, route)
        return self._json("POST", "/v1/chat/completions", body, route)

    # ---- the tree API

    def create_tree(self, prompt=None, messages=None, lease_ms=0):
        """A new tree from a prompt (text or token ids) or chat messages."""
        return self._json("POST", "/v1/trees", self._fields(
            {}, prompt=prompt, messages=messages, lease_ms=lease_ms or None),
            self.prompt_route(prompt, messages))

    def list_trees(self, page_size=0, page_token=""):
        query = urllib.parse.urlencode(self._fields(
            {}, page_size=page_size or None, page_token=page_token or None))
        return self._json("GET", "/v1/trees" + ("?" + query if query else ""))

    def get_tree(self, tree_id, detail=False, page_size=0, page_token=""):
        query = urllib.parse.urlencode(self._fields(
            {}, detail=1 if detail else None, page_size=page_size or None,
            page_token=page_token or None))
        path = "/v1/trees/" + urllib.parse.quote(tree_id, safe="")
        return self._json("GET", path + ("?" + query if query else ""), None,
                          route_of_tree(tree_id))

    def branch(self, tree_id, branch_id, n=1, at_offset=0):
        """Forks a branch n ways; returns the new branch ids."""
        return self._json("POST", self._tree(tree_id, "branch"), {
            "branch_id": branch_id, "n": n, "at_offset": at_offset},
            route_of_tree(tree_id))["branch_ids"]

    def generate(self, tree_id, branch_ids, append=None, messages=None, stream=False,
                 **sampling):
        """Decodes the listed branches together (sampling: max_tokens, temperature, top_p,
        top_k, seed, stop, stop_token_ids, logprobs, beam_search). Whole: {"branches": [...]};
        stream=True: a generator of token events {branch_id, token_id, text, logprob,
        finish_reason}."""
        body = self._fields(sampling, branch_ids=list(branch_ids), append=append,
                            messages=messages, stream=stream or None)
        route = route_of_tree(tree_id)
        if stream:
            return self._events(self._tree(tree_id, "generate"), body, route)
        return self._json("POST", self._tree(tree_id, "generate"), body, route)

    def prune(self, tree_id, branch_ids, retain_kv=False):
        return self._json("POST", self._tree(tree_id, "prune"), {
            "branch_ids": list(branch_ids), "retain_kv": retain_kv}, route_of_tree(tree_id))

    def verify(self, tree_id, branch_id, tokens, parents, **sampling):
        return self._json("POST", self._tree(tree_id, "verify"), self._fields(
            sampling, branch_id=branch_id, tokens=list(tokens), parents=list(parents)),
            route_of_tree(tree_id))

    def delete_tree(self, tree_id):
        return self._json("DELETE", "/v1/trees/" + urllib.parse.quote(tree_id, safe=""), None,
                          route_of_tree(tree_id))

    @staticmethod
    def _tree(tree_id, action):
        return "/v1/trees/%s/%s" % (urllib.parse.quote(tree_id, safe=""), action)
