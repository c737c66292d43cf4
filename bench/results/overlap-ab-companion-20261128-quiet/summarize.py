"""Step times of the A/B folder given as the argument, per (kind, Gbit/s, variant, A or B): the
slowest rank's median step of each pair, and their median."""

import collections
import json
import os
import statistics
import sys

OUT = sys.argv[1]
rows = []
for t in "AB":
    for k in range(3):
        f = f"{OUT}/flat-{t}-{k}/bench_overlap.json"
        if os.path.exists(f):
            for r in json.load(open(f))["rows"]:
                rows.append(("flat", t, k, r["rate_gbps"], r["variant"], r["step_ms"]))
        f = f"{OUT}/fsdp-{t}-{k}/bench_training.json"
        if os.path.exists(f):
            for r in json.load(open(f))["rows"]:
                rows.append(("fsdp", t, k, r["rate_gbps"], r["variant"],
                             r["step_ms_slowest_rank"]))
table = collections.defaultdict(list)
for kind, t, k, rate, variant, ms in rows:
    table[(kind, rate, variant, t)].append((k, ms))
for key in sorted(table, key=str):
    pairs = [ms for _, ms in sorted(table[key])]
    print(key, [round(ms) for ms in pairs], "median", round(statistics.median(pairs)))
