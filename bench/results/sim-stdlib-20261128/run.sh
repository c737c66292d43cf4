#!/bin/sh
# The stdlib GPT's studies, in the order they ran (niced, one thread, glibc keeping freed memory)
export MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824
OUT=results/sim-stdlib-20261128
nice -n 19 python bench_sim_study.py per-step --tasks stdlib --workers 64 --out $OUT
nice -n 19 python bench_sim_study.py per-step --tasks stdlib --workers 4 --methods dlion-vote-binary dlion-average-binary --out $OUT
