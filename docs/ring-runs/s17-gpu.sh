#!/bin/bash
# Twelfth session, final binaries: the GPU tests (received staged slices now
# wait for a share of staging memory), loadgen gpu, the reader spin off vs
# default once more on this host, and the Python ring against the Rust ring.
# Run from the repository root: bash docs/ring-runs/s17-gpu.sh gpu-bin/s17g
S="$(cd "$1" && pwd)"
nproc; lscpu | grep -E "Model name" | head -1; python3 --version
echo "== GPU tests"
KVRAIL_BIN_DIR=$S timeout 300 $S/gpu-test 2>&1 | grep -E "^test |test result|SKIPPED|panicked" | head -20
echo "== loadgen gpu"
(cd "$S" && timeout 150 ./loadgen gpu --runs 2 --connections 8 2>&1 | grep -v "^{" | tail -6)
for round in 1 2; do
  for spin in 0 default; do
    args=(); [ $spin != default ] && args=(--sidecar-arg=--reader-spin-us=$spin)
    echo "== round $round reader spin $spin"
    timeout 150 $S/loadgen bench --only latency --latency-samples 2000 --connections 4 --transport tcp "${args[@]}" 2>&1 | grep -v "^{" | grep -E "ring p50|80 layers|rror"
  done
done
echo "== Python ring vs Rust ring"
PYTHONPATH=clients/python/src timeout 200 python3 clients/python/benchmarks/ring_latency.py --kvrail $S/kvrail --loadgen $S/loadgen --samples 2000 2>&1 | tail -3
