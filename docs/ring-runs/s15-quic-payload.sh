#!/bin/bash
# #21 criterion 3 record: TCP and QUIC at the new default (65000-byte UDP
# payload) against the previous default (6550), alternated, at 4/8/16 connections.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
for C in ${CS:-8 16 4}; do
echo "#### connections $C"
timeout 120 ./loadgen bench --only iperf3,single --sizes 256M --ops push,pull --connections $C --transport tcp 2>&1 | grep -v "^{" | grep -E "iperf3|single"
for round in 1 2; do
for p in 65000 6550; do
  echo "== connections $C payload $p round $round"
  timeout 150 ./loadgen bench --only single --sizes 256M --ops push,pull --connections $C --transport quic --sidecar-arg=--quic-max-udp-payload=$p 2>&1 | grep -v "^{" | grep -E "single|rror"
done
done
done
