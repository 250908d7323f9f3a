#!/bin/bash
# This session's binary (payload deadline, control-size checks, QP setup
# numbering) against the last session's (s18), alternated: TCP bulk at 8
# connections and the ring latency bench, on one device host.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
nproc; lscpu | grep -E "Model name" | head -1
for round in 1 2 3; do
  for b in s19 s18; do
    echo "== round $round $b bulk"
    timeout 150 ../$b/loadgen bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp 2>&1 | grep -v "^{" | grep -E "single|x a contiguous|rror"
    echo "== round $round $b latency"
    timeout 120 ../$b/loadgen bench --only latency --latency-paths ring --latency-samples 3000 --latency-sizes 4K,64K,1M --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep -v "^{" | grep -E "latency|rror" | head -6
  done
done
