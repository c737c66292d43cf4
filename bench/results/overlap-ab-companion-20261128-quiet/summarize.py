import json, os, statistics as st, sys
"""Step times of the A/B folder given as the argument: (kind, Gbit/s, variant, A or B) -> per pair."""
OUT = sys.argv[1]
rows = []
for t in "AB":
    for k in range(3):
        f = f"{OUT}/flat-{t}-{k}/bench_overlap.json"
        if os.path.exists(f):
            d = json.load(open(f))
            for r in d["rows"]:
                rows.append(("flat", t, k, r["rate_gbps"], r["variant"], r["step_ms"]))
        f = f"{OUT}/fsdp-{t}-{k}/bench_training.json"
        if os.path.exists(f):
            d = json.load(open(f))
            for r in d["rows"]:
                rows.append(("fsdp", t, k, r["rate_gbps"], r["variant"], r["step_ms_slowest_rank"]))
import collections
tab = collections.defaultdict(list)
for kind, t, k, rate, v, ms in rows:
    tab[(kind, rate, v, t)].append((k, ms))
for key in sorted(tab, key=str):
    print(key, [round(x[1]) for x in sorted(tab[key])], "median", round(st.median([x[1] for x in tab[key]])))
