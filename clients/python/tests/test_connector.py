"""The vLLM-shaped connector driven through vLLM's call sequence (kvrail.engine_sim)
between two real sidecars: a 32-layer, 2,000-token Llama-3.1-8B request in pull
and in push mode, aborts, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import kvrail
from kvrail.connector import KVConnectorRole, KvrailConnector
from kvrail.engine_sim import MiniEngine, Request, mismatched_layers, read_blocks, tokens_of, vllm_config

from conftest import Pair

# Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16 (as 2-byte words), 16-token blocks.
LAYERS, BLOCK_SHAPE, NUM_BLOCKS, PROMPT = 32, (16, 8, 128), 136, 2000
#: A prompt of which two fit the cache at once (40 blocks).
SHORT = 640


def engines(pair, mode: str, **extra):
    def engine(side, name, role):
        kv = kvrail.HostKvCache(pair.shm(name), LAYERS, NUM_BLOCKS, BLOCK_SHAPE, np.uint16)
        # The region table among the pair's files, which it removes.
        own = {"region_table": str(pair.shm(f"{name}-regions.json")), **extra}
        return MiniEngine(side.socket, mode, name, role, kv, **own)

    return engine(pair.prefill, "p", "kv_producer"), engine(pair.decode, "d", "kv_consumer")


def test_pull_mode_moves_a_llama8b_request(pair):
    p, d = engines(pair, "pull")
    assert p.kv.layout.block_bytes == 32768
    params = p.prefill(Request("req-1", list(range(PROMPT)), {"do_remote_decode": True}), seed=7)
    assert params is not None and params["remote_node"] == "prefill" and len(params["remote_block_ids"]) == 125
    assert "req-1" in p.held  # blocks kept for the decode side to read
    req = Request("req-1", list(range(PROMPT)), params)
    blocks = d.admit_remote(req)
    d.run_until(lambda: "req-1" in d.finished_recving)
    assert d.worker.get_block_ids_with_load_errors() == set()
    assert mismatched_layers(d.kv, blocks, seed=7) == []
    # The prefill side frees its blocks once the sidecar reports them read.
    p.run_until(lambda: "req-1" in p.finished_sending)
    assert len(p.free) == NUM_BLOCKS
    assert d.finish(req) is None
    assert len(d.free) == NUM_BLOCKS


def test_push_mode_moves_a_llama8b_request_layer_by_layer(pair):
    p, d = engines(pair, "push")
    dreq = Request("req-2", list(range(PROMPT)), {"do_remote_prefill": True})
    blocks = d.admit_remote(dreq)
    target = d.scheduler.push_target("req-2")
    assert target is not None and target["push_to"]["remote_block_ids"] == blocks
    p.prefill(Request("req-2p", list(range(PROMPT)), target), seed=11)
    p.run_until(lambda: "req-2p" in p.finished_sending)
    d.run_until(lambda: "req-2" in d.finished_recving)
    assert d.worker.get_block_ids_with_load_errors() == set()
    assert mismatched_layers(d.kv, blocks, seed=11) == []
    assert len(p.free) == NUM_BLOCKS


def test_aborted_prefill_frees_at_once_and_sends_nothing(pair):
    p, _ = engines(pair, "pull")
    params = p.prefill(Request("req-3", list(range(100)), {"do_remote_decode": True}), seed=1, abort=True)
    assert params is None and "req-3" not in p.held and len(p.free) == NUM_BLOCKS


def warm_up(p, d) -> None:
    """One request through, so the decode sidecar's link to the prefill exists."""
    warm = Request("warm", list(range(32)), p.prefill(Request("warm", list(range(32)), {"do_remote_decode": True}), 1))
    d.admit_remote(warm)
    d.run_until(lambda: "warm" in d.finished_recving)
    d.finish(warm)


def test_decode_abort_mid_pull_cancels_before_blocks_are_reused(pair):
    p, d = engines(pair, "pull", timeout_s=2)
    warm_up(p, d)
    params = p.prefill(Request("req-4", list(range(PROMPT)), {"do_remote_decode": True}), seed=3)
    req = Request("req-4", list(range(PROMPT)), params)
    pair.prefill.pause()  # the pull cannot finish
    try:
        d.admit_remote(req)
        d.step()  # the pull starts
        assert d.worker._work.receiving["req-4"], "pull in flight"
        assert d.finish(req, abort=True) is None
        assert "req-4" not in d.free and len(d.free) < NUM_BLOCKS  # held until cancelled
        d.run_until(lambda: "req-4" in d.finished_recving, timeout=30)
        assert d.worker.get_block_ids_with_load_errors() == set()  # cancelled, not failed
    finally:
        pair.prefill.resume()
    # Nobody read the prefill blocks: freed after the connector's timeout.
    p.run_until(lambda: "req-4" in p.finished_sending, timeout=30)


def test_unknown_remote_node_is_a_load_error_not_a_hang(pair):
    _, d = engines(pair, "pull")
    params = {
        "do_remote_prefill": True,
        "remote_node": "nobody",
        "remote_regions": [[1, 0, LAYERS]],
        "remote_block_ids": list(range(10)),
        "remote_request_id": "x",
    }
    req = Request("req-5", list(range(160)), params)
    blocks = d.admit_remote(req)
    d.run_until(lambda: "req-5" in d.finished_recving, timeout=30)
    assert d.worker.get_block_ids_with_load_errors() == set(blocks)


def test_bad_configuration_and_layouts(pair, tmp_path):
    with pytest.raises(kvrail.KvrailError, match="socket"):
        KvrailConnector(_no_socket(), KVConnectorRole.WORKER)
    with pytest.raises(kvrail.SidecarUnavailable):
        KvrailConnector(vllm_config(str(tmp_path / "none.sock"), "pull", "e", "kv_both"), KVConnectorRole.WORKER)
    with pytest.raises(kvrail.KvrailError, match="mode"):
        KvrailConnector(vllm_config(str(pair.prefill.socket), "sideways", "e", "kv_both"), KVConnectorRole.WORKER)
    # Push mode works at any TP size.
    tp2 = vllm_config(str(pair.prefill.socket), "push", "e", "kv_both")
    tp2.parallel_config = SimpleNamespace(tensor_parallel_size=2)
    KvrailConnector(tp2, KVConnectorRole.SCHEDULER).shutdown()
    w = KvrailConnector(vllm_config(str(pair.prefill.socket), "pull", "e", "kv_both"), KVConnectorRole.WORKER)
    kv = kvrail.HostKvCache(pair.shm("bad"), 2, 8, BLOCK_SHAPE, np.uint16)
    with pytest.raises(kvrail.LayoutError):  # layers of different shapes
        w.register_kv_caches({"a": kv.layers[0], "b": kv.layers[1][:, :4]})
    with pytest.raises(kvrail.LayoutError):  # file-backed: cannot be adopted into shared memory
        mapped = np.memmap(tmp_path / "kv", np.uint16, "w+", shape=(2, 8, 16, 8, 128))
        w.register_kv_caches({"a": mapped})
    with pytest.raises(kvrail.LayoutError):  # a block's bytes are not contiguous
        w.register_kv_caches({"a": kv.layers[0][:, :, ::2]})
    w.shutdown()


def _no_socket():
    cfg = vllm_config("", "pull", "e", "kv_both")
    del cfg.kv_transfer_config.kv_connector_extra_config["socket"]
    return cfg


def test_push_mode_prefill_resumed_after_preemption_pushes_its_new_blocks(pair):
    from kvrail.engine_sim import CachedRequestData, KVCacheBlocks, SchedulerOutput

    s = KvrailConnector(vllm_config(str(pair.prefill.socket), "push", "e", "kv_both"), KVConnectorRole.SCHEDULER)
    try:
        target = {
            "remote_node": "decode",
            "remote_regions": [[1, 0, 2]],
            "remote_block_ids": [40, 41, 42],
            "remote_request_id": "d-1",
        }
        req = SimpleNamespace(
            request_id="p-1", prompt_token_ids=list(range(300)), kv_transfer_params={"do_remote_decode": True, "push_to": target}
        )
        s.update_state_after_alloc(req, KVCacheBlocks([1, 2]), 0)
        step = lambda cached, computed, scheduled: s.build_connector_meta(  # noqa: E731
            SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"p-1": scheduled})
        )
        # A chunk's step adds a block; then the request is preempted and comes
        # back with all its blocks anew; its last chunk's step pushes those.
        assert not step(CachedRequestData(["p-1"], set(), [([3],)], [128]), 128, 128).save
        meta = step(CachedRequestData(["p-1"], {"p-1"}, [([7, 8, 9],)], [0]), 0, 300)
        assert meta.save["p-1"].local_block_ids == [7, 8, 9]
        assert meta.save["p-1"].remote_block_ids == [40, 41, 42]
    finally:
        s.shutdown()


def test_a_peer_grant_is_checked_before_use():
    from kvrail.connector import _parse_grant

    good = {
        "remote_node": "decode",
        "remote_request_id": "d-1",
        "remote_regions": [[5, 0, 2]],
        "remote_block_ids": [1, 2],
        "remote_generations": {"5": [1, 1]},
        "skip_blocks": 0,
    }
    enc = lambda g: json.dumps(g).encode()  # noqa: E731
    assert _parse_grant(enc(good), "decode", 2) == good
    assert _parse_grant(enc(good), "someone-else", 2) is None  # not the sender's own blocks
    assert _parse_grant(enc(good), "decode", 3) is None  # layer 2 in no region
    for bad in (
        b"[" * 20000,  # nesting deeper than the parser goes
        b"\xff",
        enc([]),
        enc(dict(good, remote_block_ids=[1 << 40])),
        enc(dict(good, remote_block_ids=[-1])),
        enc(dict(good, remote_block_ids=[True])),
        enc(dict(good, remote_regions=[[5, 0]])),
        enc(dict(good, remote_regions=None)),
        enc(dict(good, remote_generations={"5": ["x"]})),
        enc(dict(good, skip_blocks=-3)),
        enc(dict(good, tokens=-1)),
        enc(dict(good, tokens="300")),
        enc(dict(good, first_token=1 << 40)),
        enc(dict(good, load_group=7)),
        enc(dict(good, load_group="x" * 300)),
    ):
        assert _parse_grant(bad, "decode", 2) is None, bad[:40]
    assert _parse_grant(enc(dict(good, tokens=300, first_token=48, load_group="d-1/load.ab")), "decode", 2)


def test_a_request_aborted_after_its_kv_arrived_frees_its_blocks_at_once(pair):
    # vLLM frees such a request's blocks unless the connector asks it to
    # wait; nothing would report the request again, so a connector that
    # still asked left its blocks allocated and the engine stepping for good.
    p, d = engines(pair, "pull")
    params = p.prefill(Request("req-6", list(range(PROMPT)), {"do_remote_decode": True}), seed=5)
    req = Request("req-6", list(range(PROMPT)), params)
    blocks = d.admit_remote(req)
    d.run_until(lambda: "req-6" in d.finished_recving)
    assert mismatched_layers(d.kv, blocks, seed=5) == []
    assert d.finish(req, abort=True) is None
    assert "req-6" not in d.held and len(d.free) == NUM_BLOCKS


def regions_of(pair, engine: str) -> list:
    return json.loads(pair.shm(f"{engine}-regions.json").read_text())["regions"]


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_restarted_decode_sidecar_fails_the_load_in_flight_and_serves_the_next(pair):
    p, d = engines(pair, "pull", timeout_s=30)
    warm_up(p, d)
    params = p.prefill(Request("req-7", list(range(SHORT)), {"do_remote_decode": True}), seed=8)
    req = Request("req-7", list(range(SHORT)), params)
    pair.prefill.pause()  # the pull stays in flight
    try:
        blocks = d.admit_remote(req)
        d.step()
        assert d.worker._work.receiving["req-7"], "pull in flight"
        pair.decode.kill()
        # The engine goes on stepping: the load fails (vLLM recomputes it), no exception.
        d.run_until(lambda: "req-7" in d.finished_recving, timeout=10)
        assert d.worker.get_block_ids_with_load_errors() == set(blocks)
    finally:
        pair.prefill.resume()
    d.finish(req)
    old_regions = regions_of(pair, "d")
    pair.decode.start()
    # The worker registers its cache with the new sidecar and publishes it,
    # while the engine idles (no step).
    wait_for(lambda: regions_of(pair, "d") != old_regions, timeout=10)
    params = p.prefill(Request("req-8", list(range(SHORT)), {"do_remote_decode": True}), seed=9)
    req = Request("req-8", list(range(SHORT)), params)
    blocks = d.admit_remote(req)
    d.run_until(lambda: "req-8" in d.finished_recving)
    assert d.worker.get_block_ids_with_load_errors() == set()
    assert mismatched_layers(d.kv, blocks, seed=9) == []


def test_a_failed_read_frees_the_prefill_blocks_before_the_timeout(tmp_path):
    pair = Pair(tmp_path)
    try:
        p, d = engines(pair, "pull", timeout_s=60)
        warm_up(p, d)
        params = p.prefill(Request("req-12", list(range(SHORT)), {"do_remote_decode": True}), seed=5)
        req = Request("req-12", list(range(SHORT)), params)
        pair.prefill.pause()  # the pull's request waits in its socket
        try:
            d.admit_remote(req)
            d.step()
            assert d.worker._work.receiving["req-12"], "pull in flight"
            wait_for(lambda: pair.prefill.unread_bytes() > 0, timeout=10)
            # The decode sidecar stops reading before a byte is served: the
            # prefill's serve stalls, its rail goes down and, nobody dialing
            # it again, the serve fails after the sidecar's 5 s deadline.
            pair.decode.pause()
        finally:
            pair.prefill.resume()
        started = time.monotonic()
        try:
            p.run_until(lambda: "req-12" in p.finished_sending, timeout=30)
            # Freed when the serve failed, not at the connector's timeout_s.
            assert time.monotonic() - started < 30
            assert len(p.free) == NUM_BLOCKS
        finally:
            pair.decode.resume()
        # The decode's load ends (to be recomputed) without hanging.
        d.run_until(lambda: "req-12" in d.finished_recving, timeout=60)
        d.finish(req)
    finally:
        pair.stop()


def test_a_read_after_the_prefill_freed_its_blocks_is_refused_not_served_stale(pair):
    """A second decode taking a request over (its first decode engine died
    after reading) names blocks the prefill has since freed and reused: the
    read must fail, never land the next request's KV."""
    p, d = engines(pair, "pull", timeout_s=30)
    params = p.prefill(Request("req-13", list(range(SHORT)), {"do_remote_decode": True}), seed=6)
    first = Request("req-13", list(range(SHORT)), dict(params))
    blocks = d.admit_remote(first)
    d.run_until(lambda: "req-13" in d.finished_recving)
    assert mismatched_layers(d.kv, blocks, seed=6) == []
    d.finish(first)
    p.run_until(lambda: "req-13" in p.finished_sending)
    # vLLM gives the freed blocks to the next request (this one takes every
    # free block, most of those of req-13 among them) and fills them.
    freed = set(params["remote_block_ids"])
    p.prefill(Request("req-14", list(range(PROMPT)), {"do_remote_decode": True}), seed=9)
    assert freed & set(p.held["req-14"])
    again = Request("req-13-again", list(range(SHORT)), params)
    blocks = d.admit_remote(again)
    d.run_until(lambda: "req-13-again" in d.finished_recving)
    assert d.worker.get_block_ids_with_load_errors() == set(blocks), "a read of freed blocks must fail"
    reused = params["remote_block_ids"]
    landed = [l for l in range(LAYERS) if np.array_equal(read_blocks(d.kv, l, blocks), read_blocks(p.kv, l, reused))]
    assert landed == [], "the next request's KV landed"
    d.finish(again)


def test_a_prefill_without_its_sidecar_tells_the_decode_to_recompute(pair):
    p, d = engines(pair, "pull", timeout_s=30)
    pair.prefill.kill()
    params = p.prefill(Request("req-15", list(range(SHORT)), {"do_remote_decode": True}), seed=3)
    # Nothing to vouch for the blocks: freed at once, and the decode's load
    # fails without a pull (recomputed), not after a timeout.
    assert params is not None and "sidecar" in params["remote_failure"]
    assert "req-15" not in p.held and len(p.free) == NUM_BLOCKS
    load_fails_at_once(d, Request("req-15", list(range(SHORT)), params))


def load_fails_at_once(d, req) -> None:
    """``req``'s load ends in the step that starts it, failed on every block."""
    blocks = d.admit_remote(req)
    d.step()
    assert req.request_id in d.finished_recving, req.kv_transfer_params
    assert d.worker.get_block_ids_with_load_errors() == set(blocks), req.kv_transfer_params
    d.finished_recving.clear()
    d.finish(req)


def test_malformed_remote_generations_fail_the_load(pair):
    p, d = engines(pair, "pull", timeout_s=30)
    params = p.prefill(Request("req-16", list(range(SHORT)), {"do_remote_decode": True}), seed=3)
    for bad in (
        {"1": [1]},
        {"1": ["x"] * 40},
        {"x": [1] * 40},
        {"1": [-1] * 40},
        {"1": 5},
        {"1": None},
        {"1": {}},
        [1, 2],
        "gens",
    ):
        load_fails_at_once(d, Request("req-16", list(range(SHORT)), dict(params, remote_generations=bad)))


def test_malformed_remote_block_params_fail_the_load_and_the_engine_goes_on(pair):
    p, d = engines(pair, "pull", timeout_s=30)
    params = p.prefill(Request("req-17", list(range(SHORT)), {"do_remote_decode": True}), seed=3)
    for bad in (
        {k: v for k, v in params.items() if k != "remote_node"},
        dict(params, remote_block_ids=5),
        dict(params, remote_ranks=[{"regions": 5}]),
    ):
        load_fails_at_once(d, Request("req-17", list(range(SHORT)), bad))
    # The same engine still loads a well-formed request.
    req = Request("req-17", list(range(SHORT)), dict(params))
    blocks = d.admit_remote(req)
    d.run_until(lambda: "req-17" in d.finished_recving)
    assert d.worker.get_block_ids_with_load_errors() == set()
    assert mismatched_layers(d.kv, blocks, seed=3) == []


def test_a_restarted_prefill_sidecar_frees_what_it_held_and_serves_the_next(pair):
    p, d = engines(pair, "pull", timeout_s=30)
    params = p.prefill(Request("req-9", list(range(SHORT)), {"do_remote_decode": True}), seed=2)
    assert "req-9" in p.held
    pair.prefill.kill()
    # Nobody can read the kept blocks through a dead sidecar: freed at once.
    p.run_until(lambda: "req-9" in p.finished_sending, timeout=10)
    assert len(p.free) == NUM_BLOCKS
    # The decode side's pull from the dead prefill fails, without hanging.
    req = Request("req-9", list(range(SHORT)), params)
    d.admit_remote(req)
    pair.prefill.start()
    d.run_until(lambda: "req-9" in d.finished_recving, timeout=30)
    assert d.worker.get_block_ids_with_load_errors(), "the old region's pull must fail"
    d.finish(req)
    p.run_until(lambda: p.worker._link.client is not None, timeout=10)
    params = p.prefill(Request("req-10", list(range(SHORT)), {"do_remote_decode": True}), seed=4)
    req = Request("req-10", list(range(SHORT)), params)
    blocks = d.admit_remote(req)
    d.run_until(lambda: "req-10" in d.finished_recving)
    assert d.worker.get_block_ids_with_load_errors() == set()
    assert mismatched_layers(d.kv, blocks, seed=4) == []


def test_push_mode_survives_a_decode_sidecar_restart(pair):
    p, d = engines(pair, "push", timeout_s=30)
    dreq = Request("req-11", list(range(SHORT)), {"do_remote_prefill": True})
    blocks = d.admit_remote(dreq)
    assert d.scheduler.push_target("req-11") is not None
    old_regions = regions_of(pair, "d")
    # Killed and started again at once: gRPC reconnects the old channels to
    # the new sidecar by itself, which must not pass for the old one.
    pair.decode.kill()
    pair.decode.start()
    # The pushes will never come: the load fails at once, not at the timeout.
    d.run_until(lambda: "req-11" in d.finished_recving, timeout=10)
    assert d.worker.get_block_ids_with_load_errors() == set(blocks)
    d.finish(dreq)
    # Re-registered by the worker's reconnecting thread, while the engine idles.
    wait_for(lambda: regions_of(pair, "d") != old_regions, timeout=10)
    dreq = Request("req-12", list(range(SHORT)), {"do_remote_prefill": True})
    blocks = d.admit_remote(dreq)
    target = d.scheduler.push_target("req-12")
    assert target is not None, "the decode scheduler granted nothing after the restart"
    p.prefill(Request("req-12p", list(range(SHORT)), target), seed=12)
    p.run_until(lambda: "req-12p" in p.finished_sending)
    d.run_until(lambda: "req-12" in d.finished_recving)
    assert d.worker.get_block_ids_with_load_errors() == set()
    assert mismatched_layers(d.kv, blocks, seed=12) == []


def test_adopted_memory_files_stay_while_the_engine_lives_and_dead_ones_are_swept(tmp_path, monkeypatch):
    from kvrail.memory import ADOPTED_PREFIX, sweep_adopted_files

    monkeypatch.setenv("KVRAIL_SHM_DIR", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{ADOPTED_PREFIX}{dead.pid}-7f00"
    live = tmp_path / f"{ADOPTED_PREFIX}{os.getppid()}-7f00"
    other = tmp_path / "kvrail-adopted-notapid-1"
    # A dead pid as this namespace sees it, but a live engine (another pid
    # namespace) holds the file's lock.
    locked = tmp_path / f"{ADOPTED_PREFIX}{dead.pid}-7e00"
    for f in (stale, live, other, locked):
        f.write_bytes(b"kv")
    import fcntl

    holder = os.open(locked, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        assert sweep_adopted_files() == [stale]
    finally:
        os.close(holder)
    assert live.exists() and other.exists() and locked.exists() and not stale.exists()


def test_the_reconnecting_thread_survives_a_failed_set_up(pair):
    # Setting up on the new sidecar can fail in ways that are not the
    # sidecar's (a full /dev/shm when the region table is written): the
    # thread tries again instead of dying with reconnection left "under way".
    from kvrail.connector import _SidecarLink

    client = kvrail.Client(pair.decode.socket, "w")
    link = _SidecarLink(pair.decode.socket, "w", client, client.incarnation())
    attempts = []

    def on_connect(c):
        attempts.append(c)
        if len(attempts) == 1:
            raise OSError(28, "No space left on device")

    link.on_connect = on_connect
    link.lost(kvrail.SidecarUnavailable("test"))
    wait_for(lambda: link.get() is not None, timeout=10)
    assert len(attempts) == 2
    # And it can be lost and found again.
    link.lost(kvrail.SidecarUnavailable("test"))
    wait_for(lambda: link.get() is not None, timeout=10)
    assert len(attempts) == 3
    link.close()


# Engines with other block sizes (and orders inside a block): vLLM's logical
# [2, blocks, tokens, heads, head_size] caches, the geometry derived from
# them and a model config, as on GPU backends.
SHAPED_LAYERS, SHAPED_HEADS, SHAPED_HEAD_SIZE, SHAPED_BLOCKS = 4, 8, 64, 64
#: Not a multiple of either block size: the last blocks are partial.
SHAPED_PROMPT = 300


def shaped_engine(pair, side, name: str, role: str, mode: str, block_size: int, interior: str) -> MiniEngine:
    if interior == "nhd":
        shape = (block_size, SHAPED_HEADS, SHAPED_HEAD_SIZE)
    else:  # memory holds heads outside tokens; vLLM sees them through a permuted view
        shape = (SHAPED_HEADS, block_size, SHAPED_HEAD_SIZE)
    kv = kvrail.HostKvCache(pair.shm(name), SHAPED_LAYERS, SHAPED_BLOCKS, shape, np.float16)
    layers = kv.layers if interior == "nhd" else [a.transpose(0, 1, 3, 2, 4) for a in kv.layers]
    return MiniEngine(
        side.socket,
        mode,
        name,
        role,
        kv,
        block_size=block_size,
        model=("test/shaped", SHAPED_HEADS),
        layers=layers,
        region_table=str(pair.shm(f"{name}-regions.json")),
    )


def hand_off_tokens(pair, mode: str, p_shape: tuple[int, str], d_shape: tuple[int, str], computed: int, tag: str):
    """One request from a prefill engine of ``p_shape`` (block size, order) to a
    decode of ``d_shape`` whose prefix cache holds ``computed`` tokens: the
    decode's blocks and the prefill's, compared token by token."""
    p = shaped_engine(pair, pair.prefill, f"p{tag}", "kv_producer", mode, *p_shape)
    d = shaped_engine(pair, pair.decode, f"d{tag}", "kv_consumer", mode, *d_shape)
    prompt = list(range(SHAPED_PROMPT))
    rid = f"req-{tag}"
    if mode == "pull":
        params = p.prefill(Request(rid, prompt, {"do_remote_decode": True}), seed=5)
        assert params is not None
        blocks = d.admit_remote(Request(rid, prompt, params), computed)
        d.run_until(lambda: rid in d.finished_recving)
        p.run_until(lambda: rid in p.finished_sending)
        source = p.blocks_of_last
    else:
        blocks = d.admit_remote(Request(rid, prompt, {"do_remote_prefill": True}), computed)
        target = d.scheduler.push_target(rid)
        assert target is not None
        p.prefill(Request(f"{rid}p", prompt, target), seed=5)
        p.run_until(lambda: f"{rid}p" in p.finished_sending)
        d.run_until(lambda: rid in d.finished_recving)
        source = p.blocks_of_last
    assert d.worker.get_block_ids_with_load_errors() == set()
    loaded = range(computed, SHAPED_PROMPT)
    for layer in range(SHAPED_LAYERS):
        want = tokens_of(p.layers[layer], source, p.block_size, loaded)
        got = tokens_of(d.layers[layer], blocks, d.block_size, range(0, len(loaded)))
        # As bits: the random pattern holds NaNs.
        assert np.array_equal(want.view(np.uint16), got.view(np.uint16)), f"layer {layer}: {mode} {p_shape} -> {d_shape} from token {computed}"
    # Both engines' blocks are free again.
    assert len(p.free) == SHAPED_BLOCKS


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    "p_shape,d_shape",
    [((16, "nhd"), (64, "nhd")), ((64, "hnd"), (16, "hnd")), ((32, "nhd"), (128, "hnd")), ((16, "hnd"), (16, "nhd"))],
)
def test_engines_with_other_block_sizes_hand_over_every_token(pair, mode, p_shape, d_shape):
    hand_off_tokens(pair, mode, p_shape, d_shape, 0, "a")


def test_a_malformed_push_target_pushes_nothing_and_the_prefill_goes_on(pair):
    """A target whose token fields are not counts: the prefill's scheduler
    logs it, pushes nothing, frees the request's blocks at once, and serves
    the next request."""
    p = shaped_engine(pair, pair.prefill, "pm", "kv_producer", "push", 64, "nhd")
    d = shaped_engine(pair, pair.decode, "dm", "kv_consumer", "push", 16, "hnd")
    prompt = list(range(SHAPED_PROMPT))
    d.admit_remote(Request("req-m", prompt, {"do_remote_prefill": True}))
    target = d.scheduler.push_target("req-m")
    assert target is not None
    target["push_to"]["tokens"] = "many"
    assert p.prefill(Request("req-mp", prompt, target), seed=3) is None
    assert len(p.free) == SHAPED_BLOCKS, "freed at once: nothing was pushed"
    assert "req-mp" not in p.worker._work.sending


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_decode_prefix_cache_ending_inside_a_prefill_block_loads_the_rest(pair, mode):
    """The decode holds the first 48 tokens (three of its 16-token blocks):
    the load starts 48 tokens into the prefill's first 64-token block."""
    hand_off_tokens(pair, mode, (64, "nhd"), (16, "hnd"), 48, "b")


def test_head_opaque_engines_with_other_block_sizes_are_refused_naming_both():
    from kvrail.connector import _geometry_mismatch
    from kvrail.geometry import KvGeometry

    g = KvGeometry("m", "bfloat16", 2, 64, 8, 0, 8, 16, "head_opaque")
    assert "tokens per block is 16 here and 32" in _geometry_mismatch(g, replace(g, tokens_per_block=32))
    assert "interior is head_opaque here and nhd" in _geometry_mismatch(g, replace(g, interior="nhd"))
    nhd = replace(g, interior="nhd")
    assert _geometry_mismatch(nhd, replace(nhd, tokens_per_block=64, interior="hnd")) == ""


def test_geometry_from_vllm_caches_tells_the_block_interior():
    """vLLM's 5-D caches: NHD, or HND by stride order, from their logical
    [2, blocks, tokens, heads, head_size] view; a torch cache on the CPU is
    the CPU backend's (head-opaque) whatever its rank."""
    from kvrail.connector import _kv_geometry

    cfg = SimpleNamespace(model_config=SimpleNamespace(model="m", get_total_num_kv_heads=lambda: 8))
    nhd = np.zeros((2, 4, 16, 8, 64), np.float16)
    hnd = np.zeros((2, 4, 8, 16, 64), np.float16).transpose(0, 1, 3, 2, 4)
    g = _kv_geometry(cfg, nhd, 0, 1, None)
    assert g is not None and (g.interior, g.tokens_per_block, g.heads, g.head_size) == ("nhd", 16, 8, 64)
    g = _kv_geometry(cfg, hnd, 0, 1, None)
    assert g is not None and (g.interior, g.tokens_per_block) == ("hnd", 16)
    g = _kv_geometry(cfg, np.zeros((2, 4, 16, 4, 64), np.float16), 1, 2, None)
    assert g is not None and (g.head_start, g.heads) == (4, 4)
    torch = pytest.importorskip("torch", reason="torch is not installed")
    g = _kv_geometry(cfg, torch.zeros((2, 4, 16, 8, 64), dtype=torch.bfloat16), 0, 1, None)
    assert g is not None and g.interior == "head_opaque" and g.dtype == "bfloat16"


def test_a_complete_receiver_group_short_of_the_granted_tokens_fails_the_load_at_once(pair):
    """Once a decode request's receiver group says all its pushes arrived,
    nothing more can come: fewer bytes than the granted tokens hold fail the
    load at that step, not after the timeout."""
    d = shaped_engine(pair, pair.decode, "ds", "kv_consumer", "push", 16, "hnd")
    blocks = d.admit_remote(Request("req-s", list(range(SHAPED_PROMPT)), {"do_remote_prefill": True}))
    d.step()  # the worker starts waiting for the pushes
    w = d.worker._work
    least = w.push_minimum["req-s"]
    assert least == SHAPED_LAYERS * 2 * SHAPED_PROMPT * SHAPED_HEADS * SHAPED_HEAD_SIZE * 2
    w.push_grouped["req-s"] = least - 1
    started = time.monotonic()
    d.step()
    assert "req-s" in d.finished_recving and time.monotonic() - started < 5
    assert d.worker.get_block_ids_with_load_errors() == set(blocks)
