#!/bin/bash
cd "$(dirname "$0")"
for r in 1 2 3; do
  for b in loadgen-trace3 loadgen-spin; do
    echo "== $b run $r"
    ./$b bench --only latency --latency-paths ring --latency-samples 2000 --connections 4 --transport tcp 2>&1 | grep 'latency \|layerwise'
  done
done
