"""TreeServeClient: a thin client over treeserve's gRPC API (treeserve.v1.TreeServe), one
method per RPC, plus stream helpers (collect_stream, BranchStream) and pool checks (is_idle,
kv_pages_in_use). Needs grpcio (Debian: python3-grpcio).

Every call on a tree carries the header x-treeserve-route with the tree's routing key (read
from its id), and CreateTree and one-shot Generate calls the key of their prompt, so a proxy
in front of several replicas sends each call where its tree lives (routing.py)."""
from . import treeserve_pb2 as pb
from . import treeserve_pb2_grpc as pb_grpc
from .routing import (ROUTE_HEADER, ROUTE_PREFIX_BYTES, ROUTE_PREFIX_IDS, route_key,
                      route_of_tree)


class TreeServeClient:
    """Thin wrapper: one method per RPC, keyword arguments for the common fields.

    target: a server's host:port, or a proxy's in front of several replicas.
    route_prefix_bytes / route_prefix_ids: how much of a prompt its routing key hashes (N bytes
    of text or messages, M token ids)."""

    def __init__(self, target="127.0.0.1:50051", auth_token=None, timeout=None,
                 route_prefix_bytes=ROUTE_PREFIX_BYTES, route_prefix_ids=ROUTE_PREFIX_IDS):
        import grpc
        self._grpc = grpc
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.TreeServeStub(self.channel)
        self.timeout = timeout
        self.metadata = [("authorization", "Bearer " + auth_token)] if auth_token else None
        self.route_prefix_bytes = route_prefix_bytes
        self.route_prefix_ids = route_prefix_ids

    def _metadata(self, route=None):
        """The call's metadata: the key, and x-treeserve-route when `route` is given."""
        if not route:
            return self.metadata
        return (self.metadata or []) + [(ROUTE_HEADER, route)]

    def prompt_route(self, prompt):
        """The routing key of a prompt (text, token ids or chat messages) with this client's N
        and M."""
        if _is_messages(prompt):
            return route_key(messages=prompt, route_prefix_bytes=self.route_prefix_bytes,
                             route_prefix_ids=self.route_prefix_ids)
        return route_key(prompt, route_prefix_bytes=self.route_prefix_bytes,
                         route_prefix_ids=self.route_prefix_ids)

    def _call(self, method, request, timeout=None, route=None):
        return method(request, timeout=timeout or self.timeout, metadata=self._metadata(route))

    def _tree_call(self, method, request, timeout=None):
        return self._call(method, request, timeout, route_of_tree(request.tree_id))

    @staticmethod
    def prompt(text_or_ids):
        """A Prompt from text, token ids, or chat messages: a list of {"role": ..., "content":
        ...} dicts, rendered by the server with the model's chat template (with the assistant's
        turn header at the end)."""
        if isinstance(text_or_ids, str):
            return pb.Prompt(text=text_or_ids)
        if _is_messages(text_or_ids):
            return pb.Prompt(messages=pb.ChatMessages(messages=[
                pb.ChatMessage(role=m["role"], content=m["content"]) for m in text_or_ids]))
        return pb.Prompt(tokens=pb.TokenIds(ids=list(text_or_ids)))

    def tokenize(self, text):
        return list(self._call(self.stub.Tokenize, pb.TokenizeRequest(text=text)).ids)

    def detokenize(self, ids):
        return self._call(self.stub.Detokenize, pb.DetokenizeRequest(ids=list(ids))).text

    def server_info(self):
        return self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest())

    def create_tree(self, prompt, lease_ms=0):
        """A new tree. lease_ms: its idle lease (the server deletes a tree no call has named for
        that long); 0 = the server's default (server.tree_lease_default_s)."""
        return self._call(self.stub.CreateTree, pb.CreateTreeRequest(
            prompt=self.prompt(prompt), lease_ms=lease_ms), route=self.prompt_route(prompt))

    def branch(self, tree_id, branch_id, n, at_offset=0):
        r = self._tree_call(self.stub.Branch, pb.BranchRequest(
            tree_id=tree_id, branch_id=branch_id, n=n, at_offset=at_offset))
        return list(r.branch_ids)

    def generate(self, tree_id="", branch_ids=(), append=None, prompt=None, n=0, timeout=None,
                 beam_width=0, length_penalty=0.0, **sampling):
        """Yields GenerateResponse messages as they stream in. beam_width > 0 runs a
        server-side beam search from the one listed branch (or the prompt, n = 1) and streams
        the best beams at the end, best first (`score` on each beam's last message)."""
        req = pb.GenerateRequest(tree_id=tree_id, branch_ids=list(branch_ids), n=n,
                                 sampling=pb.SamplingParams(**sampling))
        if beam_width:
            req.beam_search.CopyFrom(pb.BeamSearchParams(beam_width=beam_width,
                                                         length_penalty=length_penalty))
        if append is not None:
            req.append.CopyFrom(self.prompt(append))
        if prompt is not None:
            req.prompt.CopyFrom(self.prompt(prompt))
        route = route_of_tree(tree_id) if tree_id else (
            self.prompt_route(prompt) if prompt is not None else None)
        return self.stub.Generate(req, timeout=timeout or self.timeout,
                                  metadata=self._metadata(route))

    def tree_search(self, tree_id, branch_id="", expand=2, keep=1, depth=1, score=None,
                    timeout=None, **sampling):
        """Runs a tree-of-thought BFS on the server (TreeSearch) and yields each level's
        TreeSearchLevel as it completes, then the final TreeSearchDone (the kept leaves, best
        first; they stay in the tree). Every level forks each kept node `expand` ways and
        generates one thought per child (`sampling`: max_tokens, stop, temperature, seed...).

        score=None keeps the best `keep` by logprob score (mean token logprob of the path).
        score=callable(level) -> {branch_id: score} (higher is better, one per candidate)
        scores every level on the client instead. Leaving the generator early cancels the
        search (the server prunes what it made)."""
        import queue
        requests = queue.Queue()
        mode = pb.SCORE_CLIENT if score else pb.SCORE_LOGPROB
        requests.put(pb.TreeSearchRequest(start=pb.TreeSearchStart(
            tree_id=tree_id, branch_id=branch_id, expand=expand, keep=keep, depth=depth,
            sampling=pb.SamplingParams(**sampling), score_mode=mode)))
        if not score:
            requests.put(None)  # nothing more to send: half-close after the start
        call = self.stub.TreeSearch(iter(requests.get, None), timeout=timeout or self.timeout,
                                    metadata=self._metadata(route_of_tree(tree_id)))
        try:
            for resp in call:
                kind = resp.WhichOneof("message")
                if kind == "level":
                    if score:
                        scores = {k: float(v) for k, v in score(resp.level).items()}
                        requests.put(pb.TreeSearchRequest(
                            scores=pb.TreeSearchScores(scores=scores)))
                    yield resp.level
                elif kind == "done":
                    yield resp.done
        finally:
            requests.put(None)
            call.cancel()  # a no-op once the call has ended

    def prune(self, tree_id, branch_ids, retain_kv=False):
        return self._tree_call(self.stub.Prune, pb.PruneRequest(
            tree_id=tree_id, branch_ids=list(branch_ids), retain_kv=retain_kv))

    def verify(self, tree_id, branch_id, tokens, parents, **sampling):
        return self._tree_call(self.stub.Verify, pb.VerifyRequest(
            tree_id=tree_id, branch_id=branch_id, tokens=list(tokens), parents=list(parents),
            sampling=pb.SamplingParams(**sampling)))

    def get_tree(self, tree_id, page_size=0, page_token=""):
        """One page of the tree's live branches (TreeInfo; page_size 0 = the server's default of
        1024; next_page_token is "" on the last page). tree_branches() walks every page."""
        return self._tree_call(self.stub.GetTree, pb.GetTreeRequest(
            tree_id=tree_id, page_size=page_size, page_token=page_token))

    def tree_branches(self, tree_id, page_size=0):
        """Yields every live BranchInfo of the tree, in creation order, page by page."""
        token = ""
        while True:
            info = self.get_tree(tree_id, page_size=page_size, page_token=token)
            yield from info.branches
            token = info.next_page_token
            if not token:
                return

    def list_trees(self, page_size=0, page_token=""):
        """One page of the caller's live trees (ListTreesResponse, oldest first; page_size 0 =
        the server's default of 100; next_page_token is "" on the last page). Through a proxy
        in front of several replicas it lists the trees of the replica it reaches."""
        return self._call(self.stub.ListTrees, pb.ListTreesRequest(
            page_size=page_size, page_token=page_token))

    def trees(self, page_size=0):
        """Yields every TreeListing of list_trees(), page by page."""
        token = ""
        while True:
            page = self.list_trees(page_size=page_size, page_token=token)
            yield from page.trees
            token = page.next_page_token
            if not token:
                return

    def delete_tree(self, tree_id):
        return self._tree_call(self.stub.DeleteTree, pb.DeleteTreeRequest(tree_id=tree_id))

    def vocab_size(self):
        """The model's vocabulary size, found by probing Detokenize (ids outside the vocabulary
        are INVALID_ARGUMENT). ServerInfo has no vocab field, so this is the portable way."""
        import grpc

        def valid(i):
            try:
                self.detokenize([i])
                return True
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    return False
                raise
        lo, hi = 0, 1 << 22   # invariant: valid(lo), not valid(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if valid(mid):
                lo = mid
            else:
                hi = mid
        return hi

    def generate_collect(self, tree_id="", branch_ids=(), **kwargs):
        """generate() drained with collect_stream(); returns {branch_id: BranchStream}."""
        return collect_stream(self.generate(tree_id, branch_ids, **kwargs))

    def wait_idle(self, timeout=5.0, interval=0.1):
        """Polls GetServerInfo until the pool is idle (free + evictable == total) or `timeout`
        passes; returns the last ServerInfo."""
        import time
        end = time.monotonic() + timeout
        while True:
            info = self.server_info()
            if is_idle(info) or time.monotonic() >= end:
                return info
            time.sleep(interval)


class BranchStream:
    """What one branch of a Generate stream produced: token ids, the perf_counter time each
    arrived, and the finish reason of its last message (finish-only messages, token_id -1,
    carry no token)."""

    __slots__ = ("branch_id", "token_ids", "times", "text", "finish_reason")

    def __init__(self, branch_id):
        self.branch_id = branch_id
        self.token_ids = []
        self.times = []
        self.text = []
        self.finish_reason = pb.FINISH_NONE

    def gaps(self):
        """Seconds between consecutive tokens of this branch (inter-token latency)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


def collect_stream(responses, clock=None):
    """Drains a Generate stream into {branch_id: BranchStream} (insertion-ordered).

    `clock` (default time.perf_counter) timestamps each message as it arrives, so the caller
    can derive time to first token and inter-token latency per branch."""
    import time
    clock = clock or time.perf_counter
    out = {}
    for m in responses:
        now = clock()
        s = out.get(m.branch_id)
        if s is None:
            s = out[m.branch_id] = BranchStream(m.branch_id)
        if m.token_id >= 0:
            s.token_ids.append(m.token_id)
            s.times.append(now)
            s.text.append(m.text)
        if m.finish_reason != pb.FINISH_NONE:
            s.finish_reason = m.finish_reason
    return out


def _is_messages(prompt):
    """Whether a prompt is chat messages (a non-empty list of dicts), not text or token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)


def finish_reason_name(value):
    return pb.FinishReason.Name(value)


def kv_pages_in_use(info):
    """Pages referenced by live trees/branches: neither free nor evictable radix cache."""
    return info.kv_pages_total - info.kv_pages_free - info.kv_pages_evictable


def is_idle(info):
    return info.kv_pages_free + info.kv_pages_evictable == info.kv_pages_total
