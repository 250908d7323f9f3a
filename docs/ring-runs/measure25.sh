#!/bin/bash
# Small transfers spread over idle connections (the default above 4 cores)
# against one slice per transfer (--spread-slice-bytes=0), ring latency,
# alternated in one call; the vLLM batch both ways; and the memory system's
# own cost of the vLLM batch's layout (memlayout.c, no sockets).
R=$PWD; cd $OUT; nproc; mkdir -p raw; S=$R/gpu-bin/s14
for t in 8 16; do $S/memlayout $t 5 | tee raw/mem-$t.json; done
i=0
for c in ${CONNS:-4 8}; do
  for v in ${ORDER:-off on off on off on}; do
    i=$((i+1)); a=""; [ $v = off ] && a="--sidecar-arg=--spread-slice-bytes=0"
    timeout 150 $S/loadgen bench --only latency --latency-paths ring --latency-samples 2000 --connections $c --transport tcp $a > raw/l$i-$v-$c.json 2>raw/l$i-$v-$c.err; echo "$v $c rc $? ($SECONDS s)"
    grep -E "^latency|^layerwise" raw/l$i-$v-$c.err | cut -c1-170
  done
done
for v in ${VORDER:-off on}; do
  i=$((i+1)); a=""; [ $v = off ] && a="--sidecar-arg=--spread-slice-bytes=0"
  timeout 150 $S/loadgen bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp $a > raw/b$i-$v.json 2>raw/b$i-$v.err; echo "$v bench rc $? ($SECONDS s)"
  grep -E "^(single|scattered|vllm)" raw/b$i-$v.err | cut -c1-150
done
tar czf spread-${TAG:-x}.tgz raw; rm -rf raw
