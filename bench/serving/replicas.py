#!/usr/bin/env python3
"""Three replicas behind HAProxy (deploy/local_replicas.py: CPU backend, tiny model, loopback),
measured under clients/loadtest.py's multifewshot workload (few-shot sets shared by many
questions) in each of the proxy's modes (deploy/haproxy/haproxy.cfg, TREESERVE_BALANCE), each
on fresh replicas:

  hash        every call hashed on its routing key: trees whose prompts share a prefix meet on
              one replica, and a tree's calls on the replica holding it;
  random      new trees land on a random replica (a random key replaces the prompt's), their
              calls still follow the key in their ids: placement without prefix routing;
  roundrobin  every call round-robin: a tree's later calls miss its replica.

Per mode: requests completed and failed, generated tokens/s, time to first token, the cached
share of prompt tokens (sum over the replicas' /metrics of
treeserve:prefix_cache_hit_tokens_total over treeserve:prompt_tokens_total), each replica's
share of the prompt tokens, misrouted calls; the modes take turns for --rounds rounds (3) and
the run with the median throughput is shown. Then the proxy's added latency: a small unary
call (Tokenize) direct to a replica and through the proxy, alternating call by call, median,
p90 and p99 of each.

usage: bench/serving/replicas.py [--build BUILD_DIR] [--save] [--calls N] [--rounds N]
                                 [--modes hash,random,roundrobin] [-- loadtest arguments]
The loadtest arguments replace the defaults (--scale small --combos 12 --questions-per-combo 12
--fewshot-tokens 256 --gen-tokens 16 --concurrency 8). --save writes the output to
bench/results/replicas.txt under a line naming the device, the date and the commit.
Needs haproxy and /usr/bin/python3 with grpcio (Debian: python3-grpcio).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "deploy"))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

from local_replicas import ReplicaSet, find_haproxy  # noqa: E402

DEFAULT_LOAD = ["--scale", "small", "--combos", "12", "--questions-per-combo", "12",
                "--fewshot-tokens", "256", "--gen-tokens", "16", "--concurrency", "8"]
HIT, PROMPT = "treeserve:prefix_cache_hit_tokens_total", "treeserve:prompt_tokens_total"
MISROUTED = "treeserve:misrouted_calls_total"


def device_line():
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    haproxy = subprocess.run([find_haproxy(), "-v"], capture_output=True, text=True).stdout
    haproxy = haproxy.split("\n")[0].replace("HAProxy version ", "HAProxy ").split(" - ")[0]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return ("device: %d cores, %s (CPU backend, tiny model; 3 replicas and %s on loopback); "
            "date: %s; commit: %s%s" % (
                os.cpu_count(), cpu, haproxy, datetime.date.today().isoformat(), commit,
                " with uncommitted changes" if dirty else ""))


def run_load(rs, load_args, workdir, mode):
    """loadtest.py through the proxy; its pool checks read the replicas themselves."""
    out = os.path.join(workdir, "loadtest-%s.json" % mode)
    cmd = ["/usr/bin/python3", os.path.join(ROOT, "clients", "loadtest.py"), "--target",
           rs.listen, "--replicas", ",".join(r.address for r in rs.replicas),
           "--workload", "multifewshot", "--json", out, "--quiet"]
    subprocess.run(cmd + load_args, capture_output=True, text=True)  # failures are in the JSON
    with open(out) as f:
        return json.load(f)


def one_mode(binary, mode, load_args, workdir):
    with ReplicaSet(binary, workdir=os.path.join(workdir, mode), balance=mode) as rs:
        before = {r.name: r.metrics() for r in rs.replicas}
        res = run_load(rs, load_args, workdir, mode)
        after = {r.name: r.metrics() for r in rs.replicas}
        delta = {n: {k: after[n].get(k, 0) - before[n].get(k, 0) for k in (HIT, PROMPT, MISROUTED)}
                 for n in after}
    hit = sum(d[HIT] for d in delta.values())
    prompt = sum(d[PROMPT] for d in delta.values())
    return {
        "mode": mode, "ok": res["requests_completed"], "errors": len(res["errors"]),
        "first_error": res["errors"][0] if res["errors"] else "",
        "tok_s": res["throughput_tok_s"], "ttft_p50_ms": 1000 * (res["ttft_s"].get("p50") or 0),
        "latency_p50_ms": 1000 * (res["request_latency_s"].get("p50") or 0),
        "hit": hit, "prompt": prompt, "share": hit / prompt if prompt else 0.0,
        "per_replica": {n: int(d[PROMPT]) for n, d in sorted(delta.items())},
        "misrouted": int(sum(d[MISROUTED] for d in delta.values())),
    }


def latency(binary, calls, workdir):
    """Tokenize round trips, direct to r1 and through the proxy (the route key of the text, so
    always one replica), alternating; returns {side: [seconds...]}."""
    import grpc
    from treeserve import pb, pb_grpc
    from treeserve.routing import ROUTE_HEADER, route_key
    text = "Once upon a time"
    req = pb.TokenizeRequest(text=text)
    md = [(ROUTE_HEADER, route_key(text))]
    with ReplicaSet(binary, workdir=os.path.join(workdir, "latency")) as rs:
        stubs = {"direct": pb_grpc.TreeServeStub(grpc.insecure_channel(rs.replicas[0].address)),
                 "proxy": pb_grpc.TreeServeStub(grpc.insecure_channel(rs.listen))}
        times = {side: [] for side in stubs}
        for stub in stubs.values():  # connect and warm up
            for _ in range(50):
                stub.Tokenize(req, metadata=md)
        for _ in range(calls):  # alternating call by call: both sides meet the same noise
            for side, stub in stubs.items():
                t0 = time.perf_counter()
                stub.Tokenize(req, metadata=md)
                times[side].append(time.perf_counter() - t0)
    return times


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(rows, times, load_args, calls, rounds):
    lines = ["workload: clients/loadtest.py --workload multifewshot " + " ".join(load_args),
             "%d rounds, the modes in turn, each run on fresh replicas; per mode the run with "
             "the median throughput (every run's in the last column)" % rounds,
             "", "| proxy mode | requests ok / failed | gen tok/s | TTFT p50 ms | "
             "request p50 ms | cached share | prompt tokens r1 / r2 / r3 | misrouted calls | "
             "gen tok/s of each run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append("| %s | %d / %d | %.0f | %.1f | %.1f | %.3f (%d of %d) | %s | %d | %s |" % (
            r["mode"], r["ok"], r["errors"], r["tok_s"], r["ttft_p50_ms"], r["latency_p50_ms"],
            r["share"], r["hit"], r["prompt"],
            " / ".join(str(v) for v in r["per_replica"].values()), r["misrouted"],
            " / ".join("%.0f" % v for v in r["all_tok_s"])))
    for r in rows:
        if r["first_error"]:
            lines.append("%s: first error: %s" % (r["mode"], r["first_error"][:200]))
    if times:
        d, p = times["direct"], times["proxy"]
        lines += ["", "Tokenize round trip, %d calls each side, alternating call by call "
                  "(Python grpcio client, one channel each):" % calls, "",
                  "| path | median us | p90 us | p99 us |", "| --- | --- | --- | --- |"]
        for side, v in (("direct to a replica", d), ("through HAProxy", p)):
            lines.append("| %s | %.0f | %.0f | %.0f |" % (
                side, 1e6 * statistics.median(v), 1e6 * pct(v, 0.9), 1e6 * pct(v, 0.99)))
        lines.append("| added by the proxy | %.0f | %.0f | %.0f |" % (
            1e6 * (statistics.median(p) - statistics.median(d)), 1e6 * (pct(p, 0.9) - pct(d, 0.9)),
            1e6 * (pct(p, 0.99) - pct(d, 0.99))))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(usage=__doc__.split("usage: ")[1].split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--calls", type=int, default=3000, help="Tokenize calls per side (0: none)")
    ap.add_argument("--modes", default="hash,random,roundrobin")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    ap.add_argument("load", nargs="*", help="loadtest arguments (after --)")
    args = ap.parse_args()
    binary = os.path.join(args.build, "bin", "treeserve")
    if not os.access(binary, os.X_OK):
        sys.exit("no %s: cmake --build %s --target treeserve" % (binary, args.build))
    if not find_haproxy():
        sys.exit("haproxy is not installed (Debian: apt-get install haproxy)")
    load_args = args.load or DEFAULT_LOAD
    header = device_line()
    print(header, flush=True)
    workdir = tempfile.mkdtemp(prefix="treeserve-bench-replicas-")
    modes = args.modes.split(",")
    runs = {mode: [] for mode in modes}
    for i in range(args.rounds):  # the modes take turns, so drifting load hits each alike
        for mode in modes:
            t0 = time.monotonic()
            runs[mode].append(one_mode(binary, mode, load_args, os.path.join(workdir, str(i))))
            print("round %d, %s: done in %.0f s" % (i + 1, mode, time.monotonic() - t0),
                  file=sys.stderr, flush=True)
    # Per mode the run with the median throughput, and every run's throughput.
    rows = []
    for mode in modes:
        by_rate = sorted(runs[mode], key=lambda r: r["tok_s"])
        row = dict(by_rate[len(by_rate) // 2])
        row["all_tok_s"] = [r["tok_s"] for r in runs[mode]]
        rows.append(row)
    times = latency(binary, args.calls, workdir) if args.calls else None
    text = report(rows, times, load_args, args.calls, args.rounds)
    print("\n" + text)
    if args.save:
        path = os.path.join(ROOT, "bench", "results", "replicas.txt")
        with open(path, "w") as f:
            f.write(header + "\n" + "machine: " + platform.platform() + "\n\n" + text + "\n")
        print("saved to bench/results/replicas.txt")
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
