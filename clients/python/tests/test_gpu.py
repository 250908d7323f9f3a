"""GPU regions from Python: device memory exported by CUDA IPC (kvrail.cuda,
no torch needed), registered with the sidecar and moved to and from host
shared memory, verified byte for byte. Skips without a GPU; the refusal of a
bad handle is tested everywhere."""

from __future__ import annotations

import numpy as np
import pytest

import kvrail
from kvrail import Blocks, Client
from kvrail.cuda import CudaBuffer, device_count

LAYOUT = kvrail.Layout.dense(4, 2, 32, 16384)


def test_bad_cuda_handle_is_refused_clearly(pair):
    with Client(pair.prefill.socket, "g") as c:
        with pytest.raises(kvrail.KvrailError) as e:
            c.register_cuda(kvrail.CudaIpc(b"\0" * 64, 0, 0), LAYOUT)
        assert "cuda" in str(e.value).lower() or "gpu" in str(e.value).lower(), e.value


@pytest.mark.skipif(device_count() == 0, reason="no CUDA device")
def test_gpu_region_push_and_pull_verified(pair):
    gpu = CudaBuffer(LAYOUT.extent())
    host = kvrail.SharedMemory(pair.shm("host"), LAYOUT.extent())
    try:
        data = np.random.default_rng(5).integers(0, 256, LAYOUT.extent(), dtype=np.uint8)
        gpu.upload(data)
        with Client(pair.prefill.socket, "g") as p, Client(pair.decode.socket, "h") as d:
            src = p.register_cuda(gpu.ipc(), LAYOUT, expose=True)
            dst = d.register_shm(host.path, LAYOUT)
            blocks = [1, 5, 9, 31]
            p.wait(p.push("gpu-push", "decode", Blocks(src, blocks, 0, 4), Blocks(dst, blocks, 0, 4)), timeout=60)
            for layer in range(4):
                for plane in range(2):
                    for b in blocks:
                        off = LAYOUT.block_offset(layer, plane, b)
                        assert np.array_equal(host.array[off : off + 16384], data[off : off + 16384])
            untouched = LAYOUT.block_offset(0, 0, 0)
            assert not host.array[untouched : untouched + 16384].any()
            # Pull GPU blocks into other host blocks, then host blocks into the GPU.
            d.wait(d.pull("gpu-pull", "prefill", Blocks(src, [2], 0, 4), Blocks(dst, [3], 0, 4)), timeout=60)
            assert np.array_equal(
                host.array[LAYOUT.block_offset(2, 1, 3) :][:16384], data[LAYOUT.block_offset(2, 1, 2) :][:16384]
            )
            host.array[LAYOUT.block_offset(0, 0, 7) :][:16384] = 0xAB
            d.wait(d.push("to-gpu", "prefill", Blocks(dst, [7], 0, 1), Blocks(src, [8], 0, 1)), timeout=60)
            off = LAYOUT.block_offset(0, 0, 8)
            assert (gpu.download(16384, off) == 0xAB).all()
            p.unregister(src)
    finally:
        gpu.free()
        host.unlink()


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@pytest.mark.skipif(_torch_cuda() is None, reason="no torch with CUDA")
def test_torch_kv_caches_registered_by_cuda_ipc_push_verified(pair):
    torch = _torch_cuda()
    from kvrail.connector import KVConnectorRole, KvrailConnector
    from kvrail.engine_sim import vllm_config

    # As vLLM allocates them: one [2, num_blocks, 16, 8, 128] bf16 tensor per layer.
    layers = 4
    caches = {f"layer.{i}": torch.randn(2, 32, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for i in range(layers)}
    host = kvrail.HostKvCache(pair.shm("host"), layers, 32, (16, 8, 128), np.uint16)
    try:
        w = KvrailConnector(vllm_config(str(pair.prefill.socket), "pull", "torch", "kv_producer"), KVConnectorRole.WORKER)
        w.register_kv_caches(caches)
        regions = w._work.regions
        assert [r[1:] for r in regions] == [(i, 1) for i in range(layers)] or regions[0][1:] == (0, layers)
        with Client(pair.decode.socket, "h") as d, Client(pair.prefill.socket, "vllm-torch") as p:
            dst = d.register_kv_cache(host)
            for rid, start, count in regions:
                t = p.push(f"torch-{rid}", "decode", Blocks(rid, [0, 7, 31], 0, count), Blocks(dst, [0, 7, 31], start, count))
                p.wait(t, timeout=60)
        for i, (name, t) in enumerate(caches.items()):
            want = t.view(torch.int16).cpu().numpy().view(np.uint16)
            for b in (0, 7, 31):
                assert np.array_equal(host.layers[i][:, b], want[:, b]), (name, b)
        w.shutdown()
    finally:
        host.unlink()
