"""The compiled ring functions (kvrail._ring_native) on a ring mapping of our
own, no sidecar: the slots they publish are byte for byte the pure-Python
ones, and what does not fit, a full queue, a closed ring, bad ids, hostile
completion lengths and an overrun are answered without publishing a thing or
reading outside the mapping."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import threading

import numpy as np
import pytest

from kvrail import Blocks
from kvrail import ring as R

SQ, CQ, SLOT = 8, 4, 4096


def detached(impl: str) -> R.Ring:
    """A Ring over an anonymous mapping with a valid header, as a sidecar
    would see it, without opening it with one."""
    r = R.Ring.__new__(R.Ring)
    r.impl = impl
    r.sq_entries, r.cq_entries, r.slot_bytes = SQ, CQ, SLOT
    r._cq_offset = R.HEADER_BYTES + SQ * SLOT
    r._mm = mmap.mmap(-1, r._cq_offset + CQ * R.CQ_SLOT_BYTES)
    r._base = ctypes.addressof(ctypes.c_char.from_buffer(r._mm))
    r._u64 = {o: ctypes.c_uint64.from_buffer(r._mm, o) for o in (R.SQ_TAIL, R.SQ_HEAD, R.CQ_TAIL, R.CQ_HEAD)}
    r._u32 = {o: ctypes.c_uint32.from_buffer(r._mm, o)
              for o in (R.STATE, R.CLOSE_REASON, R.SIDECAR_BELL, R.SIDECAR_SLEEPING, R.WORKER_BELL,
                        R.WORKER_SLEEPING)}
    r._futex = R._Futex()
    r._tail = r._head = 0
    r._next_user_data = 1
    r._submit_lock, r._read_lock, r._wait_lock = threading.Lock(), threading.Lock(), threading.Lock()
    r._released = False
    r.spin_s = 0.0
    r._u32[R.STATE].value = R.STATE_OPEN
    return r


@pytest.fixture(autouse=True)
def need_native():
    if not R.native_available():
        if os.environ.get("CI") == "true" and platform.machine() == "x86_64":
            pytest.fail(f"CI must test the compiled ring: {R._NATIVE_MISSING}")
        pytest.skip(f"the compiled ring extension is not built: {R._NATIVE_MISSING}")


def slot(r: R.Ring, index: int) -> bytes:
    off = R.HEADER_BYTES + (index % SQ) * SLOT
    return bytes(r._mm[off:off + SLOT])


SHAPES = [
    (Blocks(1, [5]), Blocks(2, [5])),
    (Blocks(7, [3, 4, 5, 30], 2, 4), Blocks(9, [10, 11, 12, 13], 0, 4)),
    (Blocks(7, range(0, 40, 3), 1, 2, list(range(100, 114))), Blocks(9, [0, 1, 2, 7, 8, 9, 1, 0])),
    (Blocks(3, np.array([4, 5, 6, 9], dtype=np.int64), 0, 1, np.array([1, 2, 3, 4], dtype=np.uint64)),
     Blocks(2**63, (2**32 - 1, 0), 2**32 - 1, 1)),
]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the pure-Python ring is x86-64 only")
def test_native_slots_are_the_pure_python_ones_byte_for_byte():
    native, python = detached("native"), detached("python")
    for i, (src, dst) in enumerate(SHAPES):
        op = R.PUSH if i % 2 == 0 else R.PULL
        a = native._submit(op, f"req-{i}", "decode", src, dst)
        b = python._submit(op, f"req-{i}", "decode", src, dst)
        assert a == b == i + 1
        assert slot(native, i) == slot(python, i), f"shape {i}"
        assert native._u64[R.SQ_TAIL].value == python._u64[R.SQ_TAIL].value == i + 1


def test_what_cannot_be_published_is_not():
    r = detached("native")
    big = Blocks(1, list(range(0, 2000, 2)))
    with pytest.raises(R.RingTooLarge, match="4096-byte slot"):
        r.submit_push("big", "decode", big, Blocks(2, [0]))
    with pytest.raises(R.RingTooLarge):
        r.submit_push("r" * 129, "decode", Blocks(1, [0]), Blocks(2, [0]))
    with pytest.raises(R.RingTooLarge):
        r.submit_push("r", "", Blocks(1, [0]), Blocks(2, [0]))
    for bad in ([-1], [2**32], ["x"], 5):
        with pytest.raises((ValueError, TypeError)):
            r.submit_push("bad", "decode", Blocks(1, bad), Blocks(2, [0]))
    with pytest.raises((ValueError, TypeError, OverflowError)):
        r.submit_push("bad", "decode", Blocks(1, [0], 2**32), Blocks(2, [0]))
    with pytest.raises((ValueError, TypeError, OverflowError)):
        r.submit_push("bad", "decode", Blocks(1, [0], 0, 1, [-3]), Blocks(2, [0]))
    assert r._u64[R.SQ_TAIL].value == 0
    assert not any(r._mm[R.HEADER_BYTES:R.HEADER_BYTES + SQ * SLOT])
    # A full queue: SQ published, the next refused until the sidecar moves the head.
    for i in range(SQ):
        r.submit_push(f"f{i}", "decode", Blocks(1, [i]), Blocks(2, [i]))
    with pytest.raises(R.RingFull):
        r.submit_push("over", "decode", Blocks(1, [0]), Blocks(2, [0]))
    r._u64[R.SQ_HEAD].value = 1
    assert r.submit_push("next", "decode", Blocks(1, [0]), Blocks(2, [0])) == SQ + 1
    # A ring the sidecar closed takes nothing more, and says why.
    r._u32[R.CLOSE_REASON].value = 2
    r._u32[R.STATE].value = R.STATE_CLOSED
    r._u64[R.SQ_HEAD].value = SQ + 1
    with pytest.raises(R.RingClosed, match="overrun"):
        r.submit_push("late", "decode", Blocks(1, [0]), Blocks(2, [0]))
    assert r._u64[R.SQ_TAIL].value == SQ + 1


def test_the_sleeping_sidecar_is_rung():
    r = detached("native")
    r._u32[R.SIDECAR_SLEEPING].value = 1
    r.submit_push("a", "decode", Blocks(1, [0]), Blocks(2, [0]))
    assert r._u32[R.SIDECAR_BELL].value == 1
    r._u32[R.SIDECAR_SLEEPING].value = 0
    r.submit_push("b", "decode", Blocks(1, [0]), Blocks(2, [0]))
    assert r._u32[R.SIDECAR_BELL].value == 1


def complete(r: R.Ring, kind: int, request_id: bytes, lengths: tuple[int, int, int, int] | None = None,
             message: bytes = b"") -> None:
    tail = r._u64[R.CQ_TAIL].value
    off = r._cq_offset + (tail % CQ) * R.CQ_SLOT_BYTES
    rl, pl, cl, ml = lengths or (len(request_id), 6, 0, len(message))
    r._mm[off:off + R.CQ_SLOT_BYTES] = bytes(R.CQ_SLOT_BYTES)
    r._mm[off:off + 8] = struct.pack("<BBBBBBxx", kind, 2, rl, pl, cl, ml)
    r._mm[off + 8:off + 64] = struct.pack("<7Q", 11, 12, 13, 14, 15, 16, 17)
    r._mm[off + 64:off + 64 + len(request_id)] = request_id
    r._mm[off + 192:off + 198] = b"decode"
    r._mm[off + 288:off + 288 + len(message)] = message
    r._u64[R.CQ_TAIL].value = tail + 1


def test_completions_read_as_the_pure_python_ones():
    for impl in ["native"] + (["python"] if platform.machine() == "x86_64" else []):
        r = detached(impl)
        assert r.poll() is None
        complete(r, 2, b"req-\xff", message="déjà".encode())
        complete(r, 42, b"odd")
        c = r.poll()
        assert c == R.RingCompletion("PUSH_RECEIVED", 11, 12, 13, 14, 15, 16, 17, "req-\ufffd", "decode", 2,
                                     "", "déjà"), impl
        assert isinstance(c, R.RingCompletion) and c.kind == "PUSH_RECEIVED"
        assert r.poll().kind == "UNKNOWN_42"
        assert r.poll() is None
        # Lengths past their fields are cut at the field (never read beyond it).
        complete(r, 5, b"x" * 128, lengths=(255, 255, 255, 255))
        c = r.poll()
        assert (len(c.request_id), len(c.peer), len(c.code), len(c.message)) == (128, 64, 32, 224)
        assert r._u64[R.CQ_HEAD].value == 3 if impl == "native" else r._head == 3


def test_an_overrun_completion_queue_closes_the_ring_for_the_reader():
    r = detached("native")
    r._u64[R.CQ_TAIL].value = CQ + 1
    with pytest.raises(R.RingClosed, match="not within one ring"):
        r.poll()
    r._u64[R.CQ_HEAD].value = 5
    r._u64[R.CQ_TAIL].value = 3
    with pytest.raises(R.RingClosed, match="not within one ring"):
        r.poll()


def test_wait_sleeps_until_a_completion_or_its_timeout():
    r = detached("native")
    assert r.wait(0.05) is None
    # A completion published by another thread wakes the sleeper through the bell.
    def publish():
        while r._u32[R.WORKER_SLEEPING].value == 0:
            pass
        complete(r, 1, b"late")
        r._u32[R.WORKER_BELL].value += 1
        r._futex.wake(r._base + R.WORKER_BELL)
    t = threading.Thread(target=publish)
    t.start()
    c = r.wait(10.0)
    t.join()
    assert c is not None and c.request_id == "late"
    assert r._u32[R.WORKER_SLEEPING].value == 0


def test_ids_changed_by_their_own_index_are_read_safely():
    """An id whose __index__ empties the list being read: the C code reads a
    copy, so it neither crashes nor reads freed memory."""
    r = detached("native")
    ids: list = []

    class Sneaky:
        def __index__(self):
            ids.clear()
            ids.extend(range(10_000))
            return 3

    ids.extend([Sneaky(), Sneaky(), 9])
    r.submit_push("s", "decode", Blocks(1, ids), Blocks(2, [0, 1, 2]))
    assert r._u64[R.SQ_TAIL].value == 1


def test_timeouts_must_be_finite():
    from kvrail import _ring_native as N

    r = detached("native")
    for bad in (float("nan"), float("inf"), 5.0):
        with pytest.raises(ValueError):
            N.spin(r._mm, bad)
    for bad in (float("nan"), float("-inf")):
        with pytest.raises(ValueError):
            N.sleep(r._mm, bad)


def test_geometry_that_does_not_fit_the_mapping_is_refused():
    from kvrail import _ring_native as N

    r = detached("native")
    src, dst = Blocks(1, [0]), Blocks(2, [0])
    for entries, slot in [(SQ + 1, SLOT), (2**62, SLOT), (SQ, 2**62), (0, SLOT), (SQ, 8)]:
        with pytest.raises(ValueError):
            N.submit(r._mm, entries, slot, R.PUSH, "x", "decode", src, dst)
    for offset, entries in [(r._cq_offset, CQ + 1), (r._cq_offset, 2**62), (0, CQ)]:
        with pytest.raises(ValueError):
            N.poll(r._mm, offset, entries)
    assert r._u64[R.SQ_TAIL].value == 0


def test_a_ring_unmapped_by_close_refuses_calls():
    from kvrail import _ring_native as N

    r = detached("native")
    mm = r._mm
    r._release()
    # The C functions themselves refuse a closed mapping.
    with pytest.raises(ValueError):
        N.submit(mm, SQ, SLOT, R.PUSH, "x", "decode", Blocks(1, [0]), Blocks(2, [0]))
    with pytest.raises(ValueError):
        N.poll(mm, R.HEADER_BYTES + SQ * SLOT, CQ)
    with pytest.raises(ValueError):
        N.spin(mm, 0.0)
    with pytest.raises(R.RingClosed):
        r.submit_push("x", "decode", Blocks(1, [0]), Blocks(2, [0]))
    with pytest.raises(R.RingClosed):
        r.poll()
