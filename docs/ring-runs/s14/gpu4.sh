#!/bin/bash
cd "$(dirname "$0")"
for r in 1 2; do
  for s in 1M 4M 8M; do
    echo "== slices $s"
    timeout 200 ./loadgen-gt gpu --runs 3 --connections 8 --slice-bytes $s --window-bytes 64M 2>&1 | grep "push:\|pull:"
  done
done
