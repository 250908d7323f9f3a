#!/bin/bash
# Twelfth session, final binaries (after the review: spinning readers capped
# at a quarter of the CPUs, no spin with input at hand, GPU staging share by
# buffer size): GPU tests, loadgen gpu, the reader spin off vs default on the
# ring latency and on TCP bulk at 8 connections (alternated twice, with the
# session's first spin binary "loadgen-first" once more), then the Python ring.
# Run from the repository root: bash docs/ring-runs/s17-final.sh gpu-bin/s17h
S="$(cd "$1" && pwd)"
nproc; lscpu | grep -E "Model name" | head -1
echo "== GPU tests"
KVRAIL_BIN_DIR=$S timeout 300 $S/gpu-test 2>&1 | grep -E "^test |test result|SKIPPED|panicked" | head -20
echo "== loadgen gpu"
(cd "$S" && timeout 150 ./loadgen gpu --runs 2 --connections 8 2>&1 | grep -v "^{" | tail -3)
for round in 1 2; do
  for b in off final first; do
    args=(); bin=$S/loadgen
    [ $b = off ] && args=(--sidecar-arg=--reader-spin-us=0)
    [ $b = first ] && bin=$S/loadgen-first
    echo "== round $round $b"
    timeout 150 $bin bench --only latency --latency-samples 2000 --connections 4 --transport tcp "${args[@]}" 2>&1 | grep -v "^{" | grep -E "ring p50|80 layers|rror"
    timeout 200 $bin bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp "${args[@]}" 2>&1 | grep -v "^{" | grep -E "single|x a contiguous|rror"
  done
done
echo "== Python ring vs Rust ring"
(cd clients/python && timeout 120 python3 setup.py build_ext --inplace > /dev/null 2>&1; ls src/kvrail/*.so)
for i in 1 2 3; do
  PYTHONPATH=clients/python/src timeout 200 python3 clients/python/benchmarks/ring_latency.py --kvrail $S/kvrail --loadgen $S/loadgen --samples 2000 2>&1 | tail -1
done
