#!/usr/bin/python3
"""Soak: several tenants drive random tree operations against one treeserve process for a
given time, with cancels, disconnects, deadlines, abandoned trees left to their leases, calls
on other tenants' trees, and a server kill and restart every --kill-every seconds. Prints the
operations, the errors by status code, the server's RSS slope per run (after a warm-up) and
whether the KV pool ends balanced (every page free or evictable, no live tree or branch).

    /usr/bin/python3 bench/soak/soak.py --binary build/bin/treeserve --duration 1800 \\
        --json soak.json

Exit status 1 when a call failed with a code that signals a server fault (INTERNAL, UNKNOWN,
DATA_LOSS), when the server died without being killed, or when the pool is not balanced at
the end. Runs on Debian's /usr/bin/python3 with python3-grpcio (the package in clients/python
is imported from the checkout).
"""
import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "clients", "python"))

import grpc  # noqa: E402

from treeserve import TreeServeClient, is_idle  # noqa: E402

# Codes that never come from a correct server, whatever the client does.
FAULT_CODES = {"INTERNAL", "UNKNOWN", "DATA_LOSS"}
WORDS = ("tree branch prune verify token prefix cache page radix kernel decode prompt search "
         "beam thought sample greedy leaf root shared fork merge step batch head layer").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def slope_mib_per_hour(samples):
    """Least-squares slope of (seconds, KiB) samples, in MiB per hour; None below 3 samples."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(r for _, r in samples) / n
    sxx = sum((t - mx) ** 2 for t, _ in samples)
    if sxx == 0:
        return None
    sxy = sum((t - mx) * (r - my) for t, r in samples)
    return sxy / sxx * 3600 / 1024


class Server:
    """The treeserve process: started, killed with SIGKILL, restarted on the same port."""

    def __init__(self, args, workdir):
        self.args = args
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.counters = collections.Counter()  # server counters summed over its runs
        self.keys_file = os.path.join(workdir, "keys.json")
        self.log_path = os.path.join(workdir, "server.log")
        self.proc = None
        self.runs = []  # per run: {"start": t, "rss": [(t, KiB)], "end": t, "how": ...}
        self.killing = False

    def start(self):
        cmd = [self.args.binary, "--listen", self.target, "--backend", "cpu",
               "--keys-file", self.keys_file, "--log-level", "warn",
               "--kv-cache-bytes", str(self.args.kv_cache_bytes),
               "--metrics-listen", f"127.0.0.1:{self.metrics_port}"]
        if self.args.model:
            cmd += ["--model", self.args.model]
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.runs.append({"start": time.monotonic(), "rss": [], "pid": self.proc.pid})
        self.wait_ready()

    def wait_ready(self, timeout=60):
        end = time.monotonic() + timeout
        client = TreeServeClient(self.target, auth_token=self.args.admin_key, timeout=2)
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"treeserve exited with {self.proc.returncode} at start; "
                                   f"see {self.log_path}")
            try:
                client.server_info()
                client.channel.close()
                return
            except grpc.RpcError:
                time.sleep(0.2)
        raise RuntimeError(f"treeserve not ready after {timeout} s; see {self.log_path}")

    COUNTERS = ("tree_leases_expired_total", "quota_refusals_total", "auth_failures_total",
                "fork_total", "prune_total", "generation_tokens_total", "prompt_tokens_total",
                "prefix_cache_hit_tokens_total")

    def scrape(self):
        """Adds this run's counters (from /metrics) to the totals; call before the run ends."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                     headers={"Authorization": "Bearer " + self.args.admin_key})
        try:
            text = urllib.request.urlopen(req, timeout=5).read().decode()
        except OSError as e:
            print(f"metrics: {e}", flush=True)
            return
        for line in text.splitlines():
            for name in self.COUNTERS:
                if line.startswith(f"treeserve:{name}"):
                    self.counters[name] += float(line.split()[-1])

    def kill_and_restart(self):
        self.scrape()
        self.killing = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.runs[-1]["end"] = time.monotonic()
        self.runs[-1]["how"] = "killed (SIGKILL)"
        self.killing = False
        self.start()

    def stop(self):
        self.scrape()
        self.killing = True
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = "hung; killed"
        self.runs[-1]["end"] = time.monotonic()
        self.runs[-1]["how"] = f"SIGTERM, exit {code}"
        return code

    def died_unexpectedly(self):
        return (not self.killing and self.proc is not None and self.proc.poll() is not None)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = collections.Counter()
        self.errors = collections.Counter()  # (op, code) -> n
        self.fault_messages = []
        self.samples = {}  # (op, code) -> the first message seen

    def ok(self, op):
        with self.lock:
            self.ops[op] += 1

    def error(self, op, e):
        code = e.code().name if hasattr(e, "code") and e.code() else "UNKNOWN"
        with self.lock:
            self.ops[op] += 1
            self.errors[(op, code)] += 1
            self.samples.setdefault((op, code), e.details() if hasattr(e, "details") else str(e))
            if code in FAULT_CODES and len(self.fault_messages) < 20:
                self.fault_messages.append(f"{op}: {code}: {e.details()}")


class Worker(threading.Thread):
    """One client of one tenant: random operations on its own trees."""

    def __init__(self, server, tenant, key, seed, stats, stop, all_trees):
        super().__init__(daemon=True)
        self.server, self.tenant, self.key = server, tenant, key
        self.rng = random.Random(seed)
        self.stats, self.stop = stats, stop
        self.all_trees = all_trees  # shared {tree_id: tenant}, for cross-tenant probes
        self.trees = {}  # tree_id -> [live branch ids]
        self.client = None
        self._run = len(server.runs)  # the server run this client's trees belong to

    def connect(self):
        if self.client:
            self.client.channel.close()
        self.client = TreeServeClient(self.server.target, auth_token=self.key, timeout=20)

    def prompt(self):
        # Half the prompts share a tenant-wide prefix, so the prefix cache is exercised.
        words = [self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 60))]
        if self.rng.random() < 0.5:
            return f"{self.tenant} shared preamble: " + " ".join(WORDS[:20]) + " " + " ".join(words)
        return " ".join(words)

    def sampling(self):
        return dict(max_tokens=self.rng.randint(1, 24), temperature=self.rng.choice([0.0, 0.8]),
                    seed=self.rng.randint(1, 1 << 30))

    def call(self, op, fn, tree=None):
        try:
            r = fn()
            self.stats.ok(op)
            return r
        except grpc.RpcError as e:
            self.stats.error(op, e)
            self.after_error(e, tree)
            return None

    def after_error(self, e, tree):
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            time.sleep(0.2)  # the server is restarting
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
            run = len(self.server.runs)
            if self._run != run:  # the server restarted: every tree of the last run is gone
                for t in self.trees:
                    self.all_trees.pop(t, None)
                self.trees.clear()
                self._run = run
            elif tree in self.trees and e.code() == grpc.StatusCode.NOT_FOUND:
                self.refresh(tree)  # re-read the live branches (or drop a tree that is gone)

    def pick(self):
        if not self.trees:
            return None, None
        t = self.rng.choice(list(self.trees))
        live = self.trees[t]
        return t, (self.rng.choice(live) if live else None)

    def op_create(self):
        lease = self.rng.choice([0, 0, 0, 1500])  # some trees get a short lease
        r = self.call("create", lambda: self.client.create_tree(self.prompt(), lease_ms=lease))
        if r:
            self.trees[r.tree_id] = [r.root_branch_id]
            self.all_trees[r.tree_id] = self.tenant
            if lease:  # abandoned at once: the lease must delete it
                self.trees.pop(r.tree_id)

    def op_branch(self):
        t, b = self.pick()
        if not b:
            return
        r = self.call("branch", lambda: self.client.branch(t, b, self.rng.randint(1, 6)), t)
        if r:
            self.trees[t].extend(r)

    def op_generate(self, cancel=False, deadline=None):
        t, _ = self.pick()
        if not t or not self.trees[t]:
            return
        branches = self.rng.sample(self.trees[t], min(len(self.trees[t]), self.rng.randint(1, 4)))
        op = "generate_cancel" if cancel else ("generate_deadline" if deadline else "generate")
        try:
            stream = self.client.generate(t, branches, timeout=deadline, **self.sampling())
            for i, _ in enumerate(stream):
                if cancel and i >= self.rng.randint(0, 3):
                    stream.cancel()
                    break
            self.stats.ok(op)
        except grpc.RpcError as e:
            if cancel and e.code() == grpc.StatusCode.CANCELLED:
                self.stats.ok(op)
            else:
                self.stats.error(op, e)
                self.after_error(e, t)

    def op_disconnect(self):
        """A stream whose client vanishes: the channel closes under it."""
        t, _ = self.pick()
        if not t or not self.trees[t]:
            return
        c = TreeServeClient(self.server.target, auth_token=self.key, timeout=20)
        try:
            stream = c.generate(t, self.trees[t][:2], max_tokens=24)
            next(iter(stream), None)
            self.stats.ok("disconnect")
        except grpc.RpcError as e:
            self.stats.error("disconnect", e)
            self.after_error(e, t)
        finally:
            c.channel.close()

    def op_oneshot(self):
        n = self.rng.randint(1, 3)
        self.call("oneshot", lambda: list(self.client.generate(
            prompt=self.prompt(), n=n, **self.sampling())))

    def op_prune(self):
        t, b = self.pick()
        if not b or len(self.trees[t]) < 2:
            return
        if self.call("prune", lambda: self.client.prune(t, [b]), t) is not None:
            self.refresh(t)  # pruning a branch prunes its descendants too

    def op_get(self):
        t, _ = self.pick()
        if t:
            self.call("get_tree", lambda: self.client.get_tree(t, page_size=64), t)

    def op_verify(self):
        t, b = self.pick()
        if not b:
            return
        k = self.rng.randint(1, 6)
        tokens = [self.rng.randint(3, 200) for _ in range(k)]
        parents = [-1] + [self.rng.randint(-1, i - 1) for i in range(1, k)]
        self.call("verify", lambda: self.client.verify(t, b, tokens, parents), t)

    def op_search(self):
        t, b = self.pick()
        if not b:
            return
        def run():
            return list(self.client.tree_search(t, b, expand=2, keep=1, depth=2, max_tokens=4))
        r = self.call("tree_search", run, t)
        if r is not None:
            # Its losers are pruned; its kept leaves are new branches: re-read the live set.
            self.refresh(t)

    def refresh(self, t):
        try:
            self.trees[t] = [br.branch_id for br in self.client.tree_branches(t)]
        except grpc.RpcError as e:
            self.stats.error("get_tree", e)
            self.trees.pop(t, None)

    def op_delete(self):
        t, _ = self.pick()
        if t and self.call("delete", lambda: self.client.delete_tree(t), t) is not None:
            self.trees.pop(t, None)
            self.all_trees.pop(t, None)

    def op_foreign(self):
        """Another tenant's tree: must be NOT_FOUND, never served."""
        foreign = [t for t, owner in list(self.all_trees.items()) if owner != self.tenant]
        if not foreign:
            return
        t = self.rng.choice(foreign)
        try:
            self.client.get_tree(t)
            with self.stats.lock:
                self.stats.ops["foreign_tree_served"] += 1
                self.stats.fault_messages.append(f"{self.tenant} read another tenant's tree {t}")
        except grpc.RpcError as e:
            self.stats.error("foreign_get", e)

    def op_bad_key(self):
        """A call with a wrong key: UNAUTHENTICATED, counted by the server."""
        c = TreeServeClient(self.server.target, auth_token="not-a-key", timeout=5)
        try:
            c.server_info()
            with self.stats.lock:
                self.stats.ops["bad_key_served"] += 1
                self.stats.fault_messages.append("a call with a wrong key was served")
        except grpc.RpcError as e:
            self.stats.error("bad_key", e)
        finally:
            c.channel.close()

    def run(self):
        self.connect()
        ops = [(self.op_create, 12), (self.op_branch, 14), (self.op_generate, 18),
               (lambda: self.op_generate(cancel=True), 6),
               (lambda: self.op_generate(deadline=0.05), 4), (self.op_disconnect, 3),
               (self.op_oneshot, 6), (self.op_prune, 10), (self.op_get, 8),
               (self.op_verify, 5), (self.op_search, 3), (self.op_delete, 7),
               (self.op_foreign, 4), (self.op_bad_key, 1)]
        fns, weights = zip(*ops)
        while not self.stop.is_set():
            if len(self.trees) > 12:
                self.op_delete()
                continue
            for t in [t for t, b in self.trees.items() if len(b) > 40]:
                self.refresh(t)
            self.rng.choices(fns, weights)[0]()

    def cleanup(self):
        for t in list(self.trees):
            try:
                self.client.delete_tree(t)
            except grpc.RpcError:
                pass
        self.trees.clear()
        self.client.channel.close()


def write_keys(path, tenants, args):
    keys = {f"tenant-{i}": f"soak-key-{i}-{random.getrandbits(64):016x}" for i in range(tenants)}
    doc = {
        "default_quotas": {"max_live_trees": 40, "max_live_branches": 600, "kv_share": 0.5,
                           "max_concurrent_streams": 6, "requests_per_second": 400,
                           "burst": 800},
        # The first tenant's tight tree quota makes its clients meet RESOURCE_EXHAUSTED.
        "tenants": [{"name": t, "quotas": {"max_live_trees": 6} if i == 0 else {}}
                    for i, t in enumerate(keys)] + [{"name": "admin", "quotas": {
            "max_live_trees": None, "max_live_branches": None, "kv_share": None,
            "max_concurrent_streams": None, "requests_per_second": None, "burst": None}}],
        "keys": [{"tenant": t, "key": k} for t, k in keys.items()] +
                [{"tenant": "admin", "key": args.admin_key}],
    }
    with open(path, "w") as f:
        json.dump(doc, f)
    return keys


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default=os.path.join(REPO, "build", "bin", "treeserve"))
    p.add_argument("--model", default="", help="checkpoint dir (default: the built tiny model)")
    p.add_argument("--duration", type=float, default=1800, help="seconds of load")
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="clients per tenant")
    p.add_argument("--kill-every", type=float, default=600,
                   help="SIGKILL and restart the server every N seconds (0 = never)")
    p.add_argument("--warmup", type=float, default=120,
                   help="seconds of each run left out of its RSS slope")
    p.add_argument("--sample-every", type=float, default=5)
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write the report here too")
    args = p.parse_args()
    args.admin_key = f"soak-admin-{random.getrandbits(64):016x}"

    workdir = tempfile.mkdtemp(prefix="treeserve-soak-")
    server = Server(args, workdir)
    keys = write_keys(server.keys_file, args.tenants, args)
    server.start()
    stats, stop, all_trees = Stats(), threading.Event(), {}
    workers = [Worker(server, tenant, key, args.seed * 1000 + i * 10 + j, stats, stop, all_trees)
               for i, (tenant, key) in enumerate(keys.items()) for j in range(args.workers)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    admin = TreeServeClient(server.target, auth_token=args.admin_key, timeout=5)
    next_kill = t0 + args.kill_every if args.kill_every > 0 else float("inf")
    next_report = t0 + 60
    crashed = None
    while time.monotonic() - t0 < args.duration:
        time.sleep(args.sample_every)
        now = time.monotonic()
        if server.died_unexpectedly():
            crashed = f"treeserve exited with {server.proc.returncode} (not killed by the soak)"
            break
        r = rss_kib(server.proc.pid)
        if r is not None:
            server.runs[-1]["rss"].append((now - t0, r))
        if now >= next_kill and now - t0 < args.duration - args.kill_every / 2:
            server.kill_and_restart()
            admin.channel.close()
            admin = TreeServeClient(server.target, auth_token=args.admin_key, timeout=5)
            next_kill = now + args.kill_every
        if now >= next_report:
            with stats.lock:
                total = sum(stats.ops.values())
                errs = sum(stats.errors.values())
            try:
                info = admin.server_info()
                pool = (f"trees {info.live_trees}, branches {info.live_branches}, "
                        f"pages free {info.kv_pages_free}/{info.kv_pages_total}")
            except grpc.RpcError as e:
                pool = f"server info: {e.code().name}"
            print(f"[{now - t0:6.0f} s] {total} ops, {errs} errors, RSS "
                  f"{(r or 0) / 1024:.0f} MiB, {pool}", flush=True)
            next_report = now + 60
    stop.set()
    for w in workers:
        w.join(timeout=60)
    load_s = time.monotonic() - t0

    report = {"duration_s": round(load_s, 1), "tenants": args.tenants,
              "clients": len(workers), "kill_every_s": args.kill_every,
              "kv_cache_bytes": args.kv_cache_bytes}
    balanced = False
    if crashed is None:
        for w in workers:
            w.cleanup()
        # Abandoned trees have 1.5 s leases; deleted trees' pages return at once.
        info = admin.wait_idle(timeout=30)
        try:
            time.sleep(2)
            info = admin.wait_idle(timeout=10)
        except grpc.RpcError:
            pass
        balanced = (is_idle(info) and info.live_trees == 0 and info.live_branches == 0)
        report["pool_at_end"] = {"kv_pages_total": info.kv_pages_total,
                                 "kv_pages_free": info.kv_pages_free,
                                 "kv_pages_evictable": info.kv_pages_evictable,
                                 "live_trees": info.live_trees,
                                 "live_branches": info.live_branches,
                                 "decode_steps": info.decode_steps}
        admin.channel.close()
        report["server_stop"] = str(server.stop())
    report["pool_balanced"] = balanced
    report["server_counters"] = {k: int(v) for k, v in sorted(server.counters.items())}
    report["crashed"] = crashed
    report["operations"] = dict(sorted(stats.ops.items()))
    report["operations_total"] = sum(stats.ops.values())
    by_code = collections.Counter()
    for (op, code), n in stats.errors.items():
        by_code[code] += n
    report["errors_by_code"] = dict(sorted(by_code.items()))
    report["errors_by_operation"] = {f"{op} {code}": n
                                     for (op, code), n in sorted(stats.errors.items())}
    runs = []
    for i, run in enumerate(server.runs):
        start = run["rss"][0][0] if run["rss"] else 0
        kept = [(t, r) for t, r in run["rss"] if t - start >= args.warmup]
        runs.append({"run": i + 1, "ended": run.get("how", "running"),
                     "seconds": round(run.get("end", time.monotonic()) - run["start"], 1),
                     "rss_mib_first": round(run["rss"][0][1] / 1024, 1) if run["rss"] else None,
                     "rss_mib_last": round(run["rss"][-1][1] / 1024, 1) if run["rss"] else None,
                     "rss_mib_max": round(max(r for _, r in run["rss"]) / 1024, 1)
                     if run["rss"] else None,
                     "rss_slope_mib_per_hour_after_warmup": (
                         round(s, 2) if (s := slope_mib_per_hour(kept)) is not None else None)})
    report["server_runs"] = runs
    faults = {c: n for c, n in by_code.items() if c in FAULT_CODES}
    report["fault_messages"] = stats.fault_messages
    report["error_samples"] = {f"{op} {code}": m for (op, code), m in sorted(stats.samples.items())}
    report["ok"] = (crashed is None and balanced and not faults and
                    stats.ops["foreign_tree_served"] == 0 and stats.ops["bad_key_served"] == 0)

    print(f"soak: {report['duration_s']} s, {report['clients']} clients of {args.tenants} "
          f"tenants, {report['operations_total']} operations, " +
          (f"server killed every {args.kill_every:.0f} s" if args.kill_every > 0
           else "no server kill"))
    print("operations:", ", ".join(f"{k} {v}" for k, v in report["operations"].items()))
    print("server counters:", ", ".join(f"{k} {v}" for k, v in
                                        report["server_counters"].items()))
    print("errors by code:", ", ".join(f"{k} {v}" for k, v in report["errors_by_code"].items())
          or "none")
    for run in runs:
        print(f"server run {run['run']}: {run['seconds']} s, {run['ended']}; RSS "
              f"{run['rss_mib_first']} -> {run['rss_mib_last']} MiB (max {run['rss_mib_max']}), "
              f"slope after {args.warmup:.0f} s: {run['rss_slope_mib_per_hour_after_warmup']} "
              "MiB/h")
    print("pool at end:", json.dumps(report.get("pool_at_end")), "balanced" if balanced
          else "NOT BALANCED")
    for m in stats.fault_messages:
        print("fault:", m)
    if crashed:
        print("crash:", crashed, "; log:", server.log_path)
    print("soak", "passed" if report["ok"] else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
