"""Exceptions: each carries the sidecar's gRPC status and its reason."""

from __future__ import annotations


class KvrailError(Exception):
    """A call to the sidecar failed. ``status`` is the gRPC status name
    (``"NOT_FOUND"``, ``"INVALID_ARGUMENT"``...), ``reason`` the sidecar's message."""

    status: str = "UNKNOWN"

    def __init__(self, reason: str, status: str | None = None) -> None:
        super().__init__(f"{status or self.status}: {reason}")
        self.reason = reason
        if status is not None:
            self.status = status


class SidecarUnavailable(KvrailError):
    """No sidecar answers on the socket, or it went away mid-call."""

    status = "UNAVAILABLE"


class PeerUnavailable(KvrailError):
    """The sidecar is up but cannot reach the peer (no rail connects)."""

    status = "UNAVAILABLE"


class InvalidArgument(KvrailError):
    """The sidecar refused the request: out-of-range blocks or layers, bad layout..."""

    status = "INVALID_ARGUMENT"


class NotFound(KvrailError):
    """Unknown region or peer."""

    status = "NOT_FOUND"


class AlreadyExists(KvrailError):
    """A transfer with this request id is already in flight for this worker."""

    status = "ALREADY_EXISTS"


class FailedPrecondition(KvrailError):
    """E.g. unregistering a region that transfers still use."""

    status = "FAILED_PRECONDITION"


class Timeout(KvrailError):
    """Nothing arrived within the caller's timeout."""

    status = "DEADLINE_EXCEEDED"


class LayoutError(KvrailError, ValueError):
    """A tensor or layout kvrail cannot describe (checked before calling the sidecar)."""

    status = "INVALID_ARGUMENT"


class LayersNotEvenlySpaced(LayoutError):
    """Per-layer tensors that are not one evenly spaced allocation (vLLM allocates
    each layer on its own): they need one region per layer."""


class TransferFailed(KvrailError):
    """A transfer ended in failure. ``side`` says who failed (``LOCAL``, ``PEER``,
    ``RAIL``, ``TIMEOUT``, ``CANCELLED``), ``code`` is the sidecar's stable reason
    (``out_of_range``, ``connection_lost``...)."""

    status = "FAILED"

    def __init__(
        self, request_id: str, transfer_id: int, side: str, code: str, message: str
    ) -> None:
        super().__init__(f"transfer {request_id!r} ({transfer_id}) failed: {side} {code}: {message}")
        self.request_id = request_id
        self.transfer_id = transfer_id
        self.side = side
        self.code = code
        self.message = message


_BY_STATUS: dict[str, type[KvrailError]] = {
    c.status: c
    for c in (SidecarUnavailable, InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, Timeout)
}


def from_status(status: str, reason: str) -> KvrailError:
    """The exception for a gRPC status name."""
    cls = _BY_STATUS.get(status, KvrailError)
    return cls(reason, status=status)
