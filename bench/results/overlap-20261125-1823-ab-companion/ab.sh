#!/bin/bash
# A/B of the gathers' second gloo group at one commit: A = this branch, B = the same files with
# pipeline.companion returning None (lag one on gloo). 4x1 at 10 Gbit/s, interleaved A B A B A B.
. /work/main/.venv/bin/activate
OUT=/tmp/ovq/ab
mkdir -p $OUT
flock /work/notes/bench.lock bash -c '
for k in 0 1 2; do
  for t in A B; do
    if [ $t = A ]; then cd /work/wt/overlap21b; else cd /tmp/ovq/nocomp; fi
    echo "== $t $k start $(date -u +%T) $(cat /proc/loadavg)" >> '$OUT'/log.txt
    python bench/bench_overlap.py --layouts 4x1 --rates-gbit 10 --rounds 1 \
      --variants no_comm,dlion,dlion_overlap --out '$OUT'/$t-$k > '$OUT'/$t-$k.txt 2>&1
    echo "== $t $k rc=$? end $(date -u +%T) $(cat /proc/loadavg)" >> '$OUT'/log.txt
  done
done'
echo ALLDONE >> $OUT/log.txt
