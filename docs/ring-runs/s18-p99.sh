#!/bin/bash
# #23's 4 KiB p99: the reader spin at 50 us (default), 200 us and 500 us,
# alternated five times on the ring latency bench (Rust client, 3000 samples).
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
nproc; lscpu | grep -E "Model name" | head -1
for round in 1 2 3 4 5; do
  for spin in 50 200 500; do
    echo "== round $round reader spin $spin"
    timeout 120 ./loadgen bench --only latency --latency-paths ring --latency-samples 3000 --latency-sizes 4K,64K --latency-layers 0 --connections 4 --transport tcp --sidecar-arg=--reader-spin-us=$spin 2>&1 | grep -v "^{" | grep -E "latency|rror" | head -6
  done
done
