"""The worker's submission ring (layout: docs/ring-format.md).

A push or pull is one slot written into shared memory and a tail index
moved; the sidecar answers in the completion queue. No gRPC call, and a
futex system call only when the sidecar sleeps.

Two implementations of the worker's side, the same protocol:

- ``native``: the compiled ``kvrail._ring_native`` (built with the package
  when a C compiler and Python's headers are there): each step is one C call
  with real atomics (release stores, full fences), on any CPU.
- ``python``: ``mmap`` and ``ctypes`` only. The 8-byte index words are written
  with single aligned stores, and the slot bytes before the index. That order
  holds for other processes on x86-64, whose stores are seen in program
  order; on other CPUs (aarch64) a plain Python store has no release barrier,
  so there the pure-Python ring is not offered.

``KVRAIL_RING_IMPL`` (``native``, ``python``, or ``auto``, the default:
native when built) or ``Ring(impl=...)`` picks one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import platform
import secrets
import struct
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .v1 import sidecar_pb2 as pb

try:
    from . import _ring_native
    _NATIVE_MISSING = ""
except ImportError as _e:  # not built: no compiler or headers at install time
    _ring_native = None  # type: ignore[assignment]
    _NATIVE_MISSING = str(_e)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .client import Blocks, Client

MAGIC = b"KVRRING1"
VERSION = 1
HEADER_BYTES = 4096
CQ_SLOT_BYTES = 512
# Offsets of the control words (kvrail_core::ring::offset).
STATE, CLOSE_REASON = 28, 32
SQ_TAIL, SQ_HEAD, CQ_TAIL, CQ_HEAD = 64, 128, 192, 256
SIDECAR_BELL, SIDECAR_SLEEPING, WORKER_BELL, WORKER_SLEEPING = 320, 324, 384, 388
STATE_OPEN, STATE_CLOSED = 1, 2
PUSH, PULL = 1, 2
KINDS = {1: "PUSH_DONE", 2: "PUSH_RECEIVED", 3: "PULL_DONE", 4: "PULL_SERVED", 5: "FAILED",
         7: "ACCEPTED", 8: "REJECTED"}
CLOSE_REASONS = {
    1: "the OpenRing call ended (the worker closed the ring or went away)",
    2: "submission queue overrun",
    3: "completion queue overrun",
    4: "the worker does not read its completions (backlog limit reached)",
    5: "the ring file was truncated under the sidecar's mapping",
    6: "the sidecar is shutting down",
    7: "the worker's header changed while the ring was open",
    8: "the sidecar went away (its OpenRing call ended)",
}
_SUB_FIXED = 248
# A submission slot's fixed part: the 56-byte head, the peer name (64 bytes
# at 56) and the request id (128 at 120), zero-padded by the "s" fields.
_SUB_FIXED_FORMAT = "<BBBBHHHHIQQQIIII64s128s"
# A completion slot: the 64-byte head, request id (128), peer (64), code (32),
# message (224).
_CQ_SLOT = struct.Struct("<BBBBBBxx7Q128s64s32s224s")
@functools.lru_cache(maxsize=256)
def _slot_struct(runs: int, generations: int) -> struct.Struct:
    """One Struct writes a whole submission slot (the last 256 shapes cached)."""
    return struct.Struct(f"{_SUB_FIXED_FORMAT}{2 * runs}I{generations}Q")


_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


def _pick_impl(asked: str | None) -> str:
    """The implementation a new ring uses; RingClosed says why none can."""
    want = asked or os.environ.get("KVRAIL_RING_IMPL", "auto") or "auto"
    if want not in ("auto", "native", "python"):
        raise RingClosed(f"ring implementation {want!r}: expected native, python or auto")
    if want in ("auto", "native") and _ring_native is not None:
        return "native"
    if want == "native":
        raise RingClosed(f"the compiled ring extension is not built ({_NATIVE_MISSING})")
    if platform.machine() != "x86_64":
        raise RingClosed(f"rings on {platform.machine()} need the compiled extension "
                         f"(kvrail._ring_native: {_NATIVE_MISSING or 'not chosen'})")
    return "python"


def supported() -> bool:
    """Whether this interpreter can drive a ring safely (see the module doc)."""
    if not os.path.isdir("/dev/shm"):
        return False
    try:
        _pick_impl(None)
    except RingClosed:
        return False
    return True


def native_available() -> bool:
    """Whether the compiled ring extension was built and imports."""
    return _ring_native is not None


class RingClosed(Exception):
    """The sidecar no longer serves the ring; the message says why."""


class RingFull(Exception):
    """The submission queue is full: read completions, then submit again."""


class RingTooLarge(ValueError):
    """The submission does not fit one slot: use the gRPC call."""


class RingCompletion(NamedTuple):
    """One completion: immutable (a named tuple, built in one step: polled
    on the worker's hot path)."""

    kind: str  # ACCEPTED, REJECTED, or a notification kind
    user_data: int
    transfer_id: int
    region_id: int
    bytes: int
    elapsed_us: int
    sequence: int
    incarnation: int
    request_id: str
    peer: str
    failure_side: int
    code: str
    message: str


class _Futex:
    def __init__(self) -> None:
        name = ctypes.util.find_library("c") or "libc.so.6"
        # Calls that return at once keep the GIL (PyDLL): releasing it hands
        # it to any other thread that wants it, and the submitter then waits
        # for it back. Only the sleeping wait releases it.
        fast = ctypes.PyDLL(name, use_errno=True)
        slow = ctypes.CDLL(name, use_errno=True)
        self._wake_call = fast.syscall
        self._wake_call.restype = ctypes.c_long
        self._wait_call = slow.syscall
        self._wait_call.restype = ctypes.c_long
        # A locked instruction orders a store before a later load (x86 lets a
        # load pass an earlier store otherwise). pthread_spin_trylock on a
        # lock that stays taken is one on x86-64 (glibc: xchg or lock
        # cmpxchg, a full barrier there whether or not it takes the lock;
        # not on aarch64, where supported() keeps rings off), for one C call.
        self._lock = ctypes.c_int(0)
        fast.pthread_spin_init(ctypes.byref(self._lock), 0)
        fast.pthread_spin_lock(ctypes.byref(self._lock))
        self._trylock = fast.pthread_spin_trylock
        self._lock_ref = ctypes.byref(self._lock)

    def fence(self) -> None:
        self._trylock(self._lock_ref)

    def wait(self, addr: int, expected: int, timeout_s: float) -> None:
        sec = int(timeout_s)
        ts = (ctypes.c_long * 2)(sec, int((timeout_s - sec) * 1e9))
        self._wait_call(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
                        ctypes.byref(ts), None, 0)

    def wake(self, addr: int) -> None:
        self._wake_call(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _runs(block_ids: "Sequence[int]") -> list[int]:
    """Block ids as consecutive runs, flat: start, count, start, count..."""
    flat: list[int] = []
    prev = -2
    for b in block_ids:
        if b == prev + 1:
            flat[-1] += 1
        else:
            flat += (b, 1)
        prev = b
    return flat


if _ring_native is not None:
    _ring_native.set_types(tuple(KINDS.get(k) for k in range(max(KINDS) + 1)), RingCompletion,
                           RingTooLarge)


class Ring:
    """A ring served for one worker. ``Client.open_ring`` makes one."""

    def __init__(self, client: "Client", *, sq_entries: int = 256, cq_entries: int = 1024,
                 slot_bytes: int = 4096, notifications: bool = True, take_over: bool = False,
                 spin_s: float | None = None, impl: str | None = None) -> None:
        #: "native" (the compiled extension) or "python" (see the module doc).
        self.impl = _pick_impl(impl)
        if not os.path.isdir("/dev/shm"):
            raise RingClosed("rings need /dev/shm")
        self.sq_entries, self.cq_entries, self.slot_bytes = sq_entries, cq_entries, slot_bytes
        # kvrail_core::ring::MIN_CPUS_TO_SPIN: no spinning below 4 CPUs.
        self.spin_s = spin_s if spin_s is not None else (50e-6 if (os.cpu_count() or 1) >= 4 else 0.0)
        total = HEADER_BYTES + sq_entries * slot_bytes + cq_entries * CQ_SLOT_BYTES
        self._cq_offset = HEADER_BYTES + sq_entries * slot_bytes
        path = Path("/dev/shm") / f"kvrail-ring-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            self._mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._mm[0:28] = MAGIC + struct.pack("<IIIII", VERSION, sq_entries, cq_entries,
                                             slot_bytes, CQ_SLOT_BYTES)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._u64 = {o: ctypes.c_uint64.from_buffer(self._mm, o)
                     for o in (SQ_TAIL, SQ_HEAD, CQ_TAIL, CQ_HEAD)}
        self._u32 = {o: ctypes.c_uint32.from_buffer(self._mm, o)
                     for o in (STATE, CLOSE_REASON, SIDECAR_BELL, SIDECAR_SLEEPING,
                               WORKER_BELL, WORKER_SLEEPING)}
        self._futex = _Futex()
        self._tail = 0
        self._head = 0
        self._next_user_data = 1
        self._submit_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._wait_lock = threading.Lock()
        self._released = False
        try:
            self._call = client._stub.OpenRing(pb.OpenRingRequest(
                worker_id=client.worker_id, shm_path=str(path), notifications=notifications,
                take_over=take_over))
            first = next(self._call)
        except Exception as e:  # grpc.RpcError, StopIteration
            self._release()
            raise client._ring_error(e) from None
        finally:
            path.unlink(missing_ok=True)
        self.incarnation = first.incarnation
        # The watcher holds the ring weakly: a Ring dropped without close()
        # still ends its call (the finalizer), so the sidecar stops serving it.
        weak = weakref.ref(self)
        self._watcher = threading.Thread(target=Ring._watch, args=(self._call, weak),
                                         name="kvrail-ring-watch", daemon=True)
        self._watcher.start()
        weakref.finalize(self, self._call.cancel)

    @staticmethod
    def _watch(call: object, weak: "weakref.ref[Ring]") -> None:
        try:
            for _ in call:  # type: ignore[attr-defined]
                pass
        except Exception:
            pass
        self = weak()
        if self is None or self._released:
            return
        # The call ended: if the sidecar did not close the ring itself, it went away.
        if self._u32[STATE].value != STATE_CLOSED:
            self._u32[CLOSE_REASON].value = 8
            self._u32[STATE].value = STATE_CLOSED
        self._u32[WORKER_BELL].value += 1
        self._futex.wake(self._base + WORKER_BELL)

    def closed(self) -> str | None:
        """Why the ring is no longer served, or None."""
        if self._released:
            return "the ring was closed by this worker"
        if self._u32[STATE].value != STATE_CLOSED:
            return None
        return CLOSE_REASONS.get(self._u32[CLOSE_REASON].value, "closed by the sidecar")

    def submit_push(self, request_id: str, peer: str, source: "Blocks", destination: "Blocks") -> int:
        return self._submit(PUSH, request_id, peer, source, destination)

    def submit_pull(self, request_id: str, peer: str, source: "Blocks", destination: "Blocks") -> int:
        return self._submit(PULL, request_id, peer, source, destination)

    def _submit(self, op: int, request_id: str, peer: str, src: "Blocks", dst: "Blocks") -> int:
        if self.impl == "native":
            if self._released:
                raise RingClosed("the ring was closed by this worker")
            try:
                r = _ring_native.submit(self._mm, self.sq_entries, self.slot_bytes, op, request_id,
                                        peer, src, dst)
            except ValueError as e:  # RingTooLarge is one too
                if self._released:  # unmapped by close() meanwhile
                    raise RingClosed("the ring was closed by this worker") from None
                raise e from None
            if r > 0:
                return r
            if r == 0:
                raise RingFull(f"{self.sq_entries} submissions in flight")
            if r == -1:
                raise RingClosed(self.closed() or "closed by the sidecar")
            raise RingTooLarge(f"{-r} bytes of block runs and generations for a "
                               f"{self.slot_bytes}-byte slot")
        why = self.closed()
        if why is not None:
            raise RingClosed(why)
        rid, pname = request_id.encode(), peer.encode()
        if not 0 < len(rid) <= 128 or not 0 < len(pname) <= 64:
            raise RingTooLarge("request id must be 1..=128 bytes and peer 1..=64")
        sr, dr = _runs(src.block_ids), _runs(dst.block_ids)
        sg, dg = src.generations, dst.generations
        need = _SUB_FIXED + 4 * (len(sr) + len(dr)) + 8 * (len(sg) + len(dg))
        if need > self.slot_bytes:
            raise RingTooLarge(f"{need} bytes of block runs and generations for a {self.slot_bytes}-byte slot")
        with self._submit_lock:
            if self._tail - self._u64[SQ_HEAD].value >= self.sq_entries:
                raise RingFull(f"{self.sq_entries} submissions in flight")
            user_data = self._next_user_data
            self._next_user_data += 1
            # Written in place in one step: only what the counts cover is
            # read, so the rest of the slot may keep old bytes.
            off = HEADER_BYTES + (self._tail % self.sq_entries) * self.slot_bytes
            _slot_struct((len(sr) + len(dr)) // 2, len(sg) + len(dg)).pack_into(
                self._mm, off, op, 0, len(pname), len(rid), len(sr) // 2, len(dr) // 2, len(sg),
                len(dg), 0, user_data, src.region_id, dst.region_id, src.layer_start,
                src.layer_count, dst.layer_start, dst.layer_count, pname, rid, *sr, *dr, *sg, *dg)
            self._tail += 1
            self._u64[SQ_TAIL].value = self._tail  # after the slot: the publication
            self._futex.fence()  # the tail store before the sleeping load
            if self._u32[SIDECAR_SLEEPING].value != 0:
                self._u32[SIDECAR_BELL].value += 1
                self._futex.wake(self._base + SIDECAR_BELL)
        return user_data

    def poll(self) -> RingCompletion | None:
        """The next completion, if one is published."""
        if self._released:
            raise RingClosed("the ring was closed by this worker")
        if self.impl == "native":
            # One C call that runs no Python code between taking the slot and
            # moving the head: no lock needed beside the interpreter's (which a
            # free-threaded build turns back on for this single-phase module).
            try:
                return _ring_native.poll(self._mm, self._cq_offset, self.cq_entries)
            except ValueError as e:
                raise RingClosed(str(e)) from None
        with self._read_lock:
            tail = self._u64[CQ_TAIL].value
            if tail == self._head:
                return None
            if tail - self._head > self.cq_entries or tail < self._head:
                raise RingClosed(f"completion tail {tail} is not within one ring of {self._head}")
            off = self._cq_offset + (self._head % self.cq_entries) * CQ_SLOT_BYTES
            (kind, side, rl, pl, cl, ml, ud, tid, region, nbytes, el, seq, inc,
             rid, peer, code, msg) = _CQ_SLOT.unpack_from(self._mm, off)  # copied out
            self._head += 1
            self._u64[CQ_HEAD].value = self._head
        return RingCompletion(
            KINDS.get(kind, f"UNKNOWN_{kind}"), ud, tid, region, nbytes, el, seq, inc,
            rid[:rl].decode(errors="replace"), peer[:pl].decode(errors="replace"), side,
            code[:cl].decode(errors="replace") if cl else "",
            msg[:ml].decode(errors="replace") if ml else "")

    def wait(self, timeout: float) -> RingCompletion | None:
        """The next completion: spins ``spin_s``, then sleeps on the ring's
        futex; None after ``timeout`` seconds. Raises RingClosed once the
        ring is closed and drained."""
        with self._wait_lock:  # one sleeper at a time: the sleeping word is a flag
            return self._wait(timeout)

    def _wait(self, timeout: float) -> RingCompletion | None:
        deadline = time.monotonic() + timeout
        while True:
            c = self.poll()
            if c is not None:
                return c
            why = self.closed()
            if why is not None:
                raise RingClosed(why)
            now = time.monotonic()
            if now >= deadline:
                return None
            if self.impl == "native":
                if not _ring_native.spin(self._mm, min(self.spin_s, deadline - now)):
                    _ring_native.sleep(self._mm, min(deadline - now, 0.1))
                continue
            spin_until = now + min(self.spin_s, deadline - now)
            while time.monotonic() < spin_until:
                if self._u64[CQ_TAIL].value != self._head:
                    break
            else:
                seen = self._u32[WORKER_BELL].value
                self._u32[WORKER_SLEEPING].value = 1
                self._futex.fence()  # the sleeping store before the tail load
                if self._u64[CQ_TAIL].value == self._head and self.closed() is None:
                    self._futex.wait(self._base + WORKER_BELL, seen, min(deadline - now, 0.1))
                self._u32[WORKER_SLEEPING].value = 0

    def close(self) -> None:
        """Ends the ring's call (the sidecar stops serving it) and unmaps it."""
        call = getattr(self, "_call", None)
        if call is not None:
            call.cancel()
            self._watcher.join(timeout=5)
        self._release()

    def _release(self) -> None:
        self._released = True
        self._u64 = {}
        self._u32 = {}
        try:
            self._mm.close()
        except BufferError:
            pass  # a completion view still alive; the mapping goes with the object

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
