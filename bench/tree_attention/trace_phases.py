#!/usr/bin/env python3
"""Sums up a bench_tree_attention --trace CSV: per case, the stage-1 span and, for wide
blocks (more than 16 query-tile rows) and decode-shaped ones, their count, median and longest
duration and when the last of them ended (all in µs from the launch's first block start).

usage: trace_phases.py TRACE.csv [--narrow-rows N]
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--narrow-rows", type=int, default=16)
    args = ap.parse_args()
    cases = collections.OrderedDict()
    with open(args.trace, newline="") as f:
        for row in csv.DictReader(f):
            cases.setdefault((row["case"], row["heads"]), []).append(row)
    for (name, heads), rows in cases.items():
        t0 = min(int(r["start_ns"]) for r in rows)
        t1 = max(int(r["end_ns"]) for r in rows)

        def phase(blocks):
            if not blocks:
                return "-"
            d = sorted((int(r["end_ns"]) - int(r["start_ns"])) / 1e3 for r in blocks)
            end = (max(int(r["end_ns"]) for r in blocks) - t0) / 1e3
            return "%4d blocks, median %5.1f, longest %5.1f, last end %6.1f" % (
                len(d), d[len(d) // 2], d[-1], end)

        wide = [r for r in rows if int(r["rows"]) > args.narrow_rows]
        narrow = [r for r in rows if int(r["rows"]) <= args.narrow_rows]
        print("%-34s %-6s span %6.1f us" % (name, heads, (t1 - t0) / 1e3))
        print("    wide:   " + phase(wide))
        print("    decode: " + phase(narrow))


if __name__ == "__main__":
    main()
