"""Plots a load-test result file (loadtest.py's or treeserve_loadtest's --json): request
latency and TTFT at completion time, inter-token latency, and KV pages over time, the same
figure as loadtest.py --plot. Needs only matplotlib (no gRPC).

    python3 clients/plot_loadtest.py --json full-multilevel.json --png full-multilevel.png
"""
import argparse
import json
import sys


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    reqs = res["timeline"]["requests"]
    itl = res["timeline"].get("itl", [])
    a.scatter([p[0] for p in itl], [1000 * p[1] for p in itl], s=2, alpha=0.3, color="grey",
              label="inter-token latency")
    a.scatter([r[0] for r in reqs], [1000 * r[1] for r in reqs], s=10, label="request latency")
    a.scatter([r[0] for r in reqs if r[2] is not None],
              [1000 * r[2] for r in reqs if r[2] is not None], s=10, marker="x",
              label="time to first token")
    a.set_ylabel("ms (log; at completion time)")
    a.set_yscale("log")
    a.legend(loc="upper left")
    a.set_title("treeserve %s (%s scale): %.1f tok/s, backend %s" % (
        res["workload"], res["scale"], res["throughput_tok_s"], res["server"]["backend"]))
    kv = res["timeline"]["kv"]
    b.plot([k[0] for k in kv], [k[1] for k in kv], label="pages in use")
    b.plot([k[0] for k in kv], [k[1] + k[2] for k in kv], label="in use + evictable cache")
    b.set_xlabel("seconds since start")
    b.set_ylabel("KV pages (pool: %d)" % res["kv_pages"]["total"])
    b.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="a load-test result file")
    ap.add_argument("--png", required=True, help="where to write the figure")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib, which %s cannot import (Debian: apt-get "
              "install python3-matplotlib)" % sys.executable, file=sys.stderr)
        return 2
    try:
        with open(args.json) as f:
            res = json.load(f)
        timeline = res["timeline"]
        timeline["requests"], timeline["kv"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print("error: %s is not a load-test result file: %s" % (args.json, e), file=sys.stderr)
        return 2
    plot(res, args.png)
    print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
