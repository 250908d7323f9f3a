#!/bin/bash
# QUIC read_payload by chunks (new) against one read per buffer (previous):
# 8 connections, 256 MiB and the vLLM batch, alternated twice; TCP once.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
timeout 150 ./loadgen-new bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp 2>&1 | grep -E "^(single|scattered|vllm) .*GB/s|x a contiguous"
for round in 1 2; do
for b in new prev; do
  echo "== $b round $round"
  timeout 200 ./loadgen-$b bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport quic 2>&1 | grep -E "^(single|scattered|vllm) .*GB/s|x a contiguous|rror"
done
done
