#!/usr/bin/env bash
# Builds and runs the floors: small C programs that do what kvrail does on a
# path with no kvrail in it, so that kvrail's figures can be set against what
# the machine allows (docs/benchmarks.md, "Floors without kvrail").
#
#   tools/bench/floors.sh                     every floor, with the arguments of docs/benchmarks.md
#   tools/bench/floors.sh --quick             every floor, small and short (a smoke run)
#   tools/bench/floors.sh FLOOR [ARGS...]     one floor; no ARGS: its docs/benchmarks.md arguments
#   tools/bench/floors.sh build               only build
#
# FLOOR is one of:
#   sp        copy|splice K SIZE ROUNDS [hot]   cold regions over K loopback TCP connections
#   tcpfloor  SIZE K ROUNDS                     one-way loopback push with spinning threads
#   chain     [SIZE [ROUNDS [SPIN_US]]]         kvrail's small-push path: futex doorbell, TCP hop, futex
#   memlayout THREADS [RUNS]                    the vLLM batch's layout against contiguous, memory only
#   landing   [THREADS [CHUNK [REGION [ROUNDS]]]] received chunks into a region: memcpy, streaming stores
#
# Binaries go to $KVRAIL_BENCH_BUILD (default: target/bench-floors in the
# repository), built with `cc -O2 -pthread` (CC and CFLAGS override) when a
# source is newer than its binary. Each program prints JSON lines on stdout;
# this script prints the command before each run. Works from any directory.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
build=${KVRAIL_BENCH_BUILD:-$repo/target/bench-floors}
cc=${CC:-cc}
cflags=${CFLAGS:--O2}
floors=(sp tcpfloor chain memlayout landing)

usage() {
	sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
	exit "${1:-2}"
}

build_one() { # build_one NAME: compile NAME.c unless its binary is newer
	local name=$1 src=$here/$1.c out=$build/$1
	if [ ! -x "$out" ] || [ "$src" -nt "$out" ]; then
		mkdir -p "$build"
		# shellcheck disable=SC2086 # CFLAGS is a list of flags
		"$cc" $cflags -pthread -o "$out.tmp" "$src"
		mv "$out.tmp" "$out"
	fi
}

build_all() {
	local f
	for f in "${floors[@]}"; do build_one "$f"; done
}

run() { # run NAME ARGS...: print the command, then run it
	local name=$1
	shift
	printf '$ %s %s\n' "$name" "$*" >&2
	"$build/$name" "$@"
}

# The runs behind the figures of docs/benchmarks.md.
full_sp() {
	local k
	for k in 4 8 16; do
		run sp copy "$k" 268435456 8
		run sp copy "$k" 268435456 8 hot
	done
}
full_tcpfloor() {
	local spec
	for spec in "4096 1" "65536 1" "65536 4" "1048576 1" "1048576 2" "1048576 4"; do
		# shellcheck disable=SC2086 # "SIZE K" splits into two arguments
		run tcpfloor $spec 2000
	done
}
full_chain() {
	run chain 4096 3000 0
	run chain 4096 3000 50
}
full_memlayout() {
	local t
	for t in 4 8 16; do run memlayout "$t" 10; done
}
full_landing() {
	local t
	for t in 1 4 8 16; do run landing "$t" 65536 268435456 8; done
}

# The same paths, small enough for a 2-core machine in a few seconds.
quick_sp() {
	run sp copy 2 33554432 2
	run sp copy 2 33554432 2 hot
}
quick_tcpfloor() {
	run tcpfloor 4096 1 200
	run tcpfloor 1048576 2 50
}
quick_chain() {
	run chain 4096 300 0
	run chain 4096 300 50
}
quick_memlayout() {
	run memlayout 2 1
}
quick_landing() {
	run landing 2 65536 16777216 2
}

is_floor() {
	local f
	for f in "${floors[@]}"; do [ "$f" = "$1" ] && return 0; done
	return 1
}

case ${1:-all} in
-h | --help) usage 0 ;;
build)
	build_all
	echo "built: $build/{$(
		IFS=,
		echo "${floors[*]}"
	)}" >&2
	;;
all | --quick)
	mode=full
	[ "${1:-}" = --quick ] && mode=quick
	build_all
	for f in "${floors[@]}"; do "${mode}_$f"; done
	;;
*)
	is_floor "$1" || {
		echo "floors.sh: unknown floor or command: $1" >&2
		usage
	}
	name=$1
	shift
	build_one "$name"
	if [ $# -eq 0 ]; then
		"full_$name"
	else
		run "$name" "$@"
	fi
	;;
esac
