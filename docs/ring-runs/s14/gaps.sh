#!/bin/bash
cd "$(dirname "$0")"
for s in 64K 1M; do
  rm -rf /tmp/t; mkdir /tmp/t
  KVRAIL_TRACE=/tmp/t/t ./loadgen-t4 bench --only latency --latency-paths ring --latency-samples 2000 --latency-sizes $s --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep 'latency '
  python3 trace_stages.py /tmp/t/*.trace | grep "us ->"
  python3 trace_stages.py /tmp/t/*.trace --timeline
done
