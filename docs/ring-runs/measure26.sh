#!/bin/bash
# Floors without kvrail on the same host: the vLLM batch's layout in plain
# memcpy (memlayout.c) and one-way loopback TCP with spinning threads
# (tcpfloor.c), beside kvrail's ring latency (spread off = main's behaviour).
R=$PWD; cd $OUT; nproc; mkdir -p raw; S=$R/gpu-bin/s14
for t in 4 8 16; do $S/memlayout $t 10 | tee raw/mem-$t.json; done
for spec in "4096 1" "65536 1" "65536 4" "1048576 1" "1048576 2" "1048576 4" "1048576 8"; do
  timeout 60 $S/tcpfloor $spec 2000 | tee -a raw/tcpfloor.json
done
for r in 1 2; do
  timeout 150 $S/loadgen bench --only latency --latency-paths ring --latency-samples 2000 --connections 4 --transport tcp --sidecar-arg=--spread-slice-bytes=0 > raw/l$r.json 2>raw/l$r.err; echo "kvrail rc $?"
  grep -E "^latency" raw/l$r.err | cut -c1-170
done
tar czf floors-${TAG:-x}.tgz raw; rm -rf raw
