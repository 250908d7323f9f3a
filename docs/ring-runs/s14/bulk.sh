#!/bin/bash
# #21 record: kvrail TCP 256 MiB push/pull, iperf3 processes and the bare-C
# floors (cold regions written/read like kvrail; iperf3-like hot buffers) at
# 4, 8, 16 connections, in one call.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
iperf3 --version | head -1
for c in 4 8 16; do
  timeout 200 ./loadgen bench --only iperf3,single --sizes 256M --ops push,pull --connections $c --transport tcp 2>&1 | grep -v "^{" | grep -E "iperf3|single"
  ./sp copy $c 268435456 8; ./sp copy $c 268435456 8 hot
done
