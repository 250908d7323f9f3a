#!/bin/bash
# #23's 4 KiB p99 with more samples: reader spin 50 us (default) against
# 200 us, alternated eight times (10,000 samples each, 4 KiB and 1 MiB);
# then TCP bulk at 8 connections, two rounds each (the spin must not cost bulk).
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
nproc; lscpu | grep -E "Model name" | head -1
for round in 1 2 3 4 5 6 7 8; do
  for spin in 50 200; do
    echo "== round $round reader spin $spin"
    timeout 120 ./loadgen bench --only latency --latency-paths ring --latency-samples 10000 --latency-sizes 4K,1M --latency-layers 0 --connections 4 --transport tcp --sidecar-arg=--reader-spin-us=$spin 2>&1 | grep -v "^{" | grep -E "latency|rror" | head -6
  done
done
for round in 1 2; do
  for spin in 50 200; do
    echo "== bulk round $round reader spin $spin"
    timeout 200 ./loadgen bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp --sidecar-arg=--reader-spin-us=$spin 2>&1 | grep -v "^{" | grep -E "single|x a contiguous|rror"
  done
done
