"""A synchronous client of the local kvrail sidecar (gRPC on a Unix socket)."""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import grpc

from .errors import (
    KvrailError,
    PeerUnavailable,
    SidecarUnavailable,
    LayersNotEvenlySpaced,
    Timeout,
    TransferFailed,
    from_status,
)
from .geometry import HeadSlice, KvGeometry
from .layout import KvLayout, Layout
from .memory import CudaIpc, HostKvCache, describe
from .v1 import sidecar_pb2 as pb
from .v1 import sidecar_pb2_grpc as pb_grpc

T = TypeVar("T")
_DEFAULT = object()  # "the client's own timeout"

#: Notification kinds, as their proto names without the prefix.
PUSH_DONE = "PUSH_DONE"
PUSH_RECEIVED = "PUSH_RECEIVED"
PULL_DONE = "PULL_DONE"
PULL_SERVED = "PULL_SERVED"
FAILED = "FAILED"
#: A worker on a peer node sent this worker a message (:meth:`Client.send_message`);
#: ``request_id`` holds its topic.
MESSAGE = "MESSAGE"

_FAILURE_SIDES = {v: k.removeprefix("FAILURE_SIDE_") for k, v in pb.FailureSide.items()}
_KINDS = {v: k.removeprefix("NOTIFICATION_KIND_") for k, v in pb.NotificationKind.items()}
_STATES = {v: k.removeprefix("TRANSFER_STATE_") for k, v in pb.TransferState.items()}


@dataclass(frozen=True)
class Blocks:
    """Blocks of one region: every plane of layers ``[layer_start, layer_start +
    layer_count)`` of each listed block, moved in that order."""

    region_id: int
    block_ids: Sequence[int]
    layer_start: int = 0
    layer_count: int = 1
    #: Empty, or one per block: the generation each block must still be at
    #: (from ``Client.block_generations`` on the region's side; 0 = any).
    generations: Sequence[int] = ()
    #: Move only these heads of these tokens (both regions registered with
    #: their :class:`KvGeometry`); None: whole blocks.
    slice: HeadSlice | None = None
    #: With a slice: the stream starts at this token of the first listed
    #: block (engines with other block sizes meet mid-block).
    first_token: int = 0

    def to_proto(self) -> pb.BlockRange:
        r = pb.BlockRange(
            region_id=self.region_id,
            layer_start=self.layer_start,
            layer_count=self.layer_count,
            block_ids=list(self.block_ids),
            generations=list(self.generations),
            first_token=self.first_token,
        )
        if self.slice is not None:
            r.slice.CopyFrom(self.slice.to_proto())
        return r


@dataclass(frozen=True)
class Transfer:
    """A transfer the sidecar accepted."""

    transfer_id: int
    request_id: str
    total_bytes: int
    segments: int  # contiguous byte runs after coalescing


@dataclass(frozen=True)
class Failure:
    side: str  # LOCAL, PEER, RAIL, TIMEOUT, CANCELLED
    code: str
    message: str

    def error(self, request_id: str, transfer_id: int) -> TransferFailed:
        return TransferFailed(request_id, transfer_id, self.side, self.code, self.message)


@dataclass(frozen=True)
class TransferStatus:
    transfer_id: int
    request_id: str
    state: str  # QUEUED, IN_FLIGHT, DONE, FAILED
    total_bytes: int
    bytes_done: int
    elapsed_us: int
    failure: Failure | None

    @property
    def finished(self) -> bool:
        return self.state in ("DONE", "FAILED")

    def raise_if_failed(self) -> "TransferStatus":
        if self.failure is not None and self.state == "FAILED":
            raise self.failure.error(self.request_id, self.transfer_id)
        return self


@dataclass(frozen=True)
class Notification:
    kind: str  # PUSH_DONE, PUSH_RECEIVED, PULL_DONE, PULL_SERVED, FAILED, MESSAGE
    transfer_id: int
    request_id: str
    peer: str
    region_id: int
    block_ids: tuple[int, ...]
    bytes: int
    elapsed_us: int
    failure: Failure | None = None
    received_at: float = field(default=0.0, compare=False)  # time.monotonic()
    sequence: int = 0  # this worker's notification number (resume point)
    incarnation: int = 0  # the sidecar process that numbered it
    payload: bytes = b""  # MESSAGE: what the sender sent
    from_worker: str = ""  # MESSAGE: the sending worker on ``peer``

    def raise_if_failed(self) -> "Notification":
        if self.failure is not None:
            raise self.failure.error(self.request_id, self.transfer_id)
        return self


def _failure(msg: pb.Failure, present: bool) -> Failure | None:
    if not present:
        return None
    return Failure(_FAILURE_SIDES.get(msg.side, str(msg.side)), msg.code, msg.message)


def _status(s: pb.TransferStatus) -> TransferStatus:
    return TransferStatus(
        transfer_id=s.transfer_id,
        request_id=s.request_id,
        state=_STATES.get(s.state, str(s.state)),
        total_bytes=s.total_bytes,
        bytes_done=s.bytes_done,
        elapsed_us=s.elapsed_us,
        failure=_failure(s.failure, s.HasField("failure")),
    )


def _notification(n: pb.Notification) -> Notification:
    return Notification(
        kind=_KINDS.get(n.kind, str(n.kind)),
        transfer_id=n.transfer_id,
        request_id=n.request_id,
        peer=n.peer,
        region_id=n.region_id,
        block_ids=tuple(n.block_ids),
        bytes=n.bytes,
        elapsed_us=n.elapsed_us,
        failure=_failure(n.failure, n.HasField("failure")),
        received_at=time.monotonic(),
        sequence=n.sequence,
        incarnation=n.incarnation,
        payload=bytes(n.payload),
        from_worker=n.from_worker,
    )


def _error(e: grpc.RpcError, socket: Path) -> KvrailError:
    code = e.code() if hasattr(e, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    reason = e.details() if hasattr(e, "details") else str(e)
    if name == "UNAVAILABLE":
        return SidecarUnavailable(f"sidecar at {socket}: {reason}")
    if name == "DEADLINE_EXCEEDED":
        return Timeout(f"sidecar at {socket} did not answer in time: {reason}")
    return from_status(name, reason or name)


class Notifications:
    """The notifications addressed to one worker, as they happen. Iterate, or
    ``get(timeout)``; the stream's end (sidecar gone) raises
    :class:`SidecarUnavailable` instead of blocking."""

    _END = object()

    def __init__(self, call: grpc.Call, socket: Path, on_end: Callable[[KvrailError], None] | None = None) -> None:
        self._call = call
        self._socket = socket
        self._on_end = on_end
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, name="kvrail-notifications", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        end: KvrailError | None
        try:
            for n in self._call:  # type: ignore[attr-defined]
                self._queue.put(_notification(n))
            end = SidecarUnavailable(f"sidecar at {self._socket} ended the notification stream")
        except grpc.RpcError as e:
            end = None if e.code() == grpc.StatusCode.CANCELLED else _error(e, self._socket)
        self._queue.put(self._END if end is None else end)
        if end is not None and self._on_end is not None:
            self._on_end(end)

    def get(self, timeout: float | None = None) -> Notification:
        """The next notification; :class:`Timeout` after ``timeout`` seconds."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise Timeout(f"no notification within {timeout} s") from None
        if isinstance(item, Notification):
            return item
        # Keep the end for any later call too.
        self._queue.put(item)
        if item is self._END:
            raise StopIteration
        assert isinstance(item, KvrailError)
        raise item

    def poll(self) -> list[Notification]:
        """Every notification already received, without waiting."""
        out: list[Notification] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, Notification):
                out.append(item)
                continue
            self._queue.put(item)
            if out or item is self._END:
                return out
            assert isinstance(item, KvrailError)
            raise item

    def __iter__(self) -> Iterator[Notification]:
        while True:
            try:
                yield self.get()
            except StopIteration:
                return

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "Notifications":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_server_user(path: Path) -> None:
    """Refuses a socket served by a process of another user than ours or
    root: in a shared directory such as /tmp, another user could bind the
    sidecar's path first and pose as it (shared-memory paths and block ids
    would go to them, and their answers would be trusted)."""
    import socket as _socket
    import struct

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.settimeout(5.0)
        s.connect(str(path))
        pid, uid, gid = struct.unpack("3i", s.getsockopt(
            _socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError as e:
        raise SidecarUnavailable(f"cannot reach a sidecar at {path}: {e}") from e
    finally:
        s.close()
    me = os.geteuid()
    if uid not in (me, 0):
        raise SidecarUnavailable(
            f"{path} is served by uid {uid} (pid {pid}), neither this user ({me}) nor root: "
            "refusing it (another user may pose as the sidecar; give the sidecar a --socket "
            "in a directory only its user may write)")


class Client:
    """One worker's connection to its node's sidecar.

    ``timeout`` bounds every call (seconds); :meth:`wait` has its own.
    ``submit_path`` says how :meth:`push` and :meth:`pull` reach the sidecar:
    ``"ring"`` (the default) through this worker's shared-memory ring where the
    sidecar serves one and this interpreter can drive it (see
    :mod:`kvrail.ring`), else gRPC; ``"grpc"``: one gRPC call each.
    """

    def __init__(
        self,
        socket: str | os.PathLike[str],
        worker_id: str,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        submit_path: str = "ring",
    ) -> None:
        if submit_path not in ("ring", "grpc"):
            raise ValueError(f"submit_path must be 'ring' or 'grpc', not {submit_path!r}")
        self.socket = Path(socket)
        self.worker_id = worker_id
        self.timeout = timeout
        self.submit_path = submit_path
        # The ring push/pull go through (opened on first use, without
        # notifications: those stay on notifications()); one call at a time.
        self._submit_ring: Any = None
        self._submit_lock = threading.Lock()
        self._rings_unsupported = False
        # After a ring could not be opened, gRPC until then (no failed
        # OpenRing per transfer where rings cannot work).
        self._ring_retry_at = 0.0
        if not self.socket.exists():
            raise SidecarUnavailable(f"no sidecar socket at {self.socket}")
        _check_server_user(self.socket)
        self._channel = grpc.insecure_channel(
            f"unix:{self.socket}",
            # gRPC's default :authority for a unix: target is the socket path,
            # which the sidecar's HTTP/2 stack rejects as malformed.
            options=[("grpc.default_authority", "localhost")],
        )
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise SidecarUnavailable(
                f"no sidecar answers on {self.socket} within {connect_timeout} s"
            ) from None
        self._stub = pb_grpc.SidecarStub(self._channel)

    def _call(self, fn: Callable[..., T], req: object, timeout: object = _DEFAULT) -> T:
        try:
            return fn(req, timeout=self.timeout if timeout is _DEFAULT else timeout)
        except ValueError as e:
            # grpc's "Cannot invoke RPC on closed channel": another thread
            # closed this client (it found the sidecar gone).
            raise SidecarUnavailable(f"client of {self.socket} closed: {e}") from None
        except grpc.RpcError as e:
            err = _error(e, self.socket)
            if isinstance(err, SidecarUnavailable) and self._answers():
                # The sidecar is up and said UNAVAILABLE itself: a peer it cannot reach.
                raise PeerUnavailable(err.reason.split(": ", 1)[-1]) from None
            raise err from None

    def open_ring(self, **options: Any) -> "Ring":
        """A shared-memory submission ring for this worker (see
        :mod:`kvrail.ring`): pushes and pulls without a gRPC call per
        transfer; with ``notifications=True`` (the default) this worker's
        transfer notifications arrive in the ring instead of
        :meth:`notifications`. While another process holds a live
        :meth:`notifications` stream of this worker id, such a ring is refused
        (AlreadyExists) unless ``take_over=True`` (that stream then ends
        ABORTED)."""
        from .ring import Ring

        return Ring(self, **options)

    def _ring_error(self, e: BaseException) -> Exception:
        from .ring import RingClosed

        if isinstance(e, grpc.RpcError):
            return _error(e, self.socket)
        return RingClosed(f"the sidecar did not serve the ring: {e!r}")

    def _answers(self) -> bool:
        try:
            self._stub.ListPeers(pb.ListPeersRequest(), timeout=1.0)
            return True
        except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
            return False

    # Regions -------------------------------------------------------------

    def register_shm(
        self,
        path: str | os.PathLike[str],
        layout: Layout,
        *,
        expose: bool = False,
        geometry: KvGeometry | None = None,
    ) -> int:
        """Registers a shared-memory file (with what its blocks hold, for
        head-sliced transfers); returns the region id."""
        req = pb.RegisterRegionRequest(
            worker_id=self.worker_id,
            shm_path=str(path),
            layout=layout.to_proto(),
            expose_to_peers=expose,
        )
        if geometry is not None:
            req.geometry.CopyFrom(geometry.to_proto())
        r = self._call(self._stub.RegisterRegion, req)
        return int(r.region_id)

    def register_kv_cache(self, kv: HostKvCache, *, expose: bool = False) -> int:
        """Registers a :class:`HostKvCache`; returns the region id."""
        return self.register_shm(kv.path, kv.layout, expose=expose)

    def register_cuda(
        self, ipc: CudaIpc, layout: Layout, *, expose: bool = False, geometry: KvGeometry | None = None
    ) -> int:
        """Registers GPU memory by CUDA IPC handle (``layout.base_offset`` counts
        from the allocation's start); returns the region id."""
        req = pb.RegisterRegionRequest(
            worker_id=self.worker_id,
            layout=layout.to_proto(),
            expose_to_peers=expose,
            cuda_ipc=pb.CudaIpcMemory(handle=ipc.handle, device=ipc.device),
        )
        if geometry is not None:
            req.geometry.CopyFrom(geometry.to_proto())
        r = self._call(self._stub.RegisterRegion, req)
        return int(r.region_id)

    def register_layers(
        self,
        layers: Sequence[Any],
        kv_layout: KvLayout | None = None,
        *,
        expose: bool = False,
        geometry: KvGeometry | None = None,
    ) -> list[tuple[int, int, int, Layout]]:
        """Registers per-layer KV tensors (host tensors in kvrail shared memory, or
        torch CUDA tensors): one region when the layers are evenly spaced in one
        allocation, else one per layer, each with ``geometry`` when given.
        Returns (region id, first layer, layer count, layout) per region, in
        layer order."""
        try:
            groups = [(0, len(layers), describe(layers, kv_layout))]
        except LayersNotEvenlySpaced:
            groups = [(i, 1, describe([t], kv_layout)) for i, t in enumerate(layers)]
        out = []
        for start, count, (paged, memory) in groups:
            if isinstance(memory, CudaIpc):
                rid = self.register_cuda(memory, paged.layout, expose=expose, geometry=geometry)
            else:
                rid = self.register_shm(memory, paged.layout, expose=expose, geometry=geometry)
            out.append((rid, start, count, paged.layout))
        return out

    def unregister(self, region_id: int) -> None:
        self._call(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(region_id=region_id))

    def block_generations(self, region_id: int, block_ids: Sequence[int]) -> list[int]:
        """The current generation of each listed block of a local region. Hand
        them to the other side with the block ids (``Blocks.generations``): a
        transfer naming them fails with ``blocks_released`` once any of the
        blocks is released, instead of moving bytes the worker has reused."""
        r = self._call(
            self._stub.BlockGenerations,
            pb.BlockGenerationsRequest(region_id=region_id, block_ids=list(block_ids)),
        )
        return list(r.generations)

    def release_blocks(self, region_id: int, block_ids: Sequence[int]) -> tuple[list[int], int]:
        """Releases blocks of a local region (freed, or about to be reused):
        their generations move on and every transfer naming them fails
        (``blocks_released``) before this returns. Returns the new generations
        and how many transfers failed."""
        r = self._call(
            self._stub.ReleaseBlocks,
            pb.ReleaseBlocksRequest(region_id=region_id, block_ids=list(block_ids)),
        )
        return list(r.generations), r.transfers_failed

    # Transfers -----------------------------------------------------------

    def push(
        self,
        request_id: str,
        peer: str,
        source: Blocks,
        destination: Blocks,
        group: tuple[str, int] | None = None,
        receiver_group: tuple[str, int] | None = None,
    ) -> Transfer:
        """Writes local blocks into blocks of a region on ``peer``.

        ``group`` = (group id, members): the transfer completes as one with
        the group's other members; this worker is notified once for the group
        (``request_id`` = the group id), when all are done or at the first
        failure. ``receiver_group`` = (group id, members): the receiving
        worker hears of this push and the group's other members once,
        whoever pushes them (one ``PUSH_RECEIVED`` with the bytes summed, or
        one ``FAILED``)."""
        return self._transfer(True, request_id, peer, source, destination, group, receiver_group)

    def pull(
        self, request_id: str, peer: str, source: Blocks, destination: Blocks, group: tuple[str, int] | None = None
    ) -> Transfer:
        """Reads blocks of an exposed region on ``peer`` into local blocks
        (``group`` as for :meth:`push`)."""
        return self._transfer(False, request_id, peer, source, destination, group)

    def _transfer(
        self,
        push: bool,
        request_id: str,
        peer: str,
        source: Blocks,
        destination: Blocks,
        group: tuple[str, int] | None = None,
        receiver_group: tuple[str, int] | None = None,
    ) -> Transfer:
        # Ring slots carry whole-block selections and no group: head slices
        # and grouped transfers go by gRPC.
        sliced = any(b.slice is not None or b.first_token for b in (source, destination))
        if self.submit_path == "ring" and not sliced and group is None and receiver_group is None:
            t = self._ring_transfer(push, request_id, peer, source, destination)
            if t is not None:
                return t
        # PushRequest and PullRequest have the same fields.
        rpc, message = (self._stub.Push, pb.PushRequest) if push else (self._stub.Pull, pb.PullRequest)
        fields: dict[str, Any] = {}
        if receiver_group is not None:
            fields["receiver_group"] = pb.TransferGroup(id=receiver_group[0], members=receiver_group[1])
        r = self._call(
            rpc,
            message(
                request_id=request_id,
                worker_id=self.worker_id,
                peer=peer,
                source=source.to_proto(),
                destination=destination.to_proto(),
                group=None if group is None else pb.TransferGroup(id=group[0], members=group[1]),
                **fields,
            ),
        )
        return Transfer(r.transfer_id, request_id, r.total_bytes, r.segments)

    def _ring_transfer(
        self, push: bool, request_id: str, peer: str, source: Blocks, destination: Blocks
    ) -> Transfer | None:
        """Starts the transfer through the ring; None when it was not written
        there (no ring here, queue full, too large for a slot, ring closed),
        so gRPC starts it instead: it cannot start twice."""
        from . import ring as rg

        with self._submit_lock:
            r = self._submit_ring
            if r is None:
                if self._rings_unsupported or not rg.supported() or time.monotonic() < self._ring_retry_at:
                    return None
                try:
                    r = rg.Ring(self, notifications=False)
                except KvrailError as e:
                    # UNIMPLEMENTED: a sidecar without rings. Anything else
                    # (this worker's rings all taken...) is retried later.
                    self._rings_unsupported = e.status == "UNIMPLEMENTED"
                    self._ring_retry_at = time.monotonic() + 10.0
                    return None
                except (OSError, rg.RingClosed):
                    self._ring_retry_at = time.monotonic() + 10.0
                    return None
                self._submit_ring = r
            try:
                if push:
                    user_data = r.submit_push(request_id, peer, source, destination)
                else:
                    user_data = r.submit_pull(request_id, peer, source, destination)
            except rg.RingClosed:
                self._drop_submit_ring()
                return None
            except (rg.RingFull, rg.RingTooLarge):
                return None
            deadline = time.monotonic() + self.timeout
            while True:
                left = deadline - time.monotonic()
                try:
                    c = r.wait(max(left, 0.0)) if left > 0 else None
                except rg.RingClosed as e:
                    self._drop_submit_ring()
                    raise SidecarUnavailable(
                        f"the ring closed before the sidecar answered {request_id!r} ({e}); "
                        "the transfer may have started: see status() or its notification"
                    ) from None
                if c is None:
                    raise Timeout(f"the sidecar did not answer {request_id!r} within {self.timeout} s")
                if c.user_data == user_data:
                    break
                # An answer to an earlier call that gave up waiting.
        if c.kind == "ACCEPTED":
            # ACCEPTED's sequence word carries the gRPC reply's segment count.
            return Transfer(c.transfer_id, request_id, c.bytes, c.sequence)
        # The gRPC status the same refusal gets from the gRPC call.
        status = {"blocks_released": "FAILED_PRECONDITION", "bad_descriptor": "INVALID_ARGUMENT"}.get(
            c.code, c.code.upper()
        )
        if status == "UNAVAILABLE":
            raise PeerUnavailable(c.message)
        raise from_status(status, c.message or c.code)

    def _drop_submit_ring(self) -> None:
        r, self._submit_ring = self._submit_ring, None
        if r is not None:
            r.close()

    def wait(self, transfer: Transfer | int, timeout: float | None = None) -> TransferStatus:
        """Waits until the transfer ends; raises :class:`TransferFailed` if it failed
        and :class:`Timeout` if it is still running after ``timeout`` seconds."""
        tid = transfer.transfer_id if isinstance(transfer, Transfer) else transfer
        ms = 0 if timeout is None else max(1, int(timeout * 1000))
        # Waiting forever has no deadline of its own: a dead sidecar breaks the
        # connection, which ends the call.
        deadline = None if timeout is None else timeout + self.timeout
        s = _status(self._call(self._stub.Wait, pb.WaitRequest(transfer_id=tid, timeout_ms=ms), deadline))
        if not s.finished:
            raise Timeout(f"transfer {s.request_id!r} still {s.state} after {timeout} s")
        return s.raise_if_failed()

    def status(self, transfer: Transfer | int) -> TransferStatus:
        tid = transfer.transfer_id if isinstance(transfer, Transfer) else transfer
        return _status(self._call(self._stub.GetTransfer, pb.GetTransferRequest(transfer_id=tid)))

    def cancel(self, transfer: Transfer | int) -> TransferStatus:
        """Cancels a transfer this worker started; returns its status after."""
        tid = transfer.transfer_id if isinstance(transfer, Transfer) else transfer
        return _status(self._call(self._stub.Cancel, pb.CancelRequest(transfer_id=tid)))

    def notifications(
        self,
        worker_id: str | None = None,
        *,
        after_sequence: int = 0,
        incarnation: int = 0,
        take_over: bool = False,
        on_end: Callable[[KvrailError], None] | None = None,
    ) -> Notifications:
        """Subscribes to this worker's notifications. Each carries ``sequence``
        (numbered per worker) and ``incarnation`` (the sidecar process): to
        resume after a dropped stream, pass the last ones seen as
        ``after_sequence`` and ``incarnation`` and get exactly what was missed
        (everything retained, if the sidecar restarted in between). Without
        them, what no stream was handed yet comes first. A second live
        subscription of the same worker raises AlreadyExists unless
        ``take_over`` (the first stream then ends ABORTED). A stream left
        unread until the sidecar holds 128 MiB of notifications for it ends
        RESOURCE_EXHAUSTED; resume it the same way. ``on_end`` is called (from
        the stream's thread) with the error that ended the stream, if one did:
        a way to learn at once that the sidecar went away."""
        try:
            call = self._stub.Subscribe(
                pb.SubscribeRequest(
                    worker_id=worker_id or self.worker_id,
                    after_sequence=after_sequence,
                    incarnation=incarnation,
                    take_over=take_over,
                )
            )
        except ValueError as e:  # the channel was closed
            raise SidecarUnavailable(f"client of {self.socket} closed: {e}") from None
        return Notifications(call, self.socket, on_end)

    def send_message(self, peer: str, to_worker: str, topic: str, payload: bytes = b"") -> None:
        """Sends a small message (topic <= 256 bytes, payload <= 16 KiB) to a
        worker on ``peer``; it arrives there as a ``MESSAGE`` notification if
        that worker has subscribed to its sidecar (dropped otherwise). Returns
        once the message is queued to the peer; raises if the peer is unknown
        or unreachable."""
        self._call(
            self._stub.SendMessage,
            pb.SendMessageRequest(
                worker_id=self.worker_id, peer=peer, to_worker=to_worker, topic=topic, payload=payload
            ),
        )

    def peers(self) -> pb.ListPeersResponse:
        """This node's name and its peers (rails, transport, per-rail counters)."""
        return self._call(self._stub.ListPeers, pb.ListPeersRequest())

    def remove_on_exit(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        """Asks the sidecar to remove these files (this process's own) once
        this process has exited, however it exits: memory adopted into a file
        (:func:`kvrail.memory.adopt_host_memory`) would otherwise stay in
        /dev/shm after a SIGKILL."""
        self._call(self._stub.RemoveOnExit, pb.RemoveOnExitRequest(paths=[str(p) for p in paths]))

    def incarnation(self, timeout: float = 2.0) -> int:
        """The sidecar process answering now (random per start): a change
        means it restarted and knows none of this worker's regions."""
        return int(self._call(self._stub.ListPeers, pb.ListPeersRequest(), timeout).incarnation)

    def close(self) -> None:
        with self._submit_lock:
            self._drop_submit_ring()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
