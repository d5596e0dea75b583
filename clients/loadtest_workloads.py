"""The decoding workloads (DeFT's) and serving workloads (FastTree's), replayed over treeserve's
real gRPC API.

Each workload is a class with `units(ctx)`, which returns the logical requests to run as
callables; loadtest.py runs them on a thread pool and `ctx` (a loadtest.RunContext) supplies
the client, parameters, seeded prompt material, the recorder and the tree tracker that
guarantees every tree is deleted. Its `presets` (parameters at --scale small and full) and
`needs_data`, and the parameter table PARAMS, come from loadtest_presets.json beside this
file, which the C++ client (clients/cpp) compiles in: one table for both clients.

Workloads and what one request (unit) is:
  fewshot      one tree: a shared prompt of P tokens, forked b ways, each branch decodes T.
  tot          one tree-of-thought BFS problem replayed from deft-templates/reasoning/*.json
               (client-driven Branch/Generate/Prune, or with --server-side-search one
               TreeSearch call of the template's shape).
  speculative  one prompt of deft-templates/speculative/APPS_tree_size*.json: Verify the
               whole Medusa token tree every step.
  multilevel, multidoc, multichain, multifewshot
               one serving request (FastTree's workloads): a prompt built from shared
               segments (system prompt levels, documents, few-shot sets) plus a private
               question, decoded by 1 (or `chains`) branches.
"""
import json
import os
import time

import grpc


def _ints(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def _run_generate(ctx, tree_id, branch_ids, max_tokens, seed):
    """One Generate call, recorded: returns (streams, first_token_time or None, tokens)."""
    streams = ctx.client.generate_collect(tree_id, branch_ids, max_tokens=max_tokens,
                                          **ctx.sampling(seed))
    first, tokens = None, 0
    for s in streams.values():
        ctx.rec.add_itl(s.gaps(), s.times[1:])
        ctx.rec.finish(s.finish_reason)
        tokens += len(s.token_ids)
        if s.times and (first is None or s.times[0] < first):
            first = s.times[0]
    return streams, first, tokens


class FewShot:
    """Few-shot prompting (DeFT): a P-token prompt forked b ways, each branch decoding T
    tokens. With requests > 1 every tree uses the same prompt, so later trees also hit the
    radix cache (cross-request prefix sharing)."""
    name = "fewshot"
    def units(self, ctx):
        p = ctx.params
        prompt = ctx.segment("fewshot-prompt", p["prompt_tokens"])
        return [lambda i=i: self._one(ctx, i, prompt) for i in range(p["requests"])]

    def _one(self, ctx, i, prompt):
        p = ctx.params
        t0 = time.perf_counter()
        with ctx.tree(prompt) as (tree, root):
            branches = ctx.client.branch(tree, root, p["branches"])
            _, first, tokens = _run_generate(ctx, tree, branches, p["gen_tokens"], i)
        ctx.rec.request(t0, first, time.perf_counter(), tokens)


class TreeOfThought:
    """Tree-of-thought BFS (DeFT's reasoning templates): prefill the prompt, branch node 0
    into its children, decode each child for its `value` tokens (capped by max_node_tokens),
    prune the childless ones, branch the survivors into their children, and so on.

    With server_side_search the server runs the BFS (one TreeSearch call, logprob scoring) in
    the template's shape: expand = the most children of an expanded node, keep = the most
    expanded nodes of a level, depth = the levels below the root, and every thought the
    median node `value` tokens (capped by max_node_tokens). Its TTFT is the time to the
    first level (thoughts are not streamed token by token, so there is no ITL)."""
    name = "tot"
    def units(self, ctx):
        p = ctx.params
        path = os.path.join(ctx.workloads_dir, "deft-templates", "reasoning",
                            p["template"] + ".json")
        if not os.path.exists(path):
            raise SystemExit("tot: template %s not found (choose with --template; have: %s)" % (
                path, ", ".join(sorted(f[:-5] for f in os.listdir(os.path.dirname(path))))))
        with open(path) as f:
            items = [it for it in json.load(f) if it.get("data") and "0" in it["data"]]
        items = items[:p["problems"]]
        ctx.rec.note("template", path)
        return [lambda i=i, it=it: self._one(ctx, i, it) for i, it in enumerate(items)]

    def _node_tokens(self, ctx, node):
        cap = ctx.params["max_node_tokens"]
        v = max(1, int(node["value"]))
        return min(v, cap) if cap > 0 else v

    def _one(self, ctx, i, item):
        p, data = ctx.params, item["data"]
        if ctx.text_mode:
            prompt = item["prompt"]
            if p["max_prompt_tokens"] > 0:   # ~4 characters per token
                prompt = prompt[:4 * p["max_prompt_tokens"]]
        else:
            n = int(data["0"]["value"])
            if p["max_prompt_tokens"] > 0:
                n = min(n, p["max_prompt_tokens"])
            prompt = ctx.segment("tot-%d" % i, n)
        if p["server_side_search"]:
            return self._one_server_side(ctx, i, data, prompt)
        t0 = time.perf_counter()
        first, tokens, depth = None, 0, 0
        with ctx.tree(prompt) as (tree, root):
            level = [("0", root)]   # (node id, branch id) of the nodes to expand
            while level and not ctx.over_budget():
                children = []
                for node, branch in level:
                    kids = [str(c) for c in data[node]["children"] if str(c) in data]
                    ids = ctx.client.branch(tree, branch, len(kids))
                    children += list(zip(kids, ids))
                ctx.rec.count("tot_branches", len(children))
                # One Generate per distinct token budget, all in flight together (they share
                # decode steps on the server).
                groups = {}
                for node, branch in children:
                    groups.setdefault(self._node_tokens(ctx, data[node]), []).append(branch)
                results = ctx.parallel([
                    (lambda n=n, bs=bs: _run_generate(ctx, tree, bs, n, i * 1000 + depth))
                    for n, bs in groups.items()])
                for _, f, t in results:
                    tokens += t
                    if f is not None and (first is None or f < first):
                        first = f
                survivors = [(n, b) for n, b in children if data[n]["children"]]
                dead = [b for n, b in children if not data[n]["children"]]
                if dead:
                    ctx.client.prune(tree, dead)
                    ctx.rec.count("tot_pruned", len(dead))
                level, depth = survivors, depth + 1
        ctx.rec.count("tot_levels", depth)
        ctx.rec.request(t0, first, time.perf_counter(), tokens)

    def _shape(self, ctx, data):
        """(expand, keep, depth, tokens per thought) of a recorded search tree."""
        expand = keep = depth = 0
        values = []
        level = ["0"]
        while True:
            expanded = [n for n in level if data[n]["children"]]
            children = [str(c) for n in expanded for c in data[n]["children"] if str(c) in data]
            if not children:
                break
            expand = max([expand] + [len(data[n]["children"]) for n in expanded])
            keep = max(keep, len(expanded))
            values += [self._node_tokens(ctx, data[c]) for c in children]
            level, depth = children, depth + 1
        values.sort()
        return expand, keep, depth, values[len(values) // 2]

    def _one_server_side(self, ctx, i, data, prompt):
        expand, keep, depth, thought_tokens = self._shape(ctx, data)
        t0 = time.perf_counter()
        first, tokens, levels = None, 0, 0
        with ctx.tree(prompt) as (tree, root):
            search = ctx.client.tree_search(tree, root, expand=expand, keep=keep, depth=depth,
                                            max_tokens=thought_tokens, **ctx.sampling(i * 1000))
            for msg in search:
                if not hasattr(msg, "candidates"):   # the final TreeSearchDone
                    ctx.rec.count("tot_leaves", len(msg.leaves))
                    continue
                if first is None:
                    first = time.perf_counter()
                levels += 1
                for c in msg.candidates:
                    tokens += c.tokens
                    ctx.rec.finish(c.finish_reason)
                ctx.rec.count("tot_branches", len(msg.candidates))
                ctx.rec.count("tot_pruned", max(0, len(msg.candidates) - keep))
                if ctx.over_budget():
                    search.close()   # cancels the search: the server prunes what it made
                    break
        ctx.rec.count("tot_levels", levels)
        ctx.rec.request(t0, first, time.perf_counter(), tokens)


def medusa_parents(tree_structure):
    """Parent index per candidate from Medusa paths ([0, 1] = 2nd child of the 1st child);
    -1 = hangs off the branch's last token. Paths are listed parents-first."""
    index = {tuple(path): k for k, path in enumerate(tree_structure)}
    return [-1 if len(path) == 1 else index[tuple(path[:-1])] for path in tree_structure]


class Speculative:
    """Medusa token-tree replay (DeFT's APPS records): every step Verifies the whole token
    tree against the branch in one forward pass. Candidate ids are random in-vocab ids: the
    model is not the one the records were taken with, so accepted lengths will not match the
    recorded Accept_length (with a random tiny model almost nothing is accepted; each step
    still appends the bonus token). What this measures is verify latency per step."""
    name = "speculative"
    def units(self, ctx):
        p = ctx.params
        path = os.path.join(ctx.workloads_dir, "deft-templates", "speculative",
                            "APPS_tree_size%d.json" % p["tree_size"])
        if not os.path.exists(path):
            raise SystemExit("speculative: %s not found (--tree-size is one of 32, 64, 128, "
                             "256)" % path)
        with open(path) as f:
            doc = json.load(f)
        structure = doc["Tree_Structure"]
        parents = medusa_parents(structure)
        records = doc["Records"][:p["prompts"]]
        ctx.rec.note("template", path)
        ctx.rec.note("candidates_per_step", len(structure))
        ctx.rec.note("recorded_avg_accept_length",
                     sum(r["Avg_accept_length"] for r in records) / max(1, len(records)))
        return [lambda i=i, r=r: self._one(ctx, i, r, parents) for i, r in enumerate(records)]

    def _one(self, ctx, i, record, parents):
        p = ctx.params
        if ctx.text_mode:   # the recorded APPS prompt, cut at ~4 characters per token
            prompt = record["prompt"][:4 * p["prompt_tokens"]]
        else:
            prompt = ctx.segment("spec-%d" % i, p["prompt_tokens"])
        steps = len(record["Accept_length"])
        if p["steps"] > 0:
            steps = min(steps, p["steps"])
        rng = ctx.rng("spec-candidates-%d" % i)
        lo, hi = ctx.token_range
        greedy = dict(temperature=0.0)
        t0 = time.perf_counter()
        first, tokens, last = None, 0, None
        with ctx.tree(prompt) as (tree, root):
            for step in range(steps):
                if ctx.over_budget():
                    break
                cand = [rng.randrange(lo, hi) for _ in parents]
                s = time.perf_counter()
                r = ctx.client.verify(tree, root, cand, parents, **greedy)
                now = time.perf_counter()
                ctx.rec.add("verify_latency_s", now - s)
                ctx.rec.add("accepted_per_step", len(r.accepted_tokens))
                ctx.rec.add("recorded_accept_length", record["Accept_length"][step])
                if last is not None:
                    ctx.rec.add_itl([now - last], [now])
                n = len(r.accepted_tokens) + 1   # accepted path + the bonus token
                tokens += n
                first = now if first is None else first
                last = now
        ctx.rec.request(t0, first, time.perf_counter(), tokens)


class Serving:
    """FastTree's serving workloads: independent requests whose prompts are concatenations of
    shared segments plus a private question; every request is CreateTree (prefix reuse via
    the radix cache shows in cached_tokens), Branch into `chains` if > 1, Generate, DeleteTree.
    Subclasses say which segments make up request i."""

    def segments(self, ctx, i):
        raise NotImplementedError

    def units(self, ctx):
        p = ctx.params
        return [lambda i=i: self._one(ctx, i) for i in range(p["requests"])]

    def _one(self, ctx, i):
        p = ctx.params
        prompt = ctx.join([ctx.segment(key, n) for key, n in self.segments(ctx, i)])
        chains = p.get("chains", 1)
        t0 = time.perf_counter()
        with ctx.tree(prompt) as (tree, root):
            branches = ctx.client.branch(tree, root, chains) if chains > 1 else [root]
            _, first, tokens = _run_generate(ctx, tree, branches, p["gen_tokens"], i)
        ctx.rec.request(t0, first, time.perf_counter(), tokens)


class MultiLevel(Serving):
    """Multi-level system prompt: level k has fanout[k] variants; request i uses variant
    (i mod fanout[k]) at level k (fanouts nest, so requests form a prefix tree), then a
    private question."""
    name = "multilevel"
    def segments(self, ctx, i):
        levels, fanout = _ints(ctx.params["levels"]), _ints(ctx.params["fanout"])
        if len(fanout) != len(levels):
            raise SystemExit("multilevel: --levels and --fanout need the same count")
        segs, path = [], ""
        for k, n in enumerate(levels):
            path += "/%d" % (i % fanout[k])
            segs.append(("level%d%s" % (k, path), n))
        return segs + [("question-%d" % i, ctx.params["question_tokens"])]


class MultiDoc(Serving):
    """Multi-document QA: a system prompt, then a document set (docs_per_set documents drawn
    from a pool of doc_pool documents), then a private question; questions_per_set
    questions per set, doc_sets sets."""
    name = "multidoc"
    def units(self, ctx):
        p = ctx.params
        p["requests"] = p["doc_sets"] * p["questions_per_set"]
        return super().units(ctx)

    def segments(self, ctx, i):
        p = ctx.params
        doc_set = i % p["doc_sets"]
        docs = ctx.rng("docset-%d" % doc_set).sample(range(p["doc_pool"]),
                                                     min(p["docs_per_set"], p["doc_pool"]))
        return ([("system", p["system_tokens"])] +
                [("doc-%d" % d, p["doc_tokens"]) for d in docs] +
                [("question-%d" % i, p["question_tokens"])])


class MultiChain(Serving):
    """Multi-chain reasoning: a shared system/few-shot prompt and a question per request,
    decoded by `chains` chains (self-consistency); questions x chains sequences in all."""
    name = "multichain"
    def segments(self, ctx, i):
        p = ctx.params
        return [("system", p["system_tokens"]), ("question-%d" % i, p["question_tokens"])]


class MultiFewShot(Serving):
    """Multiple few-shot learning: a system prompt, one of `combos` few-shot example sets,
    then a private question; questions_per_combo questions per set."""
    name = "multifewshot"
    def units(self, ctx):
        p = ctx.params
        p["requests"] = p["combos"] * p["questions_per_combo"]
        return super().units(ctx)

    def segments(self, ctx, i):
        p = ctx.params
        return [("system", p["system_tokens"]),
                ("fewshot-%d" % (i % p["combos"]), p["fewshot_tokens"]),
                ("question-%d" % i, p["question_tokens"])]


def _load_presets(path, implementations):
    """WORKLOADS (name -> workload, with its presets and needs_data set) and PARAMS
    (name -> (type, help)) from loadtest_presets.json. A workload in the file without a class
    here, or a class without presets, is an error: both clients must run the same set."""
    with open(path) as f:
        doc = json.load(f)
    by_name = {w.name: w for w in implementations}
    if set(doc["workloads"]) != set(by_name):
        raise RuntimeError("%s and loadtest_workloads.py disagree on the workloads: only in "
                           "the file %s, only in the code %s" % (
                               path, sorted(set(doc["workloads"]) - set(by_name)),
                               sorted(set(by_name) - set(doc["workloads"]))))
    workloads = {}
    for name, spec in doc["workloads"].items():
        w = by_name[name]
        w.needs_data = spec["needs_data"]
        w.presets = {"small": spec["small"], "full": spec["full"]}
        workloads[name] = w
    types = {"int": int, "str": str, "bool": bool}   # bool: a switch (store_const True)
    params = {p["name"]: (types[p["type"]], p["help"]) for p in doc["params"]}
    return workloads, params


# WORKLOADS: name -> workload (the file's order); PARAMS: parameter name -> (type, help) for
# the command-line overrides of every preset.
WORKLOADS, PARAMS = _load_presets(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "loadtest_presets.json"),
    (FewShot(), TreeOfThought(), Speculative(), MultiLevel(), MultiDoc(), MultiChain(),
     MultiFewShot()))


def is_rpc_error(e):
    return isinstance(e, grpc.RpcError)
