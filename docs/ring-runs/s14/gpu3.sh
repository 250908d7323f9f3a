#!/bin/bash
cd "$(dirname "$0")"
run() {
  rm -rf /tmp/g; mkdir /tmp/g
  echo "== $*"
  KVRAIL_TRACE=/tmp/g/t timeout 200 ./loadgen-gt gpu --runs 3 --connections 8 --slice-bytes 1M --window-bytes 8M "$@" 2>&1 | grep -v "^{" | grep "push:\|pull:"
  for f in /tmp/g/*.sums; do echo "$(basename $f): $(awk '$1=="cuda"{printf "cuda lockwait=%.3fs enqueue=%.3fs event=%.3fs n=%d  ", $2/1e9, $3/1e9, $4/1e9, $5} $2>0 && ($1==7||$1==5){printf "%s:n=%d,avg=%.1fus  ", $1, $2, $3/$2/1e3}' $f)"; done
}
for r in 1 2; do
run
run --sidecar-arg=--gpu-copy-streams=4
run --sidecar-arg=--gpu-copy-streams=8
done
