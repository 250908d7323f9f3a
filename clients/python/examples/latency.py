"""4 KiB push latency through the Python client: from the push call to the
decode worker's PUSH_RECEIVED notification, as `loadgen bench --only latency`
measures it for the Rust client. With --loadgen, runs that benchmark too (its
own sidecars, TCP) and prints both figures side by side.

  latency.py --prefill-socket P.sock --decode-socket D.sock [--loadgen target/release/loadgen]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import numpy as np

import kvrail


def percentile(xs: list[float], p: float) -> float:
    return float(np.percentile(np.array(xs), p))


def measure(prefill: str, decode: str, samples: int) -> dict:
    layout = kvrail.Layout.dense(1, 1, 1024, 4096)
    mems = [kvrail.SharedMemory(kvrail.shm_dir() / f"kvrail-latency-{side}-{os.getpid()}", layout.extent())
            for side in ("p", "d")]
    try:
        with kvrail.Client(prefill, "lat-p") as p, kvrail.Client(decode, "lat-d") as d, d.notifications() as notes:
            src, dst = p.register_shm(mems[0].path, layout), d.register_shm(mems[1].path, layout)
            lat, api = [], []
            for i in range(samples + 50):  # the first 50 warm the path up
                b = i % 1024
                start = time.perf_counter()
                p.push(f"lat-{i}", "decode", kvrail.Blocks(src, [b]), kvrail.Blocks(dst, [b]))
                while True:
                    n = notes.get(timeout=10).raise_if_failed()
                    if n.request_id == f"lat-{i}":
                        break
                if i >= 50:
                    lat.append((time.perf_counter() - start) * 1e6)
            for _ in range(samples):
                start = time.perf_counter()
                p.peers()
                api.append((time.perf_counter() - start) * 1e6)
            p.unregister(src), d.unregister(dst)
    finally:
        for m in mems:
            m.unlink()
    return {"client": "python", "p50_us": round(percentile(lat, 50), 1), "p99_us": round(percentile(lat, 99), 1),
            "api_roundtrip_p50_us": round(percentile(api, 50), 1), "samples": samples}


def rust(loadgen: str, samples: int) -> dict:
    out = subprocess.run([loadgen, "bench", "--only", "latency", "--transport", "tcp",
                          "--latency-samples", str(samples)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        v = json.loads(line)
        if v.get("bench") == "latency":
            return {"client": "rust", "p50_us": v["p50_us"], "p99_us": v["p99_us"],
                    "api_roundtrip_p50_us": v["api_roundtrip_p50_us"], "samples": samples}
    raise SystemExit(f"no latency line from {loadgen}: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-socket", required=True)
    ap.add_argument("--decode-socket", required=True)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--loadgen", help="loadgen binary: measure the Rust client too, in this run")
    ap.add_argument("--rounds", type=int, default=3, help="alternate Python and Rust this many times")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds if args.loadgen else 1):
        rows.append({"round": r, **measure(args.prefill_socket, args.decode_socket, args.samples)})
        print(json.dumps(rows[-1]), flush=True)
        if args.loadgen:
            rows.append({"round": r, **rust(args.loadgen, args.samples)})
            print(json.dumps(rows[-1]), flush=True)
    if args.loadgen:
        py = float(np.median([x["p50_us"] for x in rows if x["client"] == "python"]))
        rs = float(np.median([x["p50_us"] for x in rows if x["client"] == "rust"]))
        print(json.dumps({"bench": "latency", "bytes": 4096, "python_p50_us": py, "rust_p50_us": rs,
                          "python_over_rust": round(py / rs, 2), "python_added_us": round(py - rs, 1)}))


if __name__ == "__main__":
    main()
