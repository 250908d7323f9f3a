"""A prefill worker: computes (here: writes a checkable pattern into) a request's
paged KV blocks and hands them to a decode node, by pushing them into the decode
worker's blocks or by exposing them for the decode worker to pull.

Push:  decode_worker.py --socket D.sock --handoff h.json            (start first)
       prefill_worker.py --socket P.sock --handoff h.json
Pull:  prefill_worker.py --socket P.sock --handoff h.json --expose  (start first)
       decode_worker.py --socket D.sock --handoff h.json --pull
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import kvrail
from kvrail.engine_sim import layer_pattern, write_blocks


def wait_for_file(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no hand-off at {path} within {timeout} s (start the other worker)")
        time.sleep(0.05)
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", required=True, help="the local sidecar's socket")
    ap.add_argument("--handoff", required=True, type=Path, help="file shared with the decode worker")
    ap.add_argument("--expose", action="store_true", help="let the decode worker pull instead of pushing")
    ap.add_argument("--peer", default="decode", help="decode node (push mode)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=256, help="blocks in this worker's KV cache")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length (16 tokens per block)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    path = kvrail.shm_dir() / f"kvrail-example-prefill-{os.getpid()}"
    # vLLM's FlashAttention layout: per layer [2, num_blocks, 16, kv_heads, head_size], bf16.
    kv = kvrail.HostKvCache(path, args.layers, args.num_blocks, (16, args.kv_heads, args.head_size), np.uint16)
    nblocks = -(-args.tokens // 16)
    # Scattered blocks, as a paged allocator hands them out.
    blocks = sorted(np.random.default_rng(args.seed).choice(args.num_blocks, nblocks, replace=False).tolist())
    layer_bytes = kv.layout.planes_per_layer * nblocks * kv.layout.block_bytes
    for layer in range(args.layers):
        write_blocks(kv, layer, blocks, layer_pattern(args.seed, layer, layer_bytes))
    try:
        with kvrail.Client(args.socket, "prefill-0") as c, c.notifications() as notes:
            region = c.register_kv_cache(kv, expose=args.expose)
            if args.expose:
                node = c.peers().node_name
                tmp = args.handoff.with_suffix(".tmp")
                tmp.write_text(json.dumps({"node": node, "region_id": region, "layers": args.layers,
                                           "block_ids": blocks, "request_id": "req-0", "seed": args.seed}))
                tmp.replace(args.handoff)
                n = notes.get(timeout=args.timeout).raise_if_failed()
                assert n.kind == kvrail.PULL_SERVED, n
                print(json.dumps({"worker": "prefill", "mode": "pull", "served_bytes": n.bytes, "blocks": nblocks}))
                args.handoff.unlink()
            else:
                h = wait_for_file(args.handoff, args.timeout)
                start = time.monotonic()
                t = c.push(h["request_id"], args.peer, kvrail.Blocks(region, blocks, 0, args.layers),
                           kvrail.Blocks(h["region_id"], h["block_ids"], 0, h["layers"]))
                n = notes.get(timeout=args.timeout).raise_if_failed()
                assert n.kind == kvrail.PUSH_DONE, n
                secs = time.monotonic() - start
                print(json.dumps({"worker": "prefill", "mode": "push", "bytes": t.total_bytes,
                                  "segments": t.segments, "seconds": round(secs, 4),
                                  "gbit_per_s": round(t.total_bytes * 8 / secs / 1e9, 2)}))
            c.unregister(region)
    finally:
        kv.unlink()


if __name__ == "__main__":
    main()
