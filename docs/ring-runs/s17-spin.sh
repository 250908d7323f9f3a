#!/bin/bash
# Readers polling their socket for the next frame (reader_spin_us): off (0),
# the default (50 us on >= 4 CPUs) and 200 us, one binary, alternated three
# times on the ring latency bench; then off vs default on TCP bulk at 8
# connections (the spin must not cost bulk transfers).
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
nproc; lscpu | grep -E "Model name" | head -1
for round in 1 2 3; do
  for spin in 0 default 200; do
    args=(); [ $spin != default ] && args=(--sidecar-arg=--reader-spin-us=$spin)
    echo "== round $round reader spin $spin"
    timeout 150 ./loadgen bench --only latency --latency-samples 2000 --connections 4 --transport tcp "${args[@]}" 2>&1 | grep -v "^{" | grep -E "latency|layer|rror" | head -12
  done
done
for round in 1 2; do
  for spin in 0 default; do
    args=(); [ $spin != default ] && args=(--sidecar-arg=--reader-spin-us=$spin)
    echo "== bulk round $round reader spin $spin"
    timeout 200 ./loadgen bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp "${args[@]}" 2>&1 | grep -v "^{" | grep -E "single|x a contiguous|rror"
  done
done
