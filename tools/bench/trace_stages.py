#!/usr/bin/env python3
"""Where a push's time goes, from the files of one traced latency run.

    KVRAIL_TRACE=/tmp/t/t loadgen bench --only latency --latency-paths ring \\
        --latency-sizes 4K --latency-layers 0 ...   (a `--features kvrail-sidecar/profile` build)
    python3 tools/bench/trace_stages.py /tmp/t/*.trace [--timeline]

Three files: the bench's (points 20/21), the sending sidecar's (it has point 1)
and the receiving sidecar's. Points: crates/kvrail-sidecar/src/trace_points.rs.
Prints each stage's p50/p90/p99/max along the push's path (cross-process, by
the wall clock), each stage's excess over its median in the slowest 1% of
pushes, then the p50/p99 of the gaps between consecutive points inside each
sidecar. Lines are `point ns thread`. `--timeline`: for larger pushes, each
point's first time after the submission instead (writer task, payload reads).
"""
import bisect
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
procs = []
for f in args:
    pts = {}
    for line in open(f):
        p, t = line.split()[:2]
        pts.setdefault(int(p), []).append(int(t))
    for v in pts.values():
        v.sort()
    procs.append(pts)
bench = next(p for p in procs if 20 in p)
snd = next(p for p in procs if 1 in p)
rcv = next(p for p in procs if 1 not in p and 20 not in p)
WARM = 50  # the bench's warm-up round


def after(lst, t):
    i = bisect.bisect_left(lst, t)
    return lst[i] if i < len(lst) else None


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))] / 1000 if v else float("nan")


def med(v):
    return pct(v, 0.5)


pushes = list(zip(bench[20][WARM:], bench[21][WARM:]))
if "--timeline" in sys.argv:
    rows = {}
    for t0, t1 in pushes:
        for name, proc, pts in (("sender", snd, [1, 36, 60, 61, 62]),
                                ("receiver", rcv, [10, 40, 45, 43, 44, 11, 12])):
            for p in pts:
                l = proc.get(p, [])
                i = bisect.bisect_left(l, t0)
                if i < len(l) and l[i] <= t1:
                    rows.setdefault(f"{name} {p}", []).append(l[i] - t0)
        rows.setdefault("notified", []).append(t1 - t0)
    for k, v in rows.items():
        print(f"{k:14} first at p50 {med(v):8.1f} us ({len(v)} pushes)")
    sys.exit()

stages = []
for t0, t21 in pushes:
    s1 = after(snd[1], t0)
    s2 = after(snd.get(2, []), s1) if s1 else None
    s3 = after(snd.get(3, []), s2) if s2 else None
    r10 = after(rcv[10], s2) if s2 else None
    r11 = after(rcv[11], r10) if r10 else None
    r12 = after(rcv[12], r11) if r11 else None
    r13 = after(rcv[13], r12) if r12 else None
    if None in (s1, s2, s3, r10, r11, r12, r13) or r13 > t21 + 1000:
        continue
    stages.append({
        "submit to the ring's thread": s1 - t0,
        "ring's thread to its write": s2 - s1,
        "the write (loopback send)": s3 - s2,
        "write start to the reader": r10 - s2,
        "reader to the transfer's end": r11 - r10,
        "end to the ring completion": r12 - r11,
        "completion written, bell rung": r13 - r12,
        "to the bench's wake": t21 - r13,
        "total": t21 - t0,
    })
print(f"{len(stages)} pushes")
for k in stages[0] if stages else []:
    v = [s[k] for s in stages]
    print(f"{k:32} p50 {med(v):7.1f}  p90 {pct(v, 0.9):7.1f}  p99 {pct(v, 0.99):7.1f}"
          f"  max {max(v) / 1000:8.1f} us")
# The tail: in the slowest 1% of pushes, how far each stage was above its own
# median, so the stage that holds the tail stands out.
if stages:
    cut = pct([s["total"] for s in stages], 0.99) * 1000
    slow = [s for s in stages if s["total"] >= cut]
    print(f"slowest {len(slow)} pushes (total >= {cut / 1000:.1f} us), each stage's excess over its p50:")
    for k in stages[0]:
        base = med([s[k] for s in stages]) * 1000
        ex = sorted(s[k] - base for s in slow)
        print(f"  {k:32} median {ex[len(ex) // 2] / 1000:7.1f}  max {ex[-1] / 1000:7.1f} us")


def gaps(proc, seq, name):
    out = {}
    for t0 in proc.get(seq[0], [])[WARM:]:
        prev, row = t0, []
        for p in seq[1:]:
            t = after(proc.get(p, []), prev)
            if t is None or t - prev > 200_000:
                row = None
                break
            row.append(t - prev)
            prev = t
        if row:
            for p, d in zip(seq[1:], row):
                out.setdefault(p, []).append(d)
    print(name, "(p50/p99)", " ".join(f"->{p}: {med(v):.2f}/{pct(v, 0.99):.1f}" for p, v in out.items()))


gaps(snd, [1, 30, 31, 32, 33, 34, 35, 36, 2, 3], "sender us")
gaps(rcv, [10, 40, 41, 42, 45, 43, 44, 11, 12, 13], "receiver us")
