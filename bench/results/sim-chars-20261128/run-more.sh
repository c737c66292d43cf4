#!/bin/sh
# After the chars studies (run.sh): the 1-bit outer step in average mode at k = 16 and 64 (is the
# vote's lost magnitude what costs at many workers?), then the GPT's per-step study at k = 16
export MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824
while pgrep -f "sim-chars-20261128/run.sh" > /dev/null; do sleep 30; done
nice -n 19 python bench_sim_study.py local --tasks chars --workers 64 16 --sync-every 8 64 --dlion dlion-avg-ef-decay-0.5 --dlion-lr "1.09236*sqrtH" --out results/sim-chars-20261128
nice -n 19 python bench_sim_study.py per-step --tasks stdlib --workers 16 --methods dlion-vote-binary dlion-average-binary --out results/sim-stdlib-20261128
