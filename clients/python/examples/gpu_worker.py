"""A GPU worker with torch: a Llama-3.1-8B-shaped paged KV cache in GPU memory
on both sides (one [2, num_blocks, 16, 8, 128] bf16 tensor per layer, as vLLM
allocates them), registered with each sidecar by CUDA IPC handle, moved prefill
-> decode (push, or pull with --pull) and compared on the GPU.

  gpu_worker.py --prefill-socket P.sock --decode-socket D.sock [--pull]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kvrail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-socket", required=True)
    ap.add_argument("--decode-socket", required=True)
    ap.add_argument("--pull", action="store_true")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    shape = (2, args.num_blocks, 16, 8, 128)
    gen = torch.Generator(device="cuda").manual_seed(1)
    src = [torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(args.layers)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
    torch.cuda.synchronize()
    n = -(-args.tokens // 16)
    src_ids = torch.randperm(args.num_blocks, generator=torch.Generator().manual_seed(2))[:n].tolist()
    dst_ids = list(range(args.num_blocks - n, args.num_blocks))
    with kvrail.Client(args.prefill_socket, "gpu-prefill") as p, kvrail.Client(args.decode_socket, "gpu-decode") as d:
        src_regions = p.register_layers(src, expose=args.pull)
        dst_regions = d.register_layers(dst)
        start = time.monotonic()
        moved = 0
        # One transfer per layer region pair (vLLM's layers are separate allocations).
        for (s_rid, s_start, s_count, _), (d_rid, d_start, d_count, _) in zip(src_regions, dst_regions):
            assert (s_start, s_count) == (d_start, d_count)
            name = f"gpu-{s_start}"
            if args.pull:
                t = d.pull(name, "prefill", kvrail.Blocks(s_rid, src_ids, 0, s_count), kvrail.Blocks(d_rid, dst_ids, 0, d_count))
                d.wait(t, timeout=120)
            else:
                t = p.push(name, "decode", kvrail.Blocks(s_rid, src_ids, 0, s_count), kvrail.Blocks(d_rid, dst_ids, 0, d_count))
                p.wait(t, timeout=120)
            moved += t.total_bytes
        secs = time.monotonic() - start
        # Verified on the GPU: the decode blocks equal the prefill blocks, the rest stayed zero.
        si, di = torch.tensor(src_ids, device="cuda"), torch.tensor(dst_ids, device="cuda")
        ok = all(torch.equal(s.index_select(1, si).view(torch.int16), t.index_select(1, di).view(torch.int16))
                 for s, t in zip(src, dst))
        untouched = torch.ones(args.num_blocks, dtype=torch.bool, device="cuda")
        untouched[di] = False
        clean = all(not t[:, untouched].view(torch.int16).any().item() for t in dst)
        for rid, *_ in src_regions:
            p.unregister(rid)
        for rid, *_ in dst_regions:
            d.unregister(rid)
    print(json.dumps({"worker": "gpu", "mode": "pull" if args.pull else "push", "layers": args.layers, "blocks": n,
                      "bytes": moved, "seconds": round(secs, 4), "gbit_per_s": round(moved * 8 / secs / 1e9, 2),
                      "verified_on_gpu": ok, "other_blocks_untouched": clean}))
    if not (ok and clean):
        raise SystemExit("GPU verification failed")


if __name__ == "__main__":
    main()
