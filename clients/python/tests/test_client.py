"""The Python client against two real sidecars on loopback."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvrail
from kvrail import Blocks, Client, HostKvCache

BLOCK_SHAPE = (16, 2, 64)  # tokens per block, KV heads, head size: 4 KiB of fp16


def make_cache(pair, name: str, layers: int = 4, blocks: int = 32) -> HostKvCache:
    return HostKvCache(pair.shm(name), layers, blocks, BLOCK_SHAPE, np.float16)


def fill(kv: HostKvCache, block_ids: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for layer in kv.layers:
        for b in block_ids:
            layer[:, b] = rng.integers(0, 1 << 16, size=layer[:, b].shape, dtype=np.uint16).view(np.float16)


def same_blocks(a: HostKvCache, a_ids: list[int], b: HostKvCache, b_ids: list[int]) -> bool:
    return all(
        np.array_equal(la[:, i].view(np.uint16), lb[:, j].view(np.uint16))
        for la, lb in zip(a.layers, b.layers)
        for i, j in zip(a_ids, b_ids)
    )


def test_push_moves_every_byte_and_notifies_both_sides(pair):
    src, dst = make_cache(pair, "src"), make_cache(pair, "dst")
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        sid, did = p.register_kv_cache(src), d.register_kv_cache(dst)
        src_ids, dst_ids = [3, 7, 1, 30], [0, 9, 10, 31]
        fill(src, src_ids, seed=1)
        dst.memory.array[:] = 0
        with d.notifications() as dn, p.notifications() as pn:
            t = p.push("req-1", "decode", Blocks(sid, src_ids, 0, 4), Blocks(did, dst_ids, 0, 4))
            assert t.total_bytes == 4 * 2 * 4 * src.layout.block_bytes
            n = dn.get(timeout=20).raise_if_failed()
            assert (n.kind, n.request_id, n.peer) == (kvrail.PUSH_RECEIVED, "req-1", "prefill")
            assert n.region_id == did and list(n.block_ids) == dst_ids
            assert pn.get(timeout=20).kind == kvrail.PUSH_DONE
        s = p.wait(t, timeout=20)
        assert s.state == "DONE" and s.bytes_done == t.total_bytes
        assert same_blocks(src, src_ids, dst, dst_ids)
        # Nothing outside the destination blocks was written.
        untouched = [b for b in range(32) if b not in dst_ids]
        assert all(not layer[:, untouched].view(np.uint16).any() for layer in dst.layers)


def test_pull_reads_an_exposed_region(pair):
    src, dst = make_cache(pair, "src"), make_cache(pair, "dst")
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        sid = p.register_kv_cache(src, expose=True)
        did = d.register_kv_cache(dst)
        fill(src, [5, 6], seed=2)
        with p.notifications() as pn:
            t = d.pull("req-pull", "prefill", Blocks(sid, [5, 6], 1, 3), Blocks(did, [20, 2], 1, 3))
            d.wait(t, timeout=20)
            served = pn.get(timeout=20)
            assert served.kind == kvrail.PULL_SERVED and served.request_id == "req-pull"
        assert all(
            np.array_equal(src.layers[layer][:, s].view(np.uint16), dst.layers[layer][:, t_].view(np.uint16))
            for layer in (1, 2, 3)
            for s, t_ in ((5, 20), (6, 2))
        )
        assert not dst.layers[0].view(np.uint16).any()


def test_unknown_peer_and_out_of_range_blocks_are_clear_errors(pair):
    src = make_cache(pair, "src")
    with Client(pair.prefill.socket, "p0") as p:
        sid = p.register_kv_cache(src)
        with pytest.raises(kvrail.NotFound) as e:
            p.push("r", "nobody", Blocks(sid, [0]), Blocks(1, [0]))
        assert "nobody" in e.value.reason
        with pytest.raises(kvrail.InvalidArgument):
            p.push("r", "decode", Blocks(sid, [32]), Blocks(1, [0]))
        with pytest.raises(kvrail.InvalidArgument):
            p.push("r", "decode", Blocks(sid, [0], 3, 2), Blocks(1, [0], 3, 2))
        with pytest.raises(kvrail.NotFound):
            p.push("r", "decode", Blocks(sid + 100, [0]), Blocks(1, [0]))
        # A layout reaching past the file is refused by the sidecar.
        bigger = kvrail.Layout.dense(8, 2, 32, src.layout.block_bytes)
        with pytest.raises(kvrail.InvalidArgument):
            p.register_shm(src.path, bigger)
        # The push to a region the peer does not have fails on the peer's side.
        with p.notifications() as pn:
            t = p.push("r2", "decode", Blocks(sid, [0]), Blocks(999, [0]))
            n = pn.get(timeout=20)
            assert n.kind == kvrail.FAILED and n.request_id == "r2"
            with pytest.raises(kvrail.TransferFailed) as f:
                n.raise_if_failed()
            assert f.value.side == "PEER"
        with pytest.raises(kvrail.TransferFailed):
            p.wait(t, timeout=20)


def test_sidecar_not_running(tmp_path):
    with pytest.raises(kvrail.SidecarUnavailable):
        Client(tmp_path / "nothing.sock", "w")
    # A socket file nobody serves.
    import socket as s

    path = tmp_path / "dead.sock"
    sock = s.socket(s.AF_UNIX)
    sock.bind(str(path))
    sock.close()
    with pytest.raises(kvrail.SidecarUnavailable):
        Client(path, "w", connect_timeout=1.0)


def test_sidecar_restart_mid_request_raises_and_recovers(pair):
    src, dst = make_cache(pair, "src"), make_cache(pair, "dst")
    with Client(pair.prefill.socket, "p0") as p:
        sid = p.register_kv_cache(src)
        d = Client(pair.decode.socket, "d0")
        did = d.register_kv_cache(dst)
        dn = d.notifications()
        p.wait(p.push("warm", "decode", Blocks(sid, [0]), Blocks(did, [0])), timeout=20)
        assert dn.get(timeout=20).kind == kvrail.PUSH_RECEIVED
        # Frozen, the decode sidecar accepts nothing; the push is in flight when it dies.
        pair.decode.pause()
        t = p.push("r-mid", "decode", Blocks(sid, list(range(32)), 0, 4), Blocks(did, list(range(32)), 0, 4))
        pair.decode.kill()
        with pytest.raises(kvrail.TransferFailed) as failed:
            p.wait(t, timeout=60)
        assert failed.value.side in ("PEER", "RAIL", "TIMEOUT"), failed.value
        # The decode worker's stream and calls fail instead of hanging.
        with pytest.raises(kvrail.SidecarUnavailable):
            dn.get(timeout=20)
        with pytest.raises(kvrail.SidecarUnavailable):
            d.peers()
        d.close()
        # The prefill sidecar is up; it says the peer is unreachable.
        with pytest.raises(kvrail.PeerUnavailable) as e:
            p.push("r-dead", "decode", Blocks(sid, [0]), Blocks(did, [0]))
        assert "decode" in str(e.value) or "connect" in str(e.value), e.value
        # After a restart the region must be registered again, and pushes work.
        pair.decode.start()
        with Client(pair.decode.socket, "d0") as d2:
            did2 = d2.register_kv_cache(dst)
            fill(src, [1], seed=3)
            # The prefill sidecar finds the peer back at its next probe of the rail.
            deadline = time.monotonic() + 30
            while True:
                try:
                    t = p.push("r-again", "decode", Blocks(sid, [1], 0, 4), Blocks(did2, [1], 0, 4))
                    break
                except kvrail.PeerUnavailable:
                    assert time.monotonic() < deadline, "peer not back within 30 s"
                    time.sleep(0.1)
            p.wait(t, timeout=60)
            assert same_blocks(src, [1], dst, [1])


def test_a_plain_grpc_channel_needs_no_authority_option(pair):
    """grpcio sends the socket path as :authority on a unix: target (since
    grpc-core 1.57); the sidecar must accept it (it used to reset the stream
    unless the client set grpc.default_authority)."""
    import grpc

    from kvrail.v1 import sidecar_pb2, sidecar_pb2_grpc

    with grpc.insecure_channel(f"unix:{pair.decode.socket}") as channel:
        stub = sidecar_pb2_grpc.SidecarStub(channel)
        peers = stub.ListPeers(sidecar_pb2.ListPeersRequest(), timeout=10)
    assert [p.name for p in peers.peers] == ["prefill"]


def test_notifications_resume_without_loss_and_are_not_taken_over_silently(pair):
    """A worker that drops its stream resumes after the last sequence it saw
    and gets exactly the rest; a second live stream is refused unless it takes
    over."""
    src, dst = make_cache(pair, "src"), make_cache(pair, "dst")
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        sid, did = p.register_kv_cache(src), d.register_kv_cache(dst)
        first = d.notifications()
        for i in range(6):
            p.wait(p.push(f"r{i}", "decode", Blocks(sid, [i]), Blocks(did, [i])), timeout=20)
        seen = [first.get(timeout=10) for _ in range(2)]
        with pytest.raises(kvrail.AlreadyExists):
            d.notifications().get(timeout=10)
        first.close()
        # The sidecar may not have seen the close yet: a worker resuming its
        # own stream takes over, as the soak's worker does.
        rest = d.notifications(
            after_sequence=seen[-1].sequence, incarnation=seen[-1].incarnation, take_over=True
        )
        got = seen + [rest.get(timeout=10) for _ in range(4)]
        assert [n.sequence for n in got] == list(range(got[0].sequence, got[0].sequence + 6))
        assert sorted(n.request_id for n in got) == [f"r{i}" for i in range(6)]
        rest.close()


def test_a_pull_naming_released_blocks_fails_and_moves_nothing(pair):
    src, dst = make_cache(pair, "src"), make_cache(pair, "dst")
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        sid = p.register_kv_cache(src, expose=True)
        did = d.register_kv_cache(dst)
        fill(src, [5, 6], seed=3)
        dst.memory.array[:] = 0
        gens = p.block_generations(sid, [5, 6])
        assert gens == [1, 1]
        # The prefill frees block 6 before the decode reads it.
        assert p.release_blocks(sid, [6]) == ([2], 0)
        t = d.pull("stale", "prefill", Blocks(sid, [5, 6], 0, 4, gens), Blocks(did, [0, 1], 0, 4))
        with pytest.raises(kvrail.TransferFailed) as f:
            d.wait(t, timeout=20)
        assert f.value.code == "blocks_released" and f.value.side == "PEER"
        assert "block 6" in f.value.message
        assert not dst.memory.array.view(np.uint8).any()
        # With the current generations the pull moves the blocks.
        fresh = p.block_generations(sid, [5, 6])
        t = d.pull("fresh", "prefill", Blocks(sid, [5, 6], 0, 4, fresh), Blocks(did, [0, 1], 0, 4))
        assert d.wait(t, timeout=20).state == "DONE"
        assert same_blocks(src, [5, 6], dst, [0, 1])
        with pytest.raises(kvrail.InvalidArgument):
            p.release_blocks(sid, [32])


def test_memory_the_worker_allocated_itself_is_adopted_in_place(pair, tmp_path):
    # vLLM's CPU backend allocates its KV cache with torch.zeros: plain private
    # memory. Adoption moves its pages under a shared file at the same address.
    src = make_cache(pair, "src")
    layers, blocks = 3, 16
    # Larger than glibc's largest mmap threshold (32 MiB): mmap'd on its own.
    whole = np.zeros(40 << 20, np.uint8)
    own = whole[: layers * 2 * blocks * int(np.prod(BLOCK_SHAPE)) * 2].view(np.uint16)
    own[::7] = 0xBEEF  # contents from before the adoption survive it
    before = own.copy()
    address = own.__array_interface__["data"][0]
    adopted = kvrail.adopt_tensor(own)
    assert own.__array_interface__["data"][0] == address
    assert np.array_equal(own, before)
    assert adopted.path.exists() and adopted.address <= address
    dst_layers = [own[i * own.size // layers : (i + 1) * own.size // layers].view(np.float16).reshape(2, blocks, *BLOCK_SHAPE) for i in range(layers)]
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        sid = p.register_kv_cache(src, expose=True)
        ((did, first, count, _),) = d.register_layers(dst_layers)
        assert (first, count) == (0, layers)
        adopted.unlink()  # both sides keep their mappings
        fill(src, [4, 9], seed=5)
        d.wait(d.pull("adopted", "prefill", Blocks(sid, [4, 9], 0, 3), Blocks(did, [1, 15], 0, 3)), timeout=20)
    # The bytes landed in the worker's own array, in the named blocks only.
    for layer in range(layers):
        for s, t in ((4, 1), (9, 15)):
            assert np.array_equal(src.layers[layer][:, s].view(np.uint16), dst_layers[layer][:, t].view(np.uint16))
        untouched = [b for b in range(blocks) if b not in (1, 15)]
        want = before[layer * own.size // layers : (layer + 1) * own.size // layers].reshape(2, blocks, -1)
        assert np.array_equal(dst_layers[layer][:, untouched].view(np.uint16).reshape(2, len(untouched), -1), want[:, untouched])
    # The owner can still free it: its munmap takes the file's pages along.
    del dst_layers, own, whole


def test_memory_that_is_not_private_is_not_adopted(tmp_path):
    path = tmp_path / "file-backed"
    with open(path, "wb") as f:
        f.truncate(40 << 20)
    mapped = np.memmap(path, dtype=np.uint8, mode="r+")
    with pytest.raises(kvrail.LayoutError, match="not wholly private anonymous"):
        kvrail.adopt_tensor(mapped)
    # A small allocation may share its pages with other objects: refused.
    with pytest.raises(kvrail.LayoutError, match="too small to adopt"):
        kvrail.adopt_tensor(np.zeros(1 << 20, np.uint8))
    with pytest.raises(kvrail.LayoutError):
        kvrail.adopt_host_memory(mapped.__array_interface__["data"][0], 0)


def test_a_worker_message_reaches_a_subscribed_worker_on_the_peer(pair):
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        with d.notifications() as dn:
            p.send_message("decode", "nobody-here", "lost", b"x")  # no such worker: dropped there
            p.send_message("decode", "d0", "grant/1", b"\x00\x01payload")
            n = dn.get(timeout=20)
            assert (n.kind, n.request_id, n.payload, n.from_worker, n.peer) == (
                kvrail.MESSAGE,
                "grant/1",
                b"\x00\x01payload",
                "p0",
                "prefill",
            )
            with pytest.raises(kvrail.InvalidArgument, match="payload"):
                p.send_message("decode", "d0", "big", b"x" * (16 * 1024 + 1))
            with pytest.raises(kvrail.InvalidArgument, match="topic"):
                p.send_message("decode", "d0", "t" * 257)
            with pytest.raises(kvrail.NotFound):
                p.send_message("nowhere", "d0", "t")
            p.send_message("decode", "d0", "grant/2")
            assert dn.get(timeout=20).request_id == "grant/2"


def test_memory_freed_after_adoption_is_not_mistaken_for_shared_memory():
    # The owner munmaps adopted memory (as glibc frees a large allocation) and
    # the address is mapped again, anonymous: not kvrail's memory any more.
    import ctypes

    from kvrail.memory import _libc

    libc = _libc()
    size, prot, private_anon = 1 << 20, 0x1 | 0x2, 0x02 | 0x20
    address = libc.mmap(None, size, prot, private_anon, -1, 0)
    ctypes.memset(address, 7, size)
    kvrail.adopt_host_memory(address, size).unlink()
    assert kvrail.memory.find_shared_memory(address + 10)[1] == 10
    assert ctypes.string_at(address, 4) == b"\x07" * 4
    assert libc.munmap(address, size) == 0
    again = libc.mmap(address, size, prot, private_anon | 0x10, -1, 0)  # MAP_FIXED
    assert again == address
    try:
        with pytest.raises(kvrail.LayoutError, match="not in shared memory"):
            kvrail.memory.find_shared_memory(address + 10)
    finally:
        libc.munmap(address, size)


def test_adopting_kvrail_shared_memory_keeps_its_file(pair):
    kv = make_cache(pair, "own-file")
    a = kvrail.adopt_tensor(kv.layers[1])
    assert a.path == kv.path and not a.owned
    a.unlink()
    assert kv.path.exists()


def test_a_range_running_past_kvrail_shared_memory_is_refused(pair):
    kv = make_cache(pair, "edge")
    with pytest.raises(kvrail.LayoutError, match="runs past kvrail shared memory"):
        kvrail.adopt_host_memory(kv.memory.address, kv.memory.nbytes + 1)


def test_a_socket_served_by_another_user_is_refused():
    """Another user bound the sidecar's path first (anyone may in /tmp): the
    client refuses it rather than hand it shared-memory paths and trust its
    answers. Needs root, to run the impostor as another user."""
    import os
    import subprocess

    from kvrail.errors import SidecarUnavailable

    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: this test must run")
        pytest.skip("needs root")
    import shutil
    import tempfile
    from pathlib import Path

    # Not pytest's tmp_path: its parents are closed to other users.
    shared = Path(tempfile.mkdtemp(prefix="kvrail-impostor-"))
    shared.chmod(0o1777)
    path = shared / "kvrail.sock"

    def become_nobody() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    impostor = subprocess.Popen(
        ["/usr/bin/python3", "-c",
         "import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
         "print('up', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=become_nobody)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == "up"
        with pytest.raises(SidecarUnavailable, match="served by uid 65534"):
            Client(path, "w")
    finally:
        assert impostor.stdin is not None
        impostor.stdin.close()
        impostor.wait(timeout=10)
        shutil.rmtree(shared, ignore_errors=True)


def test_head_slices_move_between_ranks_sharded_differently(pair):
    """Prefill at TP 2 (one KV head per rank), decode at TP 1 (both heads),
    vLLM CPU-style blocks ([heads, tokens, K and V]): the decode rank pulls
    each head from the rank that holds it, and its blocks equal the two
    ranks' blocks joined head by head. A mismatched dtype is refused before
    anything moves, naming both values."""
    tpb, head_size, kv_heads = 16, 64, 2

    def geometry(tp: int, rank: int, dtype: str = "float16") -> kvrail.KvGeometry:
        heads = kvrail.rank_heads(kv_heads, tp, rank)
        return kvrail.KvGeometry(
            "test/model", dtype, 2, head_size, kv_heads, heads.start, len(heads), tpb, "head_opaque"
        )

    ranks = [HostKvCache(pair.shm(f"p{r}"), 2, 8, (1, tpb, head_size), np.float16, "mla") for r in range(2)]
    dst = HostKvCache(pair.shm("d"), 2, 8, (2, tpb, head_size), np.float16, "mla")
    src_ids, dst_ids = [6, 1, 3], [2, 7, 0]
    with Client(pair.prefill.socket, "p") as p, Client(pair.decode.socket, "d") as d:
        regions = [
            p.register_shm(kv.path, kv.layout, expose=True, geometry=geometry(2, r)) for r, kv in enumerate(ranks)
        ]
        rng = np.random.default_rng(10)
        for kv in ranks:
            for layer in kv.layers:
                for b in src_ids:
                    layer[b] = rng.integers(0, 1 << 16, size=layer[b].shape, dtype=np.uint16).view(np.float16)
        did = d.register_shm(dst.path, dst.layout, geometry=geometry(1, 0))
        sources = kvrail.head_sources(range(0, 2), [geometry(2, r).head_range for r in range(2)])
        assert sources == [(0, range(0, 1)), (1, range(1, 2))]
        # One logical transfer: the two pulls as a group, one notification.
        with d.notifications() as notes:
            total = 0
            for src, heads in sources:
                cut = kvrail.HeadSlice(heads.start, len(heads), len(src_ids) * tpb, tpb)
                t = d.pull(
                    f"tp-{src}",
                    "prefill",
                    Blocks(regions[src], src_ids, 0, 2, slice=cut),
                    Blocks(did, dst_ids, 0, 2),
                    group=("tp-req", len(sources)),
                )
                total += t.total_bytes
            n = notes.get(timeout=20)
            assert (n.kind, n.request_id, n.bytes) == ("PULL_DONE", "tp-req", total), n
        for layer in range(2):
            for s, t_ in zip(src_ids, dst_ids):
                joined = np.concatenate([ranks[0].layers[layer][s], ranks[1].layers[layer][s]])
                assert np.array_equal(dst.layers[layer][t_].view(np.uint16), joined.view(np.uint16))
        # Another dtype on the decode side: refused by the prefill's sidecar.
        other = HostKvCache(pair.shm("o"), 2, 8, (2, tpb, head_size), np.float16, "mla")
        oid = d.register_shm(other.path, other.layout, geometry=geometry(1, 0, dtype="bfloat16"))
        cut = kvrail.HeadSlice(0, 1, len(src_ids) * tpb, tpb)
        t = d.pull("tp-bad", "prefill", Blocks(regions[0], src_ids, 0, 2, slice=cut), Blocks(oid, dst_ids, 0, 2))
        with pytest.raises(kvrail.TransferFailed) as e:
            d.wait(t, timeout=20)
        assert "float16 here and bfloat16 on the peer" in str(e.value), e.value
        assert not other.memory.array.any()
