#!/bin/bash
# Does backing /dev/shm with huge pages change the vLLM-shaped batch's ratio?
R=$PWD; cd $OUT; mkdir -p raw; S=$R/gpu-bin/s13
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled
mount | grep -E " /dev/shm " ; id -u
run() {
  timeout 100 $S/new/loadgen bench --only single,scattered,vllm --sizes 256M --ops push,pull --connections 8 --transport tcp > raw/$1.json 2>raw/$1.err; echo "$1 rc $?"
  grep -E "^(single|scattered|vllm)" raw/$1.err | sed 's/  *p50.*cpu/ cpu/' | cut -c1-120
}
run plain1
mount -o remount,huge=always /dev/shm && echo remounted huge=always; mount | grep -E " /dev/shm "
run huge1
mount -o remount,huge=never /dev/shm && echo remounted huge=never
run plain2
mount -o remount,huge=always /dev/shm
run huge2
grep -i "ShmemHugePages\|ShmemPmdMapped" /proc/meminfo
mount -o remount,huge=never /dev/shm
tar czf thp.tgz raw; rm -rf raw
