#!/usr/bin/env bash
# Builds of loadgen against each other, alternated on one machine with the
# order rotated each round: TCP 256 MiB pushes at 8 connections and the 4 KiB
# ring push latency. Only builds alternated in one call are compared
# (machine instances differ by more than most changes).
#
#   tools/bench/ab.sh ROUNDS NAME=PATH/TO/loadgen NAME=PATH/TO/loadgen [...]
#
# Prints one line per measurement, then min, max and mean per build.
set -euo pipefail
rounds=${1:?rounds}
shift
names=() paths=()
for b in "$@"; do names+=("${b%%=*}"); paths+=("${b#*=}"); done
n=${#names[@]}
[ "$n" -ge 2 ] || { echo "give at least two builds as NAME=PATH" >&2; exit 2; }
for round in $(seq 1 "$rounds"); do
  for k in $(seq 0 $((n - 1))); do
    i=$(( (k + round) % n ))
    "${paths[$i]}" bench --transport tcp --connections 8 --only single --sizes 256M \
      --ops push --bytes-per-point 4G 2>/dev/null | grep '"bench":"single"' | sed "s/^/$round ${names[$i]} /"
    "${paths[$i]}" bench --transport tcp --connections 4 --only latency --latency-paths ring \
      --latency-sizes 4K --latency-layers 0 --latency-samples 3000 2>/dev/null \
      | grep '"bench":"latency_path"' | sed "s/^/$round ${names[$i]} /"
  done
done | python3 -c '
import json, sys
seen = {}
for line in sys.stdin:
    r, b, rest = line.split(" ", 2)
    d = json.loads(rest)
    if d["bench"] == "single":
        key, v = "tcp 256M push at 8 (GB/s)", d["gbps"]
    else:
        key, v = "4K ring p50 (us)", d["p50_us"]
    print(r, b, key, v)
    seen.setdefault((key, b), []).append(v)
for (key, b), v in sorted(seen.items()):
    print(f"{key} {b}: {min(v)}-{max(v)} mean {sum(v) / len(v):.2f}")
'
