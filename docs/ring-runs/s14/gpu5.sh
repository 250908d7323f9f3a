#!/bin/bash
cd "$(dirname "$0")"
for r in 1 2; do
  for sw in "4M 8M" "4M 16M" "2M 8M"; do
    set -- $sw
    echo "== slices $1 window $2"
    timeout 200 ./loadgen-gt gpu --runs 3 --connections 8 --slice-bytes $1 --window-bytes $2 2>&1 | grep "push:\|pull:"
  done
done
