#!/bin/bash
# Experiment: a runtime task that only yields (a worker keeps polling the
# sockets) against the default (workers sleep in epoll), ring latency, alternated.
R=$PWD; cd $OUT; nproc; mkdir -p raw; S=$R/gpu-bin/s14
i=0
for v in ${ORDER:-off spin off spin off spin}; do
  i=$((i+1)); a=""; [ $v = spin ] && a="--sidecar-arg=--runtime-spin"
  timeout 150 $S/spin/loadgen bench --only latency --latency-paths ring --latency-samples 2000 --connections 4 --transport tcp $a > raw/l$i-$v.json 2>raw/l$i-$v.err; echo "$v rc $? ($SECONDS s)"
  grep -E "^latency|^layerwise" raw/l$i-$v.err | cut -c1-170
done
tar czf spin-${TAG:-x}.tgz raw; rm -rf raw
