#!/bin/bash
# Quiet A/B of the overlap engine's second gloo group (pipeline.companion) at one commit:
# A = the repository as committed, B = the same tree with B-pipeline.diff applied (companion()
# returns None: the gathers go on the exchange group, lag one). Flat 4x1 (overlap=False against
# overlap=True) and FSDP2 2x2 (fsdp-dlion against fsdp-dlion-overlap), 1 and 10 Gbit/s, 3 pairs
# interleaved A B A B A B. Run as root (network namespaces) from the repository root:
#   B_TREE=/path/to/copy-with-the-diff bash bench/results/overlap-ab-companion-20261128-quiet/ab.sh
A_TREE=$PWD
B_TREE=${B_TREE:?a copy of the same commit with B-pipeline.diff applied}
OUT=${OUT:-$A_TREE/bench/results/overlap-ab-companion-$(date -u +%Y%m%d)}
mkdir -p $OUT
for k in 0 1 2; do
  for t in A B; do
    if [ $t = A ]; then cd $A_TREE; else cd $B_TREE; fi
    echo "== $t $k start $(date -u +%T) $(cat /proc/loadavg) $(git rev-parse --short HEAD)" >> $OUT/log.txt
    PYTHONPATH=$PWD python bench/bench_overlap.py --layouts 4x1 --rates-gbit 1 10 --rounds 1 \
      --variants no_comm,dlion,dlion_overlap --warmup 4 --reps 10 --out $OUT/flat-$t-$k > $OUT/flat-$t-$k.txt 2>&1
    echo "   flat rc=$? $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/log.txt
    PYTHONPATH=$PWD python bench/bench_training.py --layouts 2x2 --rates-gbit 1 10 \
      --hier-variants fsdp-dlion,fsdp-dlion-overlap --batches "" --bucket-mbs "" \
      --warmup 2 --reps 4 --no-plot --out $OUT/fsdp-$t-$k > $OUT/fsdp-$t-$k.txt 2>&1
    echo "   fsdp rc=$? $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/log.txt
  done
done
python "$(dirname "$0")/summarize.py" $OUT > $OUT/summary.txt
