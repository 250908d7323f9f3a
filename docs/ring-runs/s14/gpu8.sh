#!/bin/bash
S="$(cd "$(dirname "$0")" && pwd)"
KVRAIL_BIN_DIR=$S/bin-test timeout 400 $S/gpu-test --test-threads 1 2>&1 | grep -E "^test |test result|SKIPPED|panicked|failed|never grew" | head -30
cd "$S"
for r in 1 2; do
  timeout 200 ./loadgen gpu --runs 3 --connections 8 2>&1 | grep "push:\|pull:"
done
