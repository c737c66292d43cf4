#!/bin/sh
# The chars task's studies, after the sweep (its k = 4 runs are copied in and reused), niced,
# one thread each, glibc keeping freed memory.
export MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824
OUT=results/sim-chars-20261128
SWEEP=results/sim-sweep-20261128
while [ ! -f $SWEEP/sweep.json ]; do sleep 30; done
cat $SWEEP/runs.jsonl >> $OUT/runs.jsonl
nice -n 19 python bench_sim_study.py per-step --tasks chars --workers 4 16 64 --out $OUT
DLION=$(python -c "import json; print(json.load(open('$SWEEP/sweep.json'))['chosen']['method'])")
RULE=$(python -c "
import json; r = json.load(open('$SWEEP/sweep.json'))['chosen']['rule']
print({0.0: '%g' % (r['c'] * 3e-3), 1.0: '%g*H' % r['c'], 0.5: '%g*sqrtH' % r['c']}[r['power']])")
echo "D-Lion outer step: $DLION, lr rule $RULE"
nice -n 19 python bench_sim_study.py local --tasks chars --workers 4 16 64 --sync-every 8 64 --dlion $DLION --dlion-lr "$RULE" --out $OUT
nice -n 19 python bench_sim_study.py budgets --workers 4 16 64 --sync-every 8 64 --dlion $DLION --dlion-lr "$RULE" --out $OUT
