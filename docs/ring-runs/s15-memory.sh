#!/bin/bash
# #21 criterion 1 record with the memory baseline: iperf3 processes, memory
# copies of cold regions and kvrail TCP at 4/8/16 connections; the default QUIC
# at 8 in the same call.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
for C in 4 8 16; do
  timeout 150 ./loadgen bench --only iperf3,single --sizes 256M --ops push,pull --connections $C --transport tcp 2>&1 | grep -v "^{" | grep -E "iperf3|memory|single|rror"
done
timeout 200 ./loadgen bench --only iperf3,single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp,quic 2>&1 | grep -v "^{\"bench\":\"\(single\|scattered\|vllm\|iperf3\|memory\)" | grep -E "iperf3|memory|single|scattered|vllm|compare|rror"
