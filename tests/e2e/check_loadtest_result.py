#!/usr/bin/env python3
# A load-test results file (clients/loadtest.py or treeserve_loadtest, the same JSON) has sane
# fields: used by both smoke tests. Usage: check_loadtest_result.py RESULTS.json
import json, sys
r = json.load(open(sys.argv[1]))
problems = []
def need(cond, what):
    if not cond: problems.append(what)
need(r["requests_completed"] >= 1, "no request completed")
need(not r["errors"], "errors: %s" % r["errors"][:3])
need(r["generated_tokens"] > 0 and r["throughput_tok_s"] > 0, "no tokens generated")
need(r["ttft_s"]["count"] >= 1 and 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"], "bad TTFT")
need(r["request_latency_s"]["p50"] >= r["ttft_s"]["p50"], "latency below TTFT")
need(r["itl_s"]["count"] == 0 or 0 <= r["itl_s"]["p50"] <= r["itl_s"]["p99"], "bad ITL")
kv = r["kv_pages"]
need(kv["samples"] >= 1 and 0 <= kv["min"] <= kv["mean"] <= kv["max"] <= kv["total"],
     "bad KV page figures %s" % kv)
need(r["prompt_tokens"] > 0, "no prompt tokens")
need(r["idle_after"], "server not idle after the run: %s" % r["idle_state"])
need(r["leftover_trees_deleted"] == 0, "trees left behind")
need(r["server"]["backend"] == "cpu", "backend %s" % r["server"]["backend"])
need(len(r["timeline"]["requests"]) == r["requests_completed"], "timeline/requests mismatch")
if r["workload"] == "speculative":
    need(r["speculative"]["verify_steps"] >= 1, "no verify step")
if r["workload"] == "tot":
    need(r["counters"].get("tot_pruned", 0) >= 1, "tot pruned nothing")
    if r["params"]["server_side_search"]:
        need(r["counters"].get("tot_leaves", 0) >= 1, "TreeSearch returned no leaves")
if r["workload"] in ("multidoc", "multifewshot"):
    need(r["params"]["requests"] >= 1, "derived requests missing from params")
if problems:
    print("; ".join(problems)); sys.exit(1)
print("%s: %d requests, %d tokens, %.1f tok/s, TTFT p50 %.1f ms, KV pages max %d" % (
    r["workload"], r["requests_completed"], r["generated_tokens"], r["throughput_tok_s"],
    1000 * r["ttft_s"]["p50"], kv["max"]))
