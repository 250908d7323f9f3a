#!/bin/bash
# Staged slices of their own size: GPU tests, then the staged path at the
# sidecar's defaults (1 MiB host slices, 8 MiB window; GPU slices 4 MiB) against
# GPU slices of 1 MiB (the previous behaviour), alternated.
S="$(cd "$(dirname "$0")" && pwd)"
KVRAIL_BIN_DIR=$S/bin-test timeout 300 $S/gpu-test --test-threads 1 2>&1 | grep -E "^test |test result|SKIPPED|panicked" | head -20
cd "$S"
for r in 1 2; do
  for c in 8 4; do
    echo "== $c connections, default (GPU slices 4 MiB)"
    timeout 200 ./loadgen gpu --runs 3 --connections $c --slice-bytes 1M --window-bytes 8M 2>&1 | grep "push:\|pull:"
    echo "== $c connections, --gpu-slice-bytes=1M"
    timeout 200 ./loadgen gpu --runs 3 --connections $c --slice-bytes 1M --window-bytes 8M --sidecar-arg=--gpu-slice-bytes=1048576 2>&1 | grep "push:\|pull:"
  done
done
