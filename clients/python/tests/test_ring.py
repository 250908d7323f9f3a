"""The Python client's submission ring against real sidecars, each test once
per implementation (the compiled ``native`` one and the pure-Python one):
pushes through the ring land and are answered in both workers' completion
queues; refusals carry their codes; a killed sidecar is reported; and its
latency beside the Rust client's is measured by ``benchmarks/ring_latency.py``."""

from __future__ import annotations

import os
import platform
import time
import weakref

import numpy as np
import pytest

from kvrail import Blocks, Client
from kvrail.ring import RingClosed, RingTooLarge, supported
from kvrail import ring as ring_module

from test_client import fill, make_cache, same_blocks

pytestmark = pytest.mark.skipif(not supported(), reason="no ring implementation here (see kvrail.ring)")


def skip_unless_available(impl: str) -> None:
    """Skips a ring implementation this machine cannot run, saying why; under
    CI (which builds the extension on x86-64) a missing one fails."""
    try:
        ring_module._pick_impl(impl)
    except RingClosed as e:
        if os.environ.get("CI") == "true" and platform.machine() == "x86_64":
            pytest.fail(f"CI must test the {impl} ring: {e}")
        pytest.skip(str(e))


@pytest.fixture(params=["native", "python"], autouse=True)
def impl(request, monkeypatch) -> str:
    """Every test of this file once per implementation (rings opened by the
    tests and by ``Client.push`` alike follow KVRAIL_RING_IMPL)."""
    skip_unless_available(request.param)
    monkeypatch.setenv("KVRAIL_RING_IMPL", request.param)
    return request.param


# Completions read while waiting for another, per ring: a fast transfer's
# PUSH_DONE may come before its ACCEPTED (docs/ring-format.md), and must not
# be lost by the wait for ACCEPTED.
_read_ahead: "weakref.WeakKeyDictionary[object, list]" = weakref.WeakKeyDictionary()


def wait_for(ring, request_id: str, kinds: set[str], timeout: float = 20.0):
    seen = _read_ahead.setdefault(ring, [])
    for i, c in enumerate(seen):
        if c.request_id == request_id and c.kind in kinds:
            return seen.pop(i)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = ring.wait(deadline - time.monotonic())
        if c is None:
            continue
        if c.request_id == request_id and c.kind in kinds:
            return c
        seen.append(c)
    raise AssertionError(f"no {kinds} for {request_id}")


def test_a_push_through_the_ring_lands_and_both_rings_hear_of_it(pair, impl):
    src, dst = make_cache(pair, "src"), make_cache(pair, "dst")
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        sid, did = p.register_kv_cache(src), d.register_kv_cache(dst)
        fill(src, [3, 4, 5, 30], seed=7)
        dst.memory.array[:] = 0
        with p.open_ring() as pr, d.open_ring() as dr:
            assert pr.impl == dr.impl == impl
            ud = pr.submit_push("ring-1", "decode", Blocks(sid, [3, 4, 5, 30], 0, 4),
                                Blocks(did, [10, 11, 12, 13], 0, 4))
            a = wait_for(pr, "ring-1", {"ACCEPTED", "REJECTED"})
            assert (a.kind, a.user_data) == ("ACCEPTED", ud)
            assert a.bytes == 4 * 2 * 4 * src.layout.block_bytes
            r = wait_for(dr, "ring-1", {"PUSH_RECEIVED", "FAILED"})
            assert (r.kind, r.peer, r.region_id) == ("PUSH_RECEIVED", "prefill", did)
            assert wait_for(pr, "ring-1", {"PUSH_DONE", "FAILED"}).kind == "PUSH_DONE"
            assert same_blocks(src, [3, 4, 5, 30], dst, [10, 11, 12, 13])
            untouched = [b for b in range(32) if b not in (10, 11, 12, 13)]
            assert all(not layer[:, untouched].view(np.uint16).any() for layer in dst.layers)

            pr.submit_push("nowhere", "nobody", Blocks(sid, [0]), Blocks(did, [0]))
            r = wait_for(pr, "nowhere", {"REJECTED", "ACCEPTED"})
            assert (r.kind, r.code) == ("REJECTED", "not_found")
            with pytest.raises(RingTooLarge):
                pr.submit_push("big", "decode", Blocks(sid, list(range(0, 32, 2)) * 40),
                               Blocks(did, list(range(0, 32, 2)) * 40))
            with pytest.raises(RingTooLarge):
                pr.submit_push("r" * 129, "decode", Blocks(sid, [0]), Blocks(did, [0]))


def test_a_killed_sidecar_is_reported_to_the_ring(pair):
    with Client(pair.prefill.socket, "p0") as p:
        ring = p.open_ring(notifications=False)
        assert ring.closed() is None
        pair.prefill.kill()
        deadline = time.monotonic() + 20
        while ring.closed() is None:
            assert time.monotonic() < deadline, "the ring was not told its sidecar is gone"
            time.sleep(0.01)
        assert "went away" in ring.closed()
        with pytest.raises(RingClosed):
            ring.submit_push("late", "decode", Blocks(1, [0]), Blocks(2, [0]))
        with pytest.raises(RingClosed):
            ring.wait(1.0)
        ring.close()


@pytest.fixture
def metered_pair(tmp_path):
    from conftest import Pair

    p = Pair(tmp_path, metrics=True)
    try:
        yield p
    finally:
        p.stop()


def test_client_push_and_pull_use_the_ring_by_default_with_grpc_errors(metered_pair):
    pair = metered_pair
    src, dst = make_cache(pair, "dsrc"), make_cache(pair, "ddst")
    ring_accepted = "kvrail_ring_submissions_total"
    with Client(pair.prefill.socket, "p0") as p, Client(pair.decode.socket, "d0") as d:
        sid, did = p.register_kv_cache(src, expose=True), d.register_kv_cache(dst, expose=True)
        fill(src, [3, 4, 5, 30], seed=9)
        dst.memory.array[:] = 0
        t = p.push("dflt-1", "decode", Blocks(sid, [3, 4, 5, 30], 0, 4), Blocks(did, [10, 11, 12, 13], 0, 4))
        assert t.total_bytes == src.layout.num_layers * 2 * 4 * src.layout.block_bytes
        assert t.segments == src.layout.num_layers * 2 * 2  # runs 3..6 and 30
        p.wait(t, timeout=20)
        assert same_blocks(src, [3, 4, 5, 30], dst, [10, 11, 12, 13])
        assert pair.prefill.metric(ring_accepted) == 1

        t = p.pull("dflt-2", "decode", Blocks(did, [10], 0, 4), Blocks(sid, [0], 0, 4))
        p.wait(t, timeout=20)
        assert same_blocks(dst, [10], src, [0])
        assert pair.prefill.metric(ring_accepted) == 2

        # The same exceptions as through gRPC.
        from kvrail.errors import InvalidArgument, NotFound

        with pytest.raises(NotFound):
            p.push("dflt-3", "nobody", Blocks(sid, [0]), Blocks(did, [0]))
        with pytest.raises(InvalidArgument):
            p.push("dflt-4", "decode", Blocks(sid, [999]), Blocks(did, [0]))
        # What no slot holds (a 200-byte request id) goes through gRPC.
        before = pair.prefill.metric(ring_accepted)
        p.wait(p.push("x" * 200, "decode", Blocks(sid, [1]), Blocks(did, [1])), timeout=20)
        assert pair.prefill.metric(ring_accepted) == before

    with Client(pair.prefill.socket, "p0", submit_path="grpc") as g:
        before = pair.prefill.metric(ring_accepted)
        g.wait(g.push("grpc-1", "decode", Blocks(sid, [2]), Blocks(did, [2])), timeout=20)
        assert pair.prefill.metric(ring_accepted) == before
    with pytest.raises(ValueError):
        Client(pair.prefill.socket, "p0", submit_path="carrier pigeon")
