"""4 KiB push latency through the Python client: the ring beside gRPC, and
the Rust client's ring (``loadgen bench --only latency``) in the same run;
``python_client_push`` is ``Client.push`` as a worker calls it (through its
ring by default) with the notification read from the stream.

    python clients/python/benchmarks/ring_latency.py --kvrail target/release/kvrail \
        --loadgen target/release/loadgen --samples 2000

Measured: a push submitted (ring) or called (gRPC) on the prefill worker to
the PUSH_RECEIVED notification in the decode worker's ring (or stream), for
each ring implementation built here (``python_ring_native``: the compiled
extension; ``python_ring_python``: pure Python, x86-64); ``python_ring`` is
the one a worker gets by default. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import conftest  # noqa: E402  (the tests' sidecar pair)

from kvrail import Blocks, Client, HostKvCache  # noqa: E402
from kvrail.ring import RingClosed, _pick_impl  # noqa: E402


def ring_impl_available(impl: str) -> bool:
    try:
        _pick_impl(impl)
    except RingClosed:
        return False
    return True


def pct(xs: list[float], p: float) -> float:
    return round(float(np.percentile(np.array(xs), p)), 1)


def timed_push(client: Client, notes, rid: str, src: Blocks, dst: Blocks) -> float:
    """Microseconds from ``client.push`` to the decode worker's notification
    of it on the ``notes`` stream."""
    t = time.perf_counter()
    client.push(rid, "decode", src, dst)
    while notes.get(timeout=10).request_id != rid:
        pass
    return (time.perf_counter() - t) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvrail", required=True)
    ap.add_argument("--loadgen")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--ring-spin-us", type=int,
                    help="the sidecars' ring spin (default: theirs), loadgen's sidecars too")
    a = ap.parse_args()
    os.environ["KVRAIL_BIN"] = a.kvrail
    out: dict[str, object] = {"bench": "python_ring_latency", "bytes": 4096, "samples": a.samples}
    with tempfile.TemporaryDirectory() as tmp:
        spin = () if a.ring_spin_us is None else ("--ring-spin-us", str(a.ring_spin_us))
        out["ring_spin_us"] = a.ring_spin_us
        pair = conftest.Pair(Path(tmp), *spin)
        try:
            shape = (16, 2, 64)
            src = HostKvCache(pair.shm("src"), 1, 64, shape, np.float16)
            dst = HostKvCache(pair.shm("dst"), 1, 64, shape, np.float16)
            impls = [i for i in ("native", "python") if ring_impl_available(i)]
            out["ring_impls"] = impls
            with contextlib.ExitStack() as stack:
                def client(socket, name, **kw):
                    return stack.enter_context(Client(socket, name, **kw))
                # Per ring implementation its own pair of workers (a worker's
                # notifications go to one ring).
                rings = {}
                for n, impl in enumerate(impls):
                    p, d = client(pair.prefill.socket, f"p{n}r"), client(pair.decode.socket, f"d{n}r")
                    ids = (p.register_kv_cache(src), d.register_kv_cache(dst))
                    rings[impl] = (stack.enter_context(p.open_ring(impl=impl)),
                                   stack.enter_context(d.open_ring(impl=impl)), ids)
                pg = client(pair.prefill.socket, "p1", submit_path="grpc")
                dg = client(pair.decode.socket, "d1")
                pc, dc = client(pair.prefill.socket, "p2"), client(pair.decode.socket, "d2")
                gsid, gdid = pg.register_kv_cache(src), dg.register_kv_cache(dst)
                csid, cdid = pc.register_kv_cache(src), dc.register_kv_cache(dst)
                notes, cnotes = stack.enter_context(dg.notifications()), stack.enter_context(dc.notifications())
                ring_lat = {i: [] for i in impls}
                submit = {i: [] for i in impls}
                grpc_lat, client_lat = [], []
                # As `loadgen bench --only latency` does it: rounds alternate
                # the paths so all see the same machine, and each round's
                # samples follow one another (a sample does not find the
                # sidecar asleep because another path ran in between).
                rounds = 10
                per_round = -(-a.samples // rounds)
                for rnd in range(rounds + 1):
                    n = 100 if rnd == 0 else per_round  # round 0 warms up
                    keep = rnd > 0
                    for impl, (pr, dr, (sid, did)) in rings.items():
                        for i in range(n):
                            b = (rnd * per_round + i) % 64
                            rid = f"{impl}{rnd}-{i}"
                            t0 = time.perf_counter()
                            pr.submit_push(rid, "decode", Blocks(sid, [b]), Blocks(did, [b]))
                            t1 = time.perf_counter()
                            while True:
                                c = dr.wait(10.0)
                                assert c is not None, "no completion within 10 s"
                                if c.request_id == rid:
                                    assert c.kind == "PUSH_RECEIVED", c
                                    break
                            t2 = time.perf_counter()
                            done = 0
                            while done < 2:  # ACCEPTED and PUSH_DONE on the sender's ring
                                c = pr.wait(10.0)
                                assert c is not None and c.kind in ("ACCEPTED", "PUSH_DONE"), c
                                done += 1
                            if keep:
                                ring_lat[impl].append((t2 - t0) * 1e6)
                                submit[impl].append((t1 - t0) * 1e6)
                    for i in range(n):
                        b = (rnd * per_round + i) % 64
                        us = timed_push(pg, notes, f"g{rnd}-{i}", Blocks(gsid, [b]), Blocks(gdid, [b]))
                        if keep:
                            grpc_lat.append(us)
                    # Client.push as a worker calls it (through its ring
                    # by default), the notification from the stream.
                    for i in range(n):
                        b = (rnd * per_round + i) % 64
                        us = timed_push(pc, cnotes, f"c{rnd}-{i}", Blocks(csid, [b]), Blocks(cdid, [b]))
                        if keep:
                            client_lat.append(us)
                for impl in impls:
                    out[f"python_ring_{impl}"] = {
                        "p50_us": pct(ring_lat[impl], 50), "p99_us": pct(ring_lat[impl], 99),
                        "p999_us": pct(ring_lat[impl], 99.9), "submit_p50_us": pct(submit[impl], 50)}
                # The implementation a worker gets by default.
                out["python_ring"] = out[f"python_ring_{impls[0]}"]
                out["python_grpc"] = {"p50_us": pct(grpc_lat, 50), "p99_us": pct(grpc_lat, 99),
                                      "p999_us": pct(grpc_lat, 99.9)}
                out["python_client_push"] = {"p50_us": pct(client_lat, 50), "p99_us": pct(client_lat, 99),
                                             "p999_us": pct(client_lat, 99.9)}
            src.close() if hasattr(src, "close") else None
        finally:
            pair.stop()
            for f in Path("/dev/shm").glob(f"kvrail-pytest-{os.getpid()}-*"):
                f.unlink()
    if a.loadgen:
        r = subprocess.run([a.loadgen, "bench", "--only", "latency", "--latency-samples", str(a.samples),
                            "--transport", "tcp", *(f"--sidecar-arg={x}" for x in spin)],
                           capture_output=True, text=True, check=True)
        for line in r.stdout.splitlines():
            v = json.loads(line)
            if v.get("bench") == "latency_path" and v.get("path") == "ring" and v.get("bytes") == 4096:
                out["rust_ring"] = {k: v[k] for k in ("p50_us", "p99_us", "p999_us", "submit_p50_us")}
                out["python_over_rust_p50"] = round(out["python_ring"]["p50_us"] / max(v["p50_us"], 1), 2)
                for impl in out["ring_impls"]:
                    out[f"python_{impl}_over_rust_p50"] = round(
                        out[f"python_ring_{impl}"]["p50_us"] / max(v["p50_us"], 1), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
