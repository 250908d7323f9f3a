#!/bin/bash
# The GPU tests with this session's final binaries, then loadgen gpu, then
# TCP at 8 connections and the ring latency, final binary against the
# session's start, alternated once more.
S="$(cd "$(dirname "$0")" && pwd)"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
echo "== GPU tests"
KVRAIL_BIN_DIR=$S timeout 300 $S/gpu-test 2>&1 | grep -E "^test |test result|SKIPPED|panicked" | head -20
echo "== loadgen gpu"
cd "$S"
timeout 120 ./loadgen gpu --runs 2 --connections 8 2>&1 | grep -v "^{" | tail -6
for b in loadgen loadgen-prev; do
  echo "== $b"
  timeout 150 ./$b bench --only single --sizes 256M --ops push,pull --connections 8 --transport tcp 2>&1 | grep -v "^{" | grep -E "single|rror"
  timeout 150 ./$b bench --only latency --latency-samples 2000 --latency-layers 0 --connections 4 --transport tcp 2>&1 | grep -v "^{" | grep -E "ring p50|rror"
done
