#!/bin/bash
# A/B: loadgen-trace (before) vs loadgen-trace2 (statx cached on the receiving side, one lock for open+gate)
cd "$(dirname "$0")"
for r in 1 2 3; do
  for b in loadgen-trace loadgen-trace2; do
    rm -rf /tmp/t; mkdir /tmp/t
    echo "== $b run $r"
    KVRAIL_TRACE=/tmp/t/t ./$b bench --only latency --latency-paths ring --latency-samples 3000 --latency-sizes 4K,64K,1M --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep 'latency '
    mkdir -p $OUT/$b-$r; cp /tmp/t/* $OUT/$b-$r/
  done
done
./chain 4096 3000 50 2>/dev/null; ./chain 4096 3000 0 2>/dev/null
