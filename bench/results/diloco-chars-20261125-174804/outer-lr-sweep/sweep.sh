#!/bin/bash
# The outer-lr sweep behind the quality study: tuning seed 3 (not one of the evaluation seeds
# 0-2), 4 workers, 320 inner steps, P = 1, the chars demo's defaults otherwise (AdamW inner lr
# 3e-3). Run from the repository root under nice -n 19 (untimed). A first grid, then a finer one
# around each best value; the finer run of diloco-nesterov at H = 32 (0.5, 0.85) was stopped
# unfinished for time (0.7 is bracketed by 0.35 and 1.0 of the first grid).
set -e
OUT=${1:-bench/results/diloco-chars-20261125-174804/outer-lr-sweep}
run() { python -m dlion_kernels.demo --task chars --workers 4 --iters 320 --seeds 3 --quiet \
  --strategy diloco-$1 --sync-every $2 --fragments 1 --diloco-$1-lr $3 \
  --json $OUT/$1-H$2-lr$3.json; }
for H in 8 32; do
  for LR in 5e-3 1e-2 2e-2 4e-2 8e-2; do run dlion $H $LR; done
  for LR in 0.35 0.7 1.0; do run nesterov $H $LR; done
done
run dlion 8 7e-3; run dlion 8 1.4e-2; run dlion 32 1.4e-2; run dlion 32 3e-2
run nesterov 8 0.2; run nesterov 8 0.5
