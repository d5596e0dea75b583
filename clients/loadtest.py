"""Load test for treeserve over its real gRPC API: decoding-tree and serving workloads.

    /usr/bin/python3 clients/loadtest.py --target 127.0.0.1:50051 --workload fewshot --scale small
    /usr/bin/python3 clients/loadtest.py --workload multilevel --scale full --json out.json \
        --plot out.png

Workloads (see loadtest_workloads.py): fewshot, tot, speculative, multilevel, multidoc,
multichain, multifewshot. --scale picks a preset; any preset parameter can be overridden
(--branches 30, --gen-tokens 100, ...). Prints throughput (generated tokens/s), time to first
token, inter-token latency and request latency (p50/p99), and KV pages in use over time
(GetServerInfo polled on a background thread); --json writes everything, --plot draws latency
and KV pages over time (needs matplotlib). Every tree it creates is deleted at the end, and
it checks the server's pool returns to idle.

--target may be a proxy in front of several replicas (every call carries x-treeserve-route,
so each tree's calls reach its replica). GetServerInfo through a proxy reaches one replica,
so the pool checks then read the replicas directly: --replicas HOST:PORT,... sums their
pools; --proxy without --replicas skips the checks, saying so.
"""
import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "python")]  # the treeserve package, uninstalled
from loadtest_workloads import PARAMS, WORKLOADS, is_rpc_error  # noqa: E402
from plot_loadtest import plot  # noqa: E402  (the same figure for a saved --json)
from treeserve import (TreeServeClient, finish_reason_name, is_idle,  # noqa: E402
                       kv_pages_in_use)

DEFAULT_WORKLOADS_DIR = os.path.normpath(os.path.join(_HERE, "..", "bench", "workloads"))


def percentile(values, q):
    """Linear-interpolated percentile (q in [0, 100]) of a list; None when empty."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summary(values):
    if not values:
        return {"count": 0, "p50": None, "p99": None, "mean": None, "max": None}
    return {"count": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "mean": sum(values) / len(values), "max": max(values)}


class Recorder:
    """Thread-safe sink for what the workloads measure. Times are perf_counter values."""

    def __init__(self, t0):
        self.t0 = t0
        self.lock = threading.Lock()
        self.requests = []      # (start, first_token or None, end, tokens), relative to t0
        self.itl = []
        self.itl_points = []    # (arrival time relative to t0, gap) for the plot
        self.counters = {}
        self.lists = {}
        self.notes = {}
        self.finish_reasons = {}
        self.errors = []

    def request(self, start, first, end, tokens):
        with self.lock:
            self.requests.append((start - self.t0, None if first is None else first - self.t0,
                                  end - self.t0, tokens))

    def add_itl(self, gaps, times=None):
        """Inter-token gaps; `times` (perf_counter) are the arrivals that closed them."""
        with self.lock:
            self.itl.extend(gaps)
            if times is not None:
                self.itl_points.extend((t - self.t0, g) for t, g in zip(times, gaps))

    def finish(self, reason):
        name = finish_reason_name(reason)
        with self.lock:
            self.finish_reasons[name] = self.finish_reasons.get(name, 0) + 1

    def count(self, key, n=1):
        with self.lock:
            self.counters[key] = self.counters.get(key, 0) + n

    def add(self, key, value):
        with self.lock:
            self.lists.setdefault(key, []).append(value)

    def note(self, key, value):
        with self.lock:
            self.notes[key] = value

    def error(self, what):
        with self.lock:
            self.errors.append(what)


class Pool:
    """The KV pool the checks read: one server's, or the sum over replicas' (each read
    directly, not through a proxy). server_info() is a ServerInfo with the counts summed."""

    def __init__(self, targets, auth_token=None, timeout=None):
        self.targets = list(targets)
        self.clients = [TreeServeClient(t, auth_token=auth_token, timeout=timeout)
                        for t in self.targets]

    def server_info(self):
        infos = [c.server_info() for c in self.clients]
        out = type(infos[0])()
        out.CopyFrom(infos[0])
        for i in infos[1:]:
            for f in ("kv_pages_total", "kv_pages_free", "kv_pages_evictable",
                      "radix_cached_tokens", "live_trees", "live_branches", "decode_steps"):
                setattr(out, f, getattr(out, f) + getattr(i, f))
        out.replica_id = ",".join(i.replica_id for i in infos)
        return out

    # The client's poll until idle, over this server_info.
    wait_idle = TreeServeClient.wait_idle


class KvMonitor(threading.Thread):
    """Polls GetServerInfo of the pool every `interval` seconds: (t, pages in use, evictable,
    free, live trees, live branches, decode steps)."""

    def __init__(self, pool, t0, interval):
        super().__init__(daemon=True)
        self.client = pool
        self.t0, self.interval = t0, interval
        self.samples = []
        self.stop_event = threading.Event()

    def sample(self):
        i = self.client.server_info()
        self.samples.append((time.perf_counter() - self.t0, kv_pages_in_use(i),
                             i.kv_pages_evictable, i.kv_pages_free, i.live_trees,
                             i.live_branches, i.decode_steps))

    def run(self):
        while not self.stop_event.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed poll must not stop the load test
                pass
            self.stop_event.wait(self.interval)

    def stop(self):
        self.stop_event.set()
        self.join()
        with contextlib.suppress(Exception):
            self.sample()


class RunContext:
    """What a workload unit sees: the client, its parameters, seeded prompt material, the
    recorder, a tree tracker (every created tree is deleted even when a unit fails) and the
    time budget."""

    def __init__(self, client, params, args, vocab, rec):
        self.client, self.params, self.rec = client, params, rec
        self.seed = args.seed
        self.text_mode = args.prompt_kind == "text"
        self.workloads_dir = args.workloads_dir
        self.temperature = args.temperature
        self.vocab = vocab
        # Random ids skip the first 3 (unk/bos/eos in sentencepiece vocabularies) and, for big
        # vocabularies, the last 256 (where Llama 3 keeps its special tokens).
        self.token_range = (3, vocab - 256 if vocab > 4096 else vocab)
        self.deadline = (time.perf_counter() + args.time_budget) if args.time_budget else None
        self.lock = threading.Lock()
        self.segments = {}
        self.live_trees = set()
        self.created_trees = 0

    def rng(self, key):
        return random.Random("%d:%s" % (self.seed, key))

    def segment(self, key, n):
        """n seeded random in-vocab token ids named by `key` (the same key gives the same
        tokens, which is how requests share prefixes); text of them in --prompt-kind text."""
        with self.lock:
            if key in self.segments:
                return self.segments[key]
        r = self.rng(key)
        lo, hi = self.token_range
        seg = [r.randrange(lo, hi) for _ in range(n)]
        if self.text_mode:
            seg = self.client.detokenize(seg)
        with self.lock:
            return self.segments.setdefault(key, seg)

    def join(self, segs):
        return "".join(segs) if self.text_mode else [t for s in segs for t in s]

    def sampling(self, seed):
        return dict(temperature=self.temperature, seed=self.seed * 1000003 + seed)

    def over_budget(self):
        return self.deadline is not None and time.perf_counter() >= self.deadline

    @contextlib.contextmanager
    def tree(self, prompt):
        """CreateTree; yields (tree_id, root_branch_id); DeleteTree on the way out."""
        r = self.client.create_tree(prompt)
        with self.lock:
            self.live_trees.add(r.tree_id)
            self.created_trees += 1
        self.rec.count("prompt_tokens", r.prompt_tokens)
        self.rec.count("cached_tokens", r.cached_tokens)
        try:
            yield r.tree_id, r.root_branch_id
        finally:
            self.client.delete_tree(r.tree_id)
            with self.lock:
                self.live_trees.discard(r.tree_id)

    def parallel(self, fns):
        """Runs callables on threads of their own; returns their results in order."""
        if len(fns) == 1:
            return [fns[0]()]
        with ThreadPoolExecutor(max_workers=len(fns)) as ex:
            return [f.result() for f in [ex.submit(fn) for fn in fns]]

    def delete_leftovers(self):
        """Deletes trees a failed or interrupted unit left behind; returns how many."""
        with self.lock:
            left = list(self.live_trees)
        for t in left:
            with contextlib.suppress(Exception):
                self.client.delete_tree(t)
        return len(left)


def run_units(ctx, units, concurrency, warmup=0):
    """Runs the first `warmup` units one at a time, then the rest on `concurrency` threads;
    units not started when the time budget runs out are skipped. Returns (wall seconds,
    units run, units skipped)."""
    started = [0]
    lock = threading.Lock()

    def guarded(unit):
        if ctx.over_budget():
            return False
        with lock:
            started[0] += 1
        try:
            unit()
        except Exception as e:
            if not is_rpc_error(e):
                raise
            ctx.rec.error("%s: %s" % (e.code().name, e.details()))
        return True

    t0 = time.perf_counter()
    ran = []
    ex = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        ran += [guarded(u) for u in units[:warmup]]
        futures = [ex.submit(guarded, u) for u in units[warmup:]]
        ran += [f.result() for f in futures]
    except KeyboardInterrupt:
        # Start nothing new; deleting the live trees ends the streams still in flight.
        ctx.deadline = 0
        print("interrupted: deleting this run's trees", file=sys.stderr)
        ctx.delete_leftovers()
        ex.shutdown(wait=True, cancel_futures=True)
        ctx.rec.error("INTERRUPTED: stopped by the user")
    finally:
        ex.shutdown(wait=True)
    return time.perf_counter() - t0, sum(ran), len(units) - sum(ran)


def build_results(args, workload, params, info, rec, mon, wall, ran, skipped, idle_info, leaks):
    reqs = rec.requests
    tokens = sum(r[3] for r in reqs)
    used = [s[1] for s in mon.samples]
    res = {
        "workload": workload.name, "scale": args.scale, "params": params,
        "target": args.target, "prompt_kind": args.prompt_kind, "warmup": args.warmup,
        "seed": args.seed, "pool_checked": pool_targets(args),
        "server": {"model": info.model, "backend": info.backend, "page_size": info.page_size,
                   "kv_pages_total": info.kv_pages_total,
                   "tensor_parallel": info.tensor_parallel},
        "wall_s": wall, "requests_completed": len(reqs), "requests_started": ran,
        "requests_skipped": skipped, "errors": rec.errors,
        "generated_tokens": tokens,
        "throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": summary([r[1] - r[0] for r in reqs if r[1] is not None]),
        "itl_s": summary(rec.itl),
        "request_latency_s": summary([r[2] - r[0] for r in reqs]),
        "kv_pages": {"min": min(used) if used else None, "max": max(used) if used else None,
                     "mean": sum(used) / len(used) if used else None,
                     "peak_occupied": max((s[1] + s[2] for s in mon.samples), default=None),
                     "total": info.kv_pages_total, "samples": len(used)},
        "decode_steps": (mon.samples[-1][6] - mon.samples[0][6]) if len(mon.samples) > 1 else None,
        "prompt_tokens": rec.counters.get("prompt_tokens", 0),
        "cached_tokens": rec.counters.get("cached_tokens", 0),
        "finish_reasons": rec.finish_reasons,
        "counters": {k: v for k, v in rec.counters.items()
                     if k not in ("prompt_tokens", "cached_tokens")},
        "notes": rec.notes,
        "lists": {k: summary(v) for k, v in rec.lists.items()},
        # None: not checked (--proxy without --replicas)
        "idle_after": None if idle_info is None else (
            is_idle(idle_info) and idle_info.live_trees == 0),
        "idle_state": None if idle_info is None else {
            "kv_pages_free": idle_info.kv_pages_free,
            "kv_pages_evictable": idle_info.kv_pages_evictable,
            "kv_pages_total": idle_info.kv_pages_total,
            "live_trees": idle_info.live_trees,
            "live_branches": idle_info.live_branches},
        "leftover_trees_deleted": leaks,
        "timeline": {
            "kv": [[round(s[0], 4), s[1], s[2]] for s in mon.samples],
            "requests": [[round(r[2], 4), round(r[2] - r[0], 4),
                          None if r[1] is None else round(r[1] - r[0], 4)] for r in reqs],
            # [t, gap], thinned to at most ~5000 points
            "itl": [[round(t, 4), round(g, 5)] for t, g in
                    sorted(rec.itl_points)[::max(1, len(rec.itl_points) // 5000)]],
        },
    }
    if "accepted_per_step" in rec.lists:
        acc = rec.lists["accepted_per_step"]
        res["speculative"] = {
            "verify_steps": len(acc),
            "mean_accepted_per_step": sum(acc) / len(acc),
            "recorded_mean_accept_length": rec.notes.get("recorded_avg_accept_length"),
            "verify_latency_s": summary(rec.lists["verify_latency_s"]),
            "note": "candidate ids are random and the model is not the recorded one, so "
                    "accepted lengths do not follow the recorded Accept_length",
        }
    return res


def ms(x):
    return "-" if x is None else "%.1f ms" % (1000 * x)


def print_results(res):
    p = res["params"]
    print("workload %s (scale %s, %s prompts) on %s: model=%s backend=%s" % (
        res["workload"], res["scale"], res["prompt_kind"], res["target"],
        res["server"]["model"], res["server"]["backend"]))
    print("  params: " + ", ".join("%s=%s" % kv for kv in sorted(p.items())))
    print("  requests: %d completed, %d not run (time budget), %d errors; wall %.2f s" % (
        res["requests_completed"], res["requests_skipped"], len(res["errors"]), res["wall_s"]))
    print("  throughput: %.1f generated tokens/s (%d tokens); prompt tokens %d, cached %d" % (
        res["throughput_tok_s"], res["generated_tokens"], res["prompt_tokens"],
        res["cached_tokens"]))
    for key, label in (("ttft_s", "time to first token"), ("itl_s", "inter-token latency"),
                       ("request_latency_s", "request latency")):
        s = res[key]
        print("  %-20s p50 %s  p99 %s  (n=%d)" % (label + ":", ms(s["p50"]), ms(s["p99"]),
                                                  s["count"]))
    kv = res["kv_pages"]
    if kv["samples"]:
        print("  KV pages in use: min %d  mean %.1f  max %d  of %d (peak incl. evictable "
              "cache %d; %d samples)" % (kv["min"], kv["mean"], kv["max"], kv["total"],
                                         kv["peak_occupied"], kv["samples"]))
    if res.get("decode_steps") is not None:
        print("  decode steps: %d" % res["decode_steps"])
    if res["finish_reasons"]:
        print("  finish reasons: " + ", ".join("%s=%d" % kv
                                               for kv in sorted(res["finish_reasons"].items())))
    if res["counters"]:
        print("  counters: " + ", ".join("%s=%d" % kv for kv in sorted(res["counters"].items())))
    if "speculative" in res:
        s = res["speculative"]
        print("  verify: %d steps, latency p50 %s p99 %s; accepted/step %.2f (recorded "
              "Medusa mean %.2f; %s)" % (s["verify_steps"], ms(s["verify_latency_s"]["p50"]),
                                         ms(s["verify_latency_s"]["p99"]),
                                         s["mean_accepted_per_step"],
                                         s["recorded_mean_accept_length"] or 0, s["note"]))
    for e in res["errors"][:10]:
        print("  error: " + e)


def check_plot_available():
    import importlib
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which %s cannot import (Debian: apt-get "
                         "install python3-matplotlib)" % sys.executable)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051",
                    help="server host:port, or a proxy's in front of several replicas")
    ap.add_argument("--replicas", default="",
                    help="the replicas' own host:port, comma-separated: the pool checks (idle "
                         "at start and end, KV pages over time) sum their GetServerInfo "
                         "(default: --target's)")
    ap.add_argument("--proxy", action="store_true",
                    help="--target is a proxy: without --replicas the pool checks are skipped "
                         "(through a proxy GetServerInfo reaches one replica)")
    ap.add_argument("--auth-token", default=None)
    ap.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    ap.add_argument("--scale", default="small", choices=["small", "full"])
    ap.add_argument("--workloads-dir", default=DEFAULT_WORKLOADS_DIR,
                    help="folder holding deft-templates/ (default %(default)s)")
    ap.add_argument("--prompt-kind", default="tokens", choices=["tokens", "text"],
                    help="prompts as random in-vocab token ids, or as text (tot/speculative "
                         "use the recorded prompt text; text prompts get BOS prepended)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0 = probe server)")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds after which no new request (or ToT level / verify step) "
                         "starts; 0 = none")
    ap.add_argument("--warmup", type=int, default=0,
                    help="run the first N requests one at a time before the concurrent rest "
                         "(they fill the radix cache with the shared prefixes; counted in "
                         "the figures)")
    ap.add_argument("--poll-interval", type=float, default=0.1,
                    help="GetServerInfo polling period in seconds")
    ap.add_argument("--idle-timeout", type=float, default=10,
                    help="seconds to wait for the pool to return to idle at the end")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="PNG of latency and KV pages over time (needs matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no summary on stdout")
    for name, (typ, help_text) in sorted(PARAMS.items()):
        if typ is bool:   # a switch: on when given, else the preset's value
            ap.add_argument("--" + name.replace("_", "-"), dest="p_" + name,
                            action="store_const", const=True, default=None, help=help_text)
            continue
        ap.add_argument("--" + name.replace("_", "-"), dest="p_" + name, type=typ,
                        default=None, metavar=name.upper(), help=help_text)
    return ap.parse_args(argv)


def pool_targets(args):
    """The addresses whose pools the checks sum; None: the checks are skipped."""
    if args.replicas:
        return [t.strip() for t in args.replicas.split(",") if t.strip()]
    return None if args.proxy else [args.target]


def main(argv=None):
    args = parse_args(argv)
    workload = WORKLOADS[args.workload]
    if args.plot:
        check_plot_available()
    if workload.needs_data and not os.path.isdir(os.path.join(args.workloads_dir,
                                                              "deft-templates")):
        print("error: workload %s needs the DeFT templates, but %s has no deft-templates/ "
              "folder (pass --workloads-dir)" % (workload.name, args.workloads_dir),
              file=sys.stderr)
        return 2
    params = dict(workload.presets[args.scale])
    for name in PARAMS:
        v = getattr(args, "p_" + name)
        if v is not None:
            params[name] = v

    client = TreeServeClient(args.target, auth_token=args.auth_token)
    try:
        info = client.server_info()
    except Exception as e:
        if not is_rpc_error(e):
            raise
        print("error: cannot reach treeserve at %s: %s" % (args.target, e.details()),
              file=sys.stderr)
        return 2
    targets = pool_targets(args)
    pool = None
    if targets is None:
        print("note: --proxy without --replicas: GetServerInfo through the proxy reaches one "
              "replica, so the pool checks (idle at start and end, KV pages over time) are "
              "skipped; pass --replicas HOST:PORT,... to sum the replicas' pools",
              file=sys.stderr)
    else:
        pool = Pool(targets, auth_token=args.auth_token, timeout=10)
        try:
            pool_info = pool.server_info()
        except Exception as e:
            if not is_rpc_error(e):
                raise
            print("error: cannot reach a replica of %s: %s" % (",".join(targets), e.details()),
                  file=sys.stderr)
            return 2
        if not is_idle(pool_info) or pool_info.live_trees:
            print("warning: server is not idle at start (%d trees, %d pages in use); figures "
                  "include other clients' load" % (pool_info.live_trees,
                                                   kv_pages_in_use(pool_info)),
                  file=sys.stderr)
        info = pool_info
    vocab = args.vocab or client.vocab_size()
    t0 = time.perf_counter()
    rec = Recorder(t0)
    ctx = RunContext(client, params, args, vocab, rec)
    units = workload.units(ctx)
    mon = KvMonitor(pool, t0, args.poll_interval)
    if pool is not None:
        mon.start()
    leaks = 0
    try:
        wall, ran, skipped = run_units(ctx, units, params.get("concurrency", 1), args.warmup)
    finally:
        leaks = ctx.delete_leftovers()
        if pool is not None:
            mon.stop()
    idle_info = pool.wait_idle(timeout=args.idle_timeout) if pool is not None else None
    res = build_results(args, workload, params, info, rec, mon, wall, ran, skipped,
                        idle_info, leaks)
    if not args.quiet:
        print_results(res)
    elif rec.errors:
        for e in rec.errors[:10]:
            print("error: " + e, file=sys.stderr)
    if res["idle_after"] is False:
        s = res["idle_state"]
        print("warning: server did not return to idle: free %d + evictable %d != total %d, "
              "%d live trees, %d live branches" % (
                  s["kv_pages_free"], s["kv_pages_evictable"], s["kv_pages_total"],
                  s["live_trees"], s["live_branches"]), file=sys.stderr)
    if leaks:
        print("warning: %d trees were left by failed requests and deleted at the end" % leaks,
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        plot(res, args.plot)
        if not args.quiet:
            print("  plot: " + args.plot)
    return 1 if rec.errors or not rec.requests else 0


if __name__ == "__main__":
    sys.exit(main())
