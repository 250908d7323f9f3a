#!/bin/bash
# QUIC and TCP at 8 connections with the sidecars' tokio worker count varied
# (TOKIO_WORKER_THREADS, inherited by the sidecars loadgen starts); alternated twice.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
export LD_LIBRARY_PATH=$S/lib PATH=$S/bin:$PATH
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
./aesb 65000
for round in 1 2; do
  for w in default 4 8; do
    echo "== round $round workers $w"
    if [ $w = default ]; then unset TOKIO_WORKER_THREADS; else export TOKIO_WORKER_THREADS=$w; fi
    timeout 150 ./loadgen bench --only single --sizes 256M --ops push,pull --connections 8 --transport tcp,quic 2>&1 | grep -v "^{" | grep -E "single|compare|rror"
  done
done
unset TOKIO_WORKER_THREADS
