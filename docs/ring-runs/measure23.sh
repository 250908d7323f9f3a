#!/bin/bash
# Placement gates (new) against the per-slice link lock (old), TCP, alternated.
R=$PWD; cd $OUT; nproc; mkdir -p raw; S=$R/gpu-bin/s13
export LD_LIBRARY_PATH=$S/lib; which iperf3 >/dev/null 2>&1 && iperf3 --version >/dev/null 2>&1 || export PATH=$S/bin:$PATH; iperf3 --version | head -1
i=0
for c in ${CONNS:-8 16}; do
  timeout 120 $S/new/loadgen bench --only iperf3 --connections $c --transport tcp > raw/iperf-$c.json 2>raw/iperf-$c.err; echo "iperf3 $c rc $?"; grep -E "^iperf3" raw/iperf-$c.err | cut -c1-150
  for v in ${ORDER:-old new old new}; do
    i=$((i+1))
    timeout 150 $S/$v/loadgen bench --only ${ONLY:-single,scattered,vllm} --sizes 256M --ops push,pull --connections $c --transport tcp > raw/b$i-$v-$c.json 2>raw/b$i-$v-$c.err; echo "$v $c rc $? ($SECONDS s)"
    grep -E "^(single|scattered|vllm)" raw/b$i-$v-$c.err | cut -c1-140
  done
done
for v in ${PROFILE-old new}; do
  KVRAIL_PROFILE=$OUT/raw/p-$v timeout 150 $S/$v/loadgen bench --only single --sizes 256M --ops push --connections 16 --transport tcp > raw/p-$v.json 2>raw/p-$v.err; echo "profiled $v rc $?"
  grep -E "^single" raw/p-$v.err | cut -c1-140
  cat raw/p-$v*.counters 2>/dev/null
done
ls raw | head -50
tar czf gates-${TAG:-x}.tgz raw; rm -rf raw
