#!/bin/bash
cd "$(dirname "$0")"
L="./loadgen-trace bench --only latency --latency-paths ring --latency-samples 3000 --latency-sizes 4K --latency-layers 0 --connections 4 --transport tcp"
for r in 1 2; do
  ./chain 4096 3000 50 2>/dev/null
  rm -rf /tmp/tr$r; mkdir /tmp/tr$r
  KVRAIL_TRACE=/tmp/tr$r/t $L 2>&1 | grep 'latency '
  python3 chain_an.py /tmp/tr$r/*.trace
  mkdir -p $OUT/tr$r; cp /tmp/tr$r/* $OUT/tr$r/
done
