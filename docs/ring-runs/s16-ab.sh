#!/bin/bash
# This session's binary (hardening: session caps, SliceAck check, unread cut,
# handshake eviction...) against the session's start (b2562d0), alternated
# twice: TCP bulk at 8 connections and the ring latency bench.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
for round in 1 2; do
  for b in new prev; do
    echo "== round $round $b"
    timeout 200 ./loadgen-$b bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp 2>&1 | grep -v "^{" | grep -E "single|x a contiguous|rror"
    timeout 200 ./loadgen-$b bench --only latency --latency-samples 2000 --connections 4 --transport tcp 2>&1 | grep -v "^{" | grep -E "latency|layer|rror" | head -12
  done
done
