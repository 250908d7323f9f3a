#!/bin/bash
# Final binary on 16 cores: busy poll is off by default above 4 CPUs; the
# same binary with it forced on (1000 us), alternated, ring latency.
R=$PWD; cd $OUT; nproc; mkdir -p raw; S=$R/gpu-bin/s14
i=0
for v in ${ORDER:-default on default on default on}; do
  i=$((i+1)); a=""; [ $v = on ] && a="--sidecar-arg=--runtime-busy-poll-us=1000"
  timeout 150 $S/final/loadgen bench --only latency --latency-paths ring,grpc --latency-samples 2000 --connections 4 --transport tcp $a > raw/l$i-$v.json 2>raw/l$i-$v.err; echo "$v rc $? ($SECONDS s)"
  grep -E "^latency|^layerwise" raw/l$i-$v.err | cut -c1-170
done
tar czf final-${TAG:-x}.tgz raw; rm -rf raw
