#!/bin/bash
cd "$(dirname "$0")"
for r in 1 2; do
  for b in loadgen-trace loadgen-trace2; do
    rm -rf /tmp/t; mkdir /tmp/t
    echo "== $b run $r"
    KVRAIL_TRACE=/tmp/t/t ./$b bench --only latency --latency-paths ring --latency-samples 4000 --latency-sizes 4K --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep 'latency '
    python3 chain_an.py /tmp/t/*.trace | grep -v "^[0-9]"
  done
done
