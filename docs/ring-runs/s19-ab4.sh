#!/bin/bash
# Does the payload-deadline wrapper cost many-piece pushes anything? The
# scattered and vLLM-shaped pushes at 8 connections, s18 and s19f alternated
# eight times.
S="$(cd "$(dirname "$0")" && pwd)"; cd "$S"
for round in 1 2 3 4 5 6 7 8; do
  for b in s18 s19f; do
    echo "== round $round $b"
    timeout 150 ../$b/loadgen bench --only scattered,vllm --sizes 256M --ops push --connections 8 --transport tcp 2>&1 | grep -v "^{" | grep -E "scattered|vllm|rror"
  done
done
