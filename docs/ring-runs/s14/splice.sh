#!/bin/bash
cd "$(dirname "$0")"
nproc; uname -r
L="./loadgen bench --only latency --latency-paths ring --latency-samples 3000 --latency-sizes 4K --latency-layers 0 --connections 4 --transport tcp"
for r in 1 2 3; do
  ./chain 4096 3000 0 2>/dev/null; ./chain 4096 3000 50 2>/dev/null
  $L 2>&1 | grep 'latency '
done
for k in 4 8 16; do for r in 1 2; do
  ./sp copy $k 268435456 8; ./sp splice $k 268435456 8; ./sp copy $k 268435456 8 hot
done; done
