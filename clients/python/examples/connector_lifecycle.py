"""The vLLM-shaped connector through whole request lifecycles, between two
sidecars: prefill -> transfer -> decode -> free, in pull and in push mode, and
an aborted request on each side. The engines are kvrail.engine_sim's stand-ins
for vLLM's scheduler and model runner (the calls and their order are vLLM's).

  connector_lifecycle.py --prefill-socket P.sock --decode-socket D.sock
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import kvrail
from kvrail.engine_sim import MiniEngine, Request, mismatched_layers

BLOCK_SHAPE = (16, 8, 128)  # Llama-3.1-8B: 16 tokens x 8 KV heads x 128, bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-socket", required=True)
    ap.add_argument("--decode-socket", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--num-blocks", type=int, default=256)
    args = ap.parse_args()
    prompt = list(range(args.tokens))
    caches = []

    def engine(socket: str, mode: str, name: str, role: str, **extra) -> MiniEngine:
        path = kvrail.shm_dir() / f"kvrail-example-{name}-{mode}-{os.getpid()}"
        kv = kvrail.HostKvCache(path, args.layers, args.num_blocks, BLOCK_SHAPE, np.uint16)
        caches.append(kv)
        return MiniEngine(socket, mode, f"{name}-{mode}", role, kv, **extra)

    try:
        for mode in ("pull", "push"):
            p = engine(args.prefill_socket, mode, "prefill", "kv_producer")
            d = engine(args.decode_socket, mode, "decode", "kv_consumer", timeout_s=5)
            start = time.monotonic()
            if mode == "pull":
                # Prefill first; its kv_transfer_params go to the decode engine.
                params = p.prefill(Request("r1", prompt, {"do_remote_decode": True}), seed=1)
                req = Request("r1", prompt, params)
                blocks = d.admit_remote(req)
            else:
                # Decode first; the router hands its push target to the prefill engine.
                req = Request("r1", prompt, {"do_remote_prefill": True})
                blocks = d.admit_remote(req)
                p.prefill(Request("r1-prefill", prompt, d.scheduler.push_target("r1")), seed=1)
            d.run_until(lambda: "r1" in d.finished_recving)
            loaded = time.monotonic() - start
            bad = mismatched_layers(d.kv, blocks, seed=1)
            errors = d.worker.get_block_ids_with_load_errors()
            sent = "r1" if mode == "pull" else "r1-prefill"
            p.run_until(lambda: sent in p.finished_sending)
            d.finish(req)  # decode ran; vLLM frees the blocks
            print(json.dumps({"mode": mode, "request": "r1", "tokens": args.tokens, "layers": args.layers,
                              "bytes": d.kv.layout.request_bytes(len(blocks)), "load_seconds": round(loaded, 4),
                              "verified": not bad and not errors, "prefill_blocks_freed": len(p.free) == args.num_blocks,
                              "decode_blocks_freed": len(d.free) == args.num_blocks}))
            if bad or errors:
                raise SystemExit(f"{mode}: layers {bad} differ, load errors in blocks {sorted(errors)}")
            # Aborted on the prefill side: nothing is sent and the blocks come back at once.
            params = p.prefill(Request("r2", prompt, {"do_remote_decode": True}), seed=2, abort=True)
            print(json.dumps({"mode": mode, "request": "r2", "aborted": "prefill", "kv_transfer_params": params,
                              "prefill_blocks_freed": len(p.free) == args.num_blocks}))
            for connector in (p.worker, d.worker, p.scheduler, d.scheduler):
                connector.shutdown()
    finally:
        for kv in caches:
            kv.unlink()


if __name__ == "__main__":
    main()
