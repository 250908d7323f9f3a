#!/bin/bash
cd "$(dirname "$0")"
for op in push pull; do
  rm -rf /tmp/g; mkdir /tmp/g
  start=$(date +%s.%N)
  KVRAIL_TRACE=/tmp/g/t timeout 250 ./loadgen-gt gpu --runs 3 --connections 8 --slice-bytes 1M --window-bytes 8M --ops $op 2>&1 | grep -v "^{" | tail -6
  end=$(date +%s.%N); echo "wall $(echo "$end - $start" | bc) s"
  for f in /tmp/g/*.sums; do echo "$f: $(awk '$2>0{printf "%s:n=%d,sum=%.3fs,avg=%.1fus  ", $1, $2, $3/1e9, $3/$2/1e3}' $f)"; done
done
