#!/bin/bash
# The final binary of this session (s19f) against the last session's (s18): ring
# latency six times each, then 256 MiB TCP push/pull at 8 connections three times.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
for round in 1 2 3 4 5 6; do
  for b in s18 s19f; do
    echo "== round $round $b latency"
    timeout 120 ../$b/loadgen bench --only latency --latency-paths ring --latency-samples 3000 --latency-sizes 4K,64K,1M --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep -v "^{" | grep -E "latency|rror" | head -6
  done
done
for round in 1 2 3; do
  for b in s18 s19f; do
    echo "== round $round $b bulk"
    timeout 150 ../$b/loadgen bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp 2>&1 | grep -v "^{" | grep -E "single|x a contiguous|rror"
  done
done
