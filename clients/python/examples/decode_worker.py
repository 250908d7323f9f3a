"""A decode worker: owns a paged KV cache in shared memory and receives a
request's blocks from a prefill node, by push (it waits to be written) or by pull
(it reads the prefill worker's exposed blocks). It verifies every byte.
See prefill_worker.py for how to run the pair.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import kvrail
from kvrail.engine_sim import mismatched_layers
from prefill_worker import wait_for_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--socket", required=True, help="the local sidecar's socket")
    ap.add_argument("--handoff", required=True, type=Path, help="file shared with the prefill worker")
    ap.add_argument("--pull", action="store_true", help="pull from the prefill worker instead of waiting for its push")
    ap.add_argument("--peer", default="prefill", help="prefill node (pull mode)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=42, help="the prefill worker's seed (push mode)")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    path = kvrail.shm_dir() / f"kvrail-example-decode-{os.getpid()}"
    kv = kvrail.HostKvCache(path, args.layers, args.num_blocks, (16, args.kv_heads, args.head_size), np.uint16)
    nblocks = -(-args.tokens // 16)
    # Blocks of its own, elsewhere than the prefill worker's.
    blocks = list(range(args.num_blocks - nblocks, args.num_blocks))[::-1]
    try:
        with kvrail.Client(args.socket, "decode-0") as c, c.notifications() as notes:
            region = c.register_kv_cache(kv)
            start = time.monotonic()
            if args.pull:
                h = wait_for_file(args.handoff, args.timeout)
                seed = h["seed"]
                start = time.monotonic()
                t = c.pull(h["request_id"], args.peer, kvrail.Blocks(h["region_id"], h["block_ids"], 0, h["layers"]),
                           kvrail.Blocks(region, blocks, 0, args.layers))
                n = notes.get(timeout=args.timeout).raise_if_failed()
                assert n.kind == kvrail.PULL_DONE, n
                moved = t.total_bytes
            else:
                seed = args.seed
                tmp = args.handoff.with_suffix(".tmp")
                tmp.write_text(json.dumps({"node": c.peers().node_name, "region_id": region, "layers": args.layers,
                                           "block_ids": blocks, "request_id": "req-0"}))
                tmp.replace(args.handoff)
                n = notes.get(timeout=args.timeout).raise_if_failed()
                assert n.kind == kvrail.PUSH_RECEIVED, n
                moved = n.bytes
            secs = time.monotonic() - start
            bad = mismatched_layers(kv, blocks, seed)
            c.unregister(region)
        print(json.dumps({"worker": "decode", "mode": "pull" if args.pull else "push", "bytes": moved,
                          "blocks": nblocks, "layers": args.layers, "verified": not bad, "bad_layers": bad,
                          "waited_seconds": round(secs, 4)}))
        if bad:
            raise SystemExit(f"layers {bad} differ from what the prefill worker wrote")
    finally:
        kv.unlink()
        if args.handoff.exists() and not args.pull:
            args.handoff.unlink()


if __name__ == "__main__":
    main()
