#!/bin/sh
# The stdlib GPT's local-steps study, after its per-step study (run.sh) and the sweep's choice
export MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824
OUT=results/sim-stdlib-20261128
SWEEP=results/sim-sweep-20261128
while pgrep -f "sim-stdlib-20261128/run.sh" > /dev/null || [ ! -f $SWEEP/sweep.json ]; do sleep 30; done
DLION=$(python -c "import json; print(json.load(open('$SWEEP/sweep.json'))['chosen']['method'])")
RULE=$(python -c "
import json; r = json.load(open('$SWEEP/sweep.json'))['chosen']['rule']
print({0.0: '%g' % (r['c'] * 3e-3), 1.0: '%g*H' % r['c'], 0.5: '%g*sqrtH' % r['c']}[r['power']])")
echo "D-Lion outer step: $DLION, lr rule $RULE"
nice -n 19 python bench_sim_study.py local --tasks stdlib --workers 64 4 --sync-every 8 --dlion $DLION --dlion-lr "$RULE" --out $OUT
# then k = 16 (after the first two; H = 64 is 4 syncs in this budget: not run)
nice -n 19 python bench_sim_study.py local --tasks stdlib --workers 16 --sync-every 8 --dlion $DLION --dlion-lr "$RULE" --out $OUT
