#!/bin/bash
# Final binary: TCP and QUIC (default 65000, receive batches sized for jumbo
# frames) at 8 connections, with the memory baseline; twice.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
for round in 1 2; do
  echo "== round $round"
  timeout 250 ./loadgen bench --only iperf3,quic-floor,single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp,quic 2>&1 | grep -v "^{" | grep -E "iperf3|memory|raw quinn|single|x a contiguous|compare|rror"
done
