#!/bin/bash
cd "$(dirname "$0")"
for r in 1 2; do
  rm -rf /tmp/t; mkdir /tmp/t
  KVRAIL_TRACE=/tmp/t/t ./loadgen-trace3 bench --only latency --latency-paths ring --latency-samples 2000 --latency-sizes 1M --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep 'latency '
  python3 big_an.py /tmp/t/*.trace | grep -v "count\|last" | tr '\n' ';'; echo
  rm -rf /tmp/t; mkdir /tmp/t
  KVRAIL_TRACE=/tmp/t/t ./loadgen-trace3 bench --only latency --latency-paths ring --latency-samples 2000 --latency-sizes 256K --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep 'latency '
  python3 big_an.py /tmp/t/*.trace | grep -v "count\|last" | tr '\n' ';'; echo
done
./tcpfloor 1048576 1 2000; ./tcpfloor 262144 1 2000
