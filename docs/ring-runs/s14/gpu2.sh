#!/bin/bash
cd "$(dirname "$0")"
run() {
  rm -rf /tmp/g; mkdir /tmp/g
  echo "== $*"
  KVRAIL_TRACE=/tmp/g/t timeout 200 ./loadgen-gt gpu --runs 3 --connections 8 --slice-bytes 1M --window-bytes 8M --ops push "$@" 2>&1 | grep -v "^{" | grep "push:"
  for f in /tmp/g/*.sums; do echo "$(basename $f): $(awk '$1=="cuda"{printf "cuda lockwait=%.3fs enqueue=%.3fs event=%.3fs n=%d  ", $2/1e9, $3/1e9, $4/1e9, $5} $2>0 && ($1==1||$1==5||$1==6||$1==3||$1==7||$1==4){printf "%s:n=%d,sum=%.3fs,avg=%.1fus  ", $1, $2, $3/1e9, $3/$2/1e3}' $f)"; done
}
run
run --block-bytes 1M
