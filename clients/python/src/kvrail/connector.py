"""A KV connector with the shape of vLLM's ``KVConnectorBase_V1``, moving KV
blocks through the local kvrail sidecar.

Two modes (``kv_connector_extra_config["mode"]``):

* ``pull`` (default, as vLLM's NixlConnector): the prefill engine finishes the
  request, keeps its blocks and returns ``kv_transfer_params`` naming them; the
  decode engine reads them in ``start_load_kv`` and the prefill side frees them
  when the sidecar reports them served (or after ``send_timeout_s``).
* ``push``: the decode engine allocates blocks first and grants them to the
  prefill engine; the prefill engine writes each layer from ``save_kv_layer``
  as soon as it is computed, so the transfer overlaps the rest of the forward
  pass. With real vLLM servers the router sends the request to both engines
  at once with one ``push_ticket`` (``python -m kvrail.vllm_router --mode
  push``): the decode's scheduler sends its grant (regions, block ids) to the
  prefill's scheduler as a kvrail worker message (``SendMessage``), and the
  prefill's scheduler holds the request (``get_num_new_matched_tokens``
  returns ``None``) until the grant is there. In-process drivers can instead
  hand :meth:`KvrailConnector.push_target` over themselves.

vLLM is imported only when installed; otherwise the same call sequence is driven
by :mod:`kvrail.engine_sim` (tests and examples).
"""

from __future__ import annotations

import atexit
import enum
import functools
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, TypeVar

from .client import (
    FAILED,
    MESSAGE,
    PULL_DONE,
    PULL_SERVED,
    PUSH_DONE,
    PUSH_RECEIVED,
    Blocks,
    Client,
    Notification,
    Notifications,
)
from .errors import KvrailError, SidecarUnavailable
from .geometry import HeadSlice, KvGeometry, chunk_tokens, head_sources, rank_heads
from .layout import TensorView
from .memory import AdoptedMemory, adopt_tensor, describe, shm_dir, sweep_adopted_files

log = logging.getLogger("kvrail.connector")
T = TypeVar("T")


def _configure_log() -> None:
    """``KVRAIL_CONNECTOR_LOG=debug`` (or info, warning) prints the connector's
    own steps (grants, pushes, loads) to stderr, which vLLM's logging
    configuration leaves alone."""
    level = os.environ.get("KVRAIL_CONNECTOR_LOG", "").strip().upper()
    if not level or log.handlers:
        return
    if not isinstance(logging.getLevelName(level), int):
        log.warning("kvrail: KVRAIL_CONNECTOR_LOG=%r is not a log level (debug, info, warning, error)", level.lower())
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s kvrail[%(process)d] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


_configure_log()

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _ConnectorBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _MetadataBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class _MetadataBase:  # type: ignore[no-redef]
        pass

    class _ConnectorBase:  # type: ignore[no-redef]
        """The parts of vLLM's base class this connector relies on."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._role = role
            self._connector_metadata: Any = None

        @property
        def role(self) -> KVConnectorRole:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata


# Region table entries: (region id, first layer, layer count).
RegionTable = list[tuple[int, int, int]]


@dataclass
class RemoteBlocks:
    """A request's local blocks and their counterparts on a remote node: where
    the decode side loads from, or where the prefill side (push mode) saves to."""

    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_node: str
    remote_regions: RegionTable
    remote_request_id: str
    #: The remote blocks' generations per region id (as text), in the order
    #: of ``remote_block_ids``: a transfer naming them fails once that side
    #: released the blocks (freed, to be reused), instead of moving another
    #: request's KV.
    remote_generations: dict[str, list[int]] = field(default_factory=dict)
    #: Why this load cannot happen (the scheduler could not grant the
    #: blocks): the worker fails it at once. Empty: it can.
    failure: str = ""
    #: Every tensor-parallel rank of the remote engine: {"worker", "regions",
    #: "geometry"} (empty from an engine that does not publish them: rank 0's
    #: regions are ``remote_regions``).
    remote_ranks: list[dict[str, Any]] = field(default_factory=list)
    #: Engines with other block sizes move tokens, not blocks: the tokens
    #: moved (0: whole blocks, as listed), and where the stream starts in
    #: each side's first listed block.
    tokens: int = 0
    local_first_token: int = 0
    remote_first_token: int = 0
    #: Push mode: the decode request's receiver group (its grant names it).
    load_group: str = ""

    @classmethod
    def from_params(
        cls, local: list[int], remote: list[int], params: dict[str, Any]
    ) -> "RemoteBlocks":
        """From ``kv_transfer_params`` (or their ``push_to``), which name the
        remote node, its region table and its request id."""
        return cls(
            local,
            remote,
            params["remote_node"],
            [tuple(r) for r in params["remote_regions"]],  # type: ignore[misc]
            params["remote_request_id"],
            _generations_map(params.get("remote_generations")),
            failure=str(params.get("remote_failure") or ""),
            remote_ranks=list(params.get("remote_ranks") or []),
        )

    def window(self, start: int, count: int, local: list[int]) -> "RemoteBlocks":
        """Only the remote blocks ``[start, start + count)`` (with their
        generations), loaded into ``local``."""
        gens = {r: list(g[start : start + count]) for r, g in self.remote_generations.items()}
        return replace(
            self, local_block_ids=local, remote_block_ids=self.remote_block_ids[start : start + count], remote_generations=gens
        )

    def generations_problem(self) -> str:
        """Why the generations do not fit the block ids ("" when they do)."""
        n = len(self.remote_block_ids)
        for region, gens in self.remote_generations.items():
            # A map of lists (``_generations_map``): the ids and lengths are checked here.
            if not str(region).isdigit() or len(gens) != n:
                return f"remote_generations of region {region!r} do not give one generation per block ({n} blocks)"
            if not all(_uint(g, 64) for g in gens):
                return f"remote_generations of region {region!r} are not unsigned 64-bit integers"
        return ""


@dataclass
class KvrailConnectorMetadata(_MetadataBase):  # type: ignore[misc]
    """What the scheduler-side connector tells the workers for one step."""

    load: dict[str, RemoteBlocks] = field(default_factory=dict)
    save: dict[str, RemoteBlocks] = field(default_factory=dict)
    # Pull mode prefill: requests whose blocks wait to be read, and their block ids.
    send: dict[str, list[int]] = field(default_factory=dict)
    # Requests aborted while their KV was still arriving.
    cancel: set[str] = field(default_factory=set)


def _extra(vllm_config: Any) -> dict[str, Any]:
    cfg = vllm_config.kv_transfer_config
    return dict(getattr(cfg, "kv_connector_extra_config", None) or {})


def _status_name(request: Any) -> str:
    s = getattr(request, "status", None)
    return getattr(s, "name", str(s))


class _CallStats:
    """Time spent inside the connector's per-step worker calls (the engine's
    loop waits for them), written as JSON to ``stats_path`` at most once a
    second: calls, total, p50/p99/max in microseconds per method."""

    MAX_SAMPLES = 20_000

    def __init__(self, path: Path) -> None:
        self.path = path
        self.samples: dict[str, list[int]] = {}
        self.totals: dict[str, tuple[int, int]] = {}
        self.last_dump = 0.0

    def record(self, name: str, ns: int) -> None:
        calls, total = self.totals.get(name, (0, 0))
        self.totals[name] = (calls + 1, total + ns)
        samples = self.samples.setdefault(name, [])
        if len(samples) < self.MAX_SAMPLES:
            samples.append(ns)

    def maybe_dump(self) -> None:
        now = time.monotonic()
        if now - self.last_dump < 1.0:
            return
        self.last_dump = now
        out = {}
        for name, (calls, total) in self.totals.items():
            xs = sorted(self.samples[name])
            pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3  # noqa: E731
            out[name] = {
                "calls": calls,
                "total_us": total / 1e3,
                "mean_us": total / calls / 1e3,
                "p50_us": pick(0.5),
                "p99_us": pick(0.99),
                "max_us": xs[-1] / 1e3,
            }
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"pid": os.getpid(), "calls": out}, indent=1))
            tmp.replace(self.path)
        except OSError as e:  # statistics never stop the engine
            log.warning("kvrail: writing %s: %s", self.path, e)


def _timed(fn: Any) -> Any:
    """Records a worker call's duration when ``stats_path`` is configured."""

    @functools.wraps(fn)
    def wrapper(self: "KvrailConnector", *args: Any, **kwargs: Any) -> Any:
        stats = self._stats
        if stats is None:
            return fn(self, *args, **kwargs)
        start = time.perf_counter_ns()
        try:
            return fn(self, *args, **kwargs)
        finally:
            stats.record(fn.__name__, time.perf_counter_ns() - start)
            if fn.__name__ == "get_finished":
                stats.maybe_dump()

    return wrapper


#: Topic prefix of a decode engine's grant; the push ticket follows.
GRANT_TOPIC = "kvrail-grant/"
#: Grants kept for requests that have not arrived yet (oldest dropped first).
MAX_PENDING_GRANTS = 4096


def scheduler_id(worker_id: str) -> str:
    """The id a push-mode scheduler receives grants under."""
    return f"{worker_id}.scheduler"


def _count(x: Any) -> int:
    """A token count another engine sent, checked (ValueError if it is none)."""
    if not _uint(x, 32):
        raise ValueError(f"a token count must be a 32-bit unsigned integer, not {x!r}")
    return int(x)


def _uint(x: Any, bits: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << bits)


def _generations_map(value: Any) -> dict[str, list[int]]:
    """``remote_generations`` as sent: a map of region id (text) to a list of
    generations; ValueError for anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(g, list) for g in value.values()):
        raise ValueError("remote_generations must map region ids to lists of generations")
    return {str(r): list(g) for r, g in value.items()}


def _parse_grant(payload: bytes, peer: str, num_layers: int) -> dict[str, Any] | None:
    """A grant's target, checked for shape and ranges (it comes from another
    node): from ``peer`` itself, block ids that fit the wire, a region table
    covering every layer. None for anything else."""
    try:
        g = json.loads(payload)
        if not isinstance(g, dict) or g.get("remote_node") != peer:
            return None
        regions = g.get("remote_regions")
        gens = g.get("remote_generations", {})
        ok = (
            isinstance(g.get("remote_request_id"), str)
            and _uint(g.get("skip_blocks", 0), 32)
            and _uint(g.get("tokens", 0), 32)
            and _uint(g.get("first_token", 0), 32)
            and isinstance(g.get("load_group", ""), str)
            and len(g.get("load_group", "")) <= 256
            and isinstance(g.get("remote_block_ids"), list)
            and all(_uint(b, 32) for b in g["remote_block_ids"])
            and isinstance(regions, list)
            and all(isinstance(r, list) and len(r) == 3 and all(_uint(x, 64) for x in r) for r in regions)
            and isinstance(gens, dict)
            and all(isinstance(v, list) and all(_uint(x, 64) for x in v) for v in gens.values())
        )
        if ok:
            for layer in range(num_layers):
                _layer_region([tuple(r) for r in regions], layer)  # type: ignore[misc]
            for table, _ in _ranks_of(g.get("remote_ranks", [])):
                for layer in range(num_layers):
                    _layer_region(table, layer)
    except Exception:  # noqa: BLE001 - whatever a peer sends, the engine goes on
        return None
    return g if ok else None


def _blocks_to_load(blocks: Any) -> tuple[list[int], int]:
    """(the blocks a load fills, how many leading blocks the local prefix cache
    already holds). vLLM's ``KVCacheBlocks`` tells cached blocks by their hash;
    an object without per-block detail hands over only the blocks to fill."""
    groups = getattr(blocks, "blocks", None)
    if groups:
        group = [b for b in groups[0] if not getattr(b, "is_null", False)]
        cached = sum(1 for b in group if b.block_hash is not None)
        return [b.block_id for b in group if b.block_hash is None], cached
    return list(blocks.get_block_ids()[0]), 0


def _distinct_host_storages(tensors: list[Any]) -> list[Any]:
    """One tensor per host allocation among the KV-cache tensors (vLLM's CPU
    backend slices every layer out of one buffer)."""
    seen: dict[int, Any] = {}
    for t in tensors:
        if getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
            continue
        key = int(t.untyped_storage().data_ptr()) if hasattr(t, "untyped_storage") else id(t)
        seen.setdefault(key, t)
    return list(seen.values())


def _vllm_kv_layout(t: Any) -> str | None:
    """vLLM 0.32's per-layer KV caches are 4-D, ``[blocks, heads, tokens,
    K and V]`` in some stride order, K and V inside each block: whole blocks
    move (one plane). Older 5-D caches (``[2, blocks, ...]`` or ``[blocks, 2,
    ...]``) are told apart by their K/V dimension."""
    return "mla" if len(getattr(t, "shape", ())) == 4 else None


def _layer_region(table: RegionTable, layer: int) -> tuple[int, int]:
    """(region id, layer index inside it) of a layer."""
    for rid, start, count in table:
        if start <= layer < start + count:
            return rid, layer - start
    raise KvrailError(f"layer {layer} is in no region of {table}")


def _overlaps(a: RegionTable, b: RegionTable) -> list[tuple[int, int, int, int, int]]:
    """(region a, first layer in a, region b, first layer in b, layer count) for
    every run of layers both tables cover, so one transfer moves each run."""
    out = []
    for ra, sa, ca in a:
        for rb, sb, cb in b:
            lo, hi = max(sa, sb), min(sa + ca, sb + cb)
            if lo < hi:
                out.append((ra, lo - sa, rb, lo - sb, hi - lo))
    return out


def _tensor_parallel(vllm_config: Any) -> tuple[int, int]:
    """(this process's tensor-parallel rank, the TP size). The scheduler's
    process has no rank (0)."""
    size = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    if size <= 1:
        return 0, 1
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), size
    except Exception:  # noqa: BLE001 - not a worker process (no TP group)
        return 0, size


def _rank_path(path: Path, rank: int, size: int) -> Path:
    """Rank ``rank``'s file of a per-engine path (the path itself at TP 1)."""
    return path if size <= 1 else path.with_name(f"{path.stem}.tp{rank}{path.suffix}")


def _kv_geometry(vllm_config: Any, tensor: Any, rank: int, size: int, model: str | None) -> KvGeometry | None:
    """What this rank's blocks hold, from the per-layer cache and the model
    config: vLLM 0.32's 4-D ``[blocks, heads, tokens, K and V]`` (in its
    stride order; the CPU backend's blocks are head-opaque), or the 5-D
    ``[2, blocks, tokens, heads, head_size]`` (FlashAttention) and
    ``[blocks, 2, tokens, heads, head_size]`` (FlashInfer) caches, NHD or, by
    their stride order, HND. None for other shapes (MLA)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or not hasattr(tensor, "shape"):
        return None
    view = TensorView.of(tensor)
    shape, strides = view.shape, view.strides
    if len(shape) == 4:
        heads_dim, tokens_dim, head_size = 1, 2, shape[3]
    elif len(shape) == 5 and 2 in (shape[0], shape[1]):
        heads_dim, tokens_dim, head_size = 3, 2, shape[4]
    else:
        return None
    # vLLM's own caches on the CPU are its CPU backend's, packed per ISA.
    interior = "head_opaque" if view.device == "cpu" and _is_torch(tensor) else None
    total = int(mc.get_total_num_kv_heads())
    heads = rank_heads(total, size, rank)
    if len(heads) != shape[heads_dim]:
        log.warning("kvrail: %d KV heads in the cache, %d expected for rank %d of %d", shape[heads_dim], len(heads), rank, size)
        return None
    if interior is None:
        interior = "hnd" if strides[heads_dim] > strides[tokens_dim] else "nhd"
    dtype = getattr(tensor, "dtype", "")
    return KvGeometry(
        model=model or str(getattr(mc, "model", "")),
        dtype=str(dtype).removeprefix("torch."),
        element_bytes=view.itemsize,
        head_size=head_size,
        model_kv_heads=total,
        head_start=heads.start,
        heads=len(heads),
        tokens_per_block=shape[tokens_dim],
        interior=interior,  # type: ignore[arg-type]
    )


def _is_torch(tensor: Any) -> bool:
    """A torch tensor (vLLM's own caches), not a numpy array."""
    return hasattr(tensor, "data_ptr") and hasattr(tensor, "element_size")


def _ranks_of(ranks: Any) -> list[tuple[RegionTable, KvGeometry | None]]:
    """The other engine's ranks as ``kv_transfer_params`` or a grant name them
    ({"regions", "geometry"} each), checked: another node wrote them."""
    if not isinstance(ranks, list) or len(ranks) > 1024:
        raise KvrailError("remote_ranks must be a list of at most 1024 ranks")
    out = []
    try:
        for r in ranks:
            regions = [tuple(int(x) for x in region) for region in r["regions"]]
            if any(len(region) != 3 or any(x < 0 or x >= 1 << 64 for x in region) for region in regions):
                raise ValueError("a region is not (id, first layer, layer count)")
            g = r.get("geometry")
            out.append((regions, KvGeometry.from_json(g) if g else None))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise KvrailError(f"malformed remote_ranks: {e!r}") from None
    return out  # type: ignore[return-value]


def _geometry_mismatch(mine: KvGeometry, theirs: KvGeometry) -> str:
    """Why this rank cannot take heads from ``theirs`` (empty: it can): the
    sidecars refuse these too, before any byte moves; said here first with
    the engine's words."""
    for name in ("model", "dtype", "element_bytes", "head_size", "model_kv_heads"):
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            return f"{name} is {a} here and {b} on the prefill engine"
    if "head_opaque" in (mine.interior, theirs.interior):
        if mine.interior != theirs.interior:
            return f"the block interior is {mine.interior} here and {theirs.interior} on the prefill engine"
        if mine.tokens_per_block != theirs.tokens_per_block:
            return (
                f"tokens per block is {mine.tokens_per_block} here and {theirs.tokens_per_block} on the "
                "prefill engine (head-opaque blocks cannot be re-cut by token)"
            )
    return ""


#: Push mode: where a decode request's pushes come from more than one
#: prefill rank, or are cut into tokens, they form its receiver group
#: ``<request>/load.<nonce>`` (one notification once every member arrived;
#: the nonce keeps a retried request's group apart from a stale one).
LOAD_GROUP = "/load."


def _pushed_request(name: str) -> str:
    """The decode request a pushed transfer (``<request>/L<layer>...``) or its
    receiver group (``<request>/load.<nonce>``) is for."""
    if LOAD_GROUP in name:
        return name.rsplit(LOAD_GROUP, 1)[0]
    return name.rsplit("/L", 1)[0]


def _is_load_group(name: str) -> bool:
    return LOAD_GROUP in name


def _block_tokens(ranks: Any) -> int | None:
    """Tokens per block of an engine, from its ranks' published geometry
    (None where it publishes none)."""
    try:
        g = ranks[0]["geometry"] if ranks else None
        n = g["tokens_per_block"] if g else None
        interior = g["interior"] if g else None
    except (KeyError, TypeError, IndexError):
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n < 1 << 32 or interior == "head_opaque":
        return None  # head-opaque blocks move whole: no token window
    return n


def _token_window(first: int, tokens: int, block_tokens: int, blocks: int) -> tuple[int, int, int]:
    """Of an engine's request blocks (``blocks`` of ``block_tokens``), the ones
    holding tokens ``[first, first + tokens)``: (first block, block count,
    token offset in the first); the tokens are cut to what the blocks hold."""
    start, offset = divmod(first, block_tokens)
    count = min(blocks - start, (offset + tokens + block_tokens - 1) // block_tokens)
    return start, max(0, count), offset


try:  # pragma: no cover - vLLM 0.32 and newer
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as _TransferResults,
    )
except ImportError:

    @dataclass
    class _TransferResults:  # type: ignore[no-redef]
        """vLLM's ``KVConnectorTransferResults``, where vLLM lacks it."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)


#: Seconds between attempts to reach a sidecar that went away (the engine
#: goes on serving meanwhile; a try costs a refused connect).
RECONNECT_INTERVAL_S = 0.5
#: How long one reconnect attempt waits for the new sidecar to answer: short,
#: because it runs inside the engine's step.
RECONNECT_TIMEOUT_S = 0.5


class _SidecarLink:
    """The connector's client of its node's sidecar, across restarts of that
    sidecar (upgrades, crashes). A call (or a notification stream) that finds
    the sidecar gone hands the error to :meth:`lost`; a background thread then
    tries every :data:`RECONNECT_INTERVAL_S` to reach the new sidecar and runs
    ``on_connect`` with the new client there (the worker registers its KV
    caches again and republishes its region table), so an idle engine is
    ready again without waiting for a request. The engine's thread takes the
    new client at its next :meth:`get`; until then :meth:`get` returns None
    and the connector fails what needs the sidecar instead of raising into
    the engine."""

    def __init__(self, socket: Path, worker_id: str, client: Client, incarnation: int) -> None:
        self.socket = socket
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._client: Client | None = client
        #: The sidecar process the client in use talks to.
        self.incarnation = incarnation
        self._ready_incarnation = 0
        self._ready: Client | None = None
        self._reconnecting = False
        self._closed = False
        # One connection attempt at a time (the reconnecting thread, or
        # connect_now from the engine's thread): `on_connect` runs once per
        # new client.
        self._attempt = threading.Lock()
        #: Connections taken into use so far (1: the first).
        self.generation = 1
        #: Runs in the reconnecting thread with a new client, before it is
        #: taken into use; a KvrailError from it means "try again".
        self.on_connect: Callable[[Client], None] | None = None

    @property
    def client(self) -> Client | None:
        """The client in use, without taking a new one."""
        return self._client

    def get(self) -> Client | None:
        """The client in use, taking a reconnected one if it is ready."""
        with self._lock:
            if self._client is None and self._ready is not None:
                self._client, self._ready = self._ready, None
                self.incarnation = self._ready_incarnation
                self.generation += 1
                log.warning("kvrail: reconnected to the sidecar at %s", self.socket)
            return self._client

    def lost(self, error: BaseException) -> None:
        """The sidecar went away (``error`` says how): drops the client and
        starts reconnecting (safe from any thread, and more than once)."""
        with self._lock:
            if self._closed:
                return
            old, self._client = self._client, None
            if old is not None:
                log.error("kvrail: lost the sidecar at %s (%s); reconnecting in the background", self.socket, error)
            start = not self._reconnecting and self._ready is None
            self._reconnecting = self._reconnecting or start
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - closing a dead channel
                pass
        if start:
            threading.Thread(target=self._reconnect, name="kvrail-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        try:
            while not self._closed:
                time.sleep(RECONNECT_INTERVAL_S)
                with self._attempt:
                    if self._closed or self._client is not None:
                        return  # closed, or connect_now got there first
                    attempt = self._connect()
                if attempt is None:
                    continue
                client, incarnation = attempt
                with self._lock:
                    superseded = self._closed or self._client is not None
                    if not superseded:
                        self._ready, self._ready_incarnation = client, incarnation
                if superseded:
                    client.close()
                return
        finally:
            # However the thread ends (an error nobody expected included), a
            # later loss starts another.
            with self._lock:
                self._reconnecting = False

    def _connect(self) -> tuple[Client, int] | None:
        """One attempt: a new client, set up (`on_connect`), and the
        incarnation of the sidecar it reached; None if it failed (logged)."""
        try:
            client = Client(self.socket, self.worker_id, connect_timeout=RECONNECT_TIMEOUT_S)
        except KvrailError as e:
            log.debug("kvrail: sidecar at %s still away: %s", self.socket, e)
            return None
        try:
            incarnation = client.incarnation()
            if self.on_connect is not None:
                self.on_connect(client)
        except Exception as e:  # noqa: BLE001 - a full /dev/shm, a sidecar that went again...
            log.warning("kvrail: sidecar at %s is back but setting up failed: %s", self.socket, e)
            client.close()
            return None
        return client, incarnation

    def connect_now(self) -> Client | None:
        """One attempt, now, to reach a sidecar that went away (``on_connect``
        runs in the caller's thread)."""
        with self._attempt:
            existing = self.get()
            if existing is not None:
                return existing
            attempt = self._connect()
        if attempt is None:
            return None
        client, incarnation = attempt
        with self._lock:
            if self._client is None and not self._closed:
                self._client, self.incarnation = client, incarnation
                self.generation += 1
                return client
        client.close()
        return self.get()

    def same_sidecar(self) -> bool:
        """Whether the sidecar that answers now is the one the client in use
        connected to (gRPC reconnects a channel to a restarted sidecar on its
        own, which knows none of the regions registered before)."""
        client = self._client
        if client is None:
            return False
        try:
            return client.incarnation() == self.incarnation
        except KvrailError:
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients = [c for c in (self._client, self._ready) if c is not None]
            self._client = self._ready = None
        for c in clients:
            c.close()


def _sidecar_gone(e: BaseException) -> bool:
    """Whether an error means the sidecar itself is gone (not a refusal)."""
    return isinstance(e, SidecarUnavailable)


class KvrailConnector(_ConnectorBase):  # type: ignore[misc]
    """vLLM KV connector over kvrail. Configure with ``kv_connector_extra_config``:

    ``socket`` (the sidecar's Unix socket, required), ``mode`` (``pull`` or
    ``push``), ``worker_id`` (default ``vllm-<engine_id>``), ``region_table``
    (file where the worker publishes its regions for the scheduler; default
    under ``/dev/shm``), ``timeout_s`` (default 120: a prefill frees blocks
    nobody read after this; a decode gives up on pushed layers that did not
    arrive and reports their blocks as load errors), ``kv_layout`` (``flash_attn``, ``flash_infer``, ``mla``;
    default: from the tensors' shapes), ``stats_path`` (optional: the worker
    writes the time spent in its per-step calls to ``<stats_path>.worker``).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = _extra(vllm_config)
        cfg = vllm_config.kv_transfer_config
        if "socket" not in extra:
            raise KvrailError("kv_connector_extra_config needs 'socket': the kvrail sidecar's Unix socket")
        self.socket = Path(extra["socket"])
        self.mode: str = extra.get("mode", "pull")
        if self.mode not in ("pull", "push"):
            raise KvrailError(f"mode must be 'pull' or 'push', not {self.mode!r}")
        engine = str(getattr(cfg, "engine_id", None) or "0")
        self.engine_worker_id: str = extra.get("worker_id", f"vllm-{engine}")
        self.tp_rank, self.tp_size = _tensor_parallel(vllm_config)
        self._vllm_config = vllm_config
        #: Model identity compared with the other engine's (default: the
        #: model as vLLM was given it).
        self.model_id: str | None = extra.get("model_id")
        # Each TP rank is a worker of its own; the scheduler speaks for the engine.
        self.worker_id: str = (
            f"{self.engine_worker_id}-tp{self.tp_rank}"
            if role == KVConnectorRole.WORKER and self.tp_size > 1
            else self.engine_worker_id
        )
        self.engine_table_path = Path(
            extra.get("region_table", shm_dir() / f"kvrail-{self.engine_worker_id}-regions.json")
        )
        self.region_table_path = _rank_path(self.engine_table_path, self.tp_rank, self.tp_size)
        self.timeout_s = float(extra.get("timeout_s", 120.0))
        self.kv_layout = extra.get("kv_layout")
        stats_path = extra.get("stats_path")
        self._stats = (
            _CallStats(Path(f"{stats_path}.{role.name.lower()}"))
            if stats_path and role == KVConnectorRole.WORKER
            else None
        )
        client = Client(self.socket, self.worker_id)
        hello = client.peers()
        self.node: str = hello.node_name
        self._link = _SidecarLink(self.socket, self.worker_id, client, hello.incarnation)
        #: This engine's record in etcd (scheduler side, with ``etcd`` given).
        self._registration: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._registration = self._register_engine(extra, getattr(cfg, "kv_role", None))
            self._sched = _SchedulerState()
            # Grants from decode engines arrive as messages to this id.
            self._sched.wants_grants = self.mode == "push" and getattr(cfg, "kv_role", None) != "kv_consumer"
            self._sched.messages = self._grant_stream(client)
            # A restarted sidecar is subscribed to at once (by the
            # reconnecting thread), before decode engines send it grants.
            self._link.on_connect = self._scheduler_reconnected
        else:
            self._work = _WorkerState(client.notifications(on_end=self._stream_ended), self.timeout_s)
            self._link.on_connect = self._reconnected
            # Whatever happens to the engine, its shared-memory files go with it.
            atexit.register(self._remove_files)

    def _register_engine(self, extra: dict[str, Any], kv_role: str | None) -> Any:
        """Registers this engine in etcd for routers to find (``etcd``,
        ``engine_url``, optionally ``etcd_prefix``, ``etcd_lease_ttl_s`` and
        for https ``etcd_ca``, ``etcd_cert``, ``etcd_key`` in the extra
        config); None without ``etcd``."""
        endpoints = extra.get("etcd")
        if not endpoints:
            return None
        from kvrail.engines import EngineRecord, EngineRegistration
        from kvrail.etcd import Etcd, EtcdError

        url = extra.get("engine_url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise KvrailError("kv_connector_extra_config 'etcd' needs 'engine_url': this engine's API URL, http://HOST:PORT")
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv_role or "", "both")
        record = EngineRecord(
            engine=self.engine_worker_id,
            role=role,
            url=url.rstrip("/"),
            kvrail_node=self.node,
            worker=self.engine_worker_id,
            mode=self.mode,
            model=self.model_id or str(getattr(getattr(self._vllm_config, "model_config", None), "model", "") or ""),
        )
        try:
            etcd = Etcd(
                endpoints if isinstance(endpoints, (str, list)) else str(endpoints),
                ca=extra.get("etcd_ca"),
                cert=extra.get("etcd_cert"),
                key=extra.get("etcd_key"),
            )
        except EtcdError as e:
            raise KvrailError(f"kv_connector_extra_config 'etcd': {e}") from None
        registration = EngineRegistration(
            etcd, extra.get("etcd_prefix", "/kvrail/default"), record, int(extra.get("etcd_lease_ttl_s", 10))
        )
        atexit.register(registration.close)
        return registration

    def _stream_ended(self, error: KvrailError) -> None:
        """A notification stream ended (called from its thread): if the
        sidecar is gone, reconnecting starts now, even while the engine idles."""
        if isinstance(error, SidecarUnavailable) and not self._link.same_sidecar():
            self._link.lost(error)

    @property
    def client(self) -> Client:
        """The sidecar's client; :class:`SidecarUnavailable` while it is away."""
        c = self._worker_client() if self.role == KVConnectorRole.WORKER else self._link.get()
        if c is None:
            raise SidecarUnavailable(f"the sidecar at {self.socket} is away (reconnecting)")
        return c

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def _region_table(self) -> dict[str, Any]:
        """What the worker (rank 0's, with tensor parallelism) published when
        it registered its KV caches."""
        try:
            return json.loads(self.region_table_path.read_text())
        except (OSError, ValueError) as e:
            raise KvrailError(
                f"no region table at {self.region_table_path} (has the worker registered its KV caches?): {e}"
            ) from None

    def _regions(self) -> RegionTable:
        """The regions the worker registered, as it published them."""
        return [tuple(r) for r in self._region_table()["regions"]]  # type: ignore[misc]

    def _rank_tables(self) -> list[dict[str, Any]]:
        """Every TP rank's published regions and geometry, rank by rank."""
        out = []
        for rank in range(self.tp_size):
            path = _rank_path(self.engine_table_path, rank, self.tp_size)
            try:
                t = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise KvrailError(f"no region table at {path} (has rank {rank} registered its KV caches?): {e}") from None
            out.append({"worker": t.get("worker_id"), "regions": t["regions"], "geometry": t.get("geometry")})
        return out

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.mode == "push" and params.get("do_remote_decode") and params.get("push_ticket"):
            if not self._await_grant(request.request_id, params):
                return None, False  # asked again next step
            return 0, False
        if params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        rid = request.request_id
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            # Blocks the local prefix cache already holds are neither read nor
            # written again.
            local, cached = _blocks_to_load(blocks)
            # Where the load starts in the prompt (what the local prefix cache
            # holds): engines with other block sizes meet there mid-block.
            first = max(0, len(getattr(request, "prompt_token_ids", None) or ()) - num_external_tokens)
            if self.mode == "push":
                # Decode first: the prefill engine will write into these blocks.
                failure = ""
                try:
                    regions = self._regions()
                    ranks = self._rank_tables()
                    every_region = [r for t in ranks for r, _, _ in t["regions"]]

                    def generations(client: Client) -> dict[str, list[int]]:
                        return {str(r): client.block_generations(r, local) for r in every_region}

                    target: dict[str, Any] | None = {
                        "remote_node": self.node,
                        "remote_regions": regions,
                        "remote_ranks": ranks,
                        "remote_block_ids": local,
                        "remote_request_id": rid,
                        "skip_blocks": cached,
                        # Tokens, for a prefill engine whose blocks are cut
                        # otherwise: it pushes these, from this one.
                        "tokens": num_external_tokens,
                        "first_token": first,
                        "load_group": f"{rid}{LOAD_GROUP}{secrets.token_hex(4)}",
                        # A push naming these generations fails once this side
                        # releases the blocks (abort, timeout): none lands late.
                        "remote_generations": self._scheduler_call(generations),
                    }
                except KvrailError as e:
                    # Nothing will arrive: the worker fails the load at once.
                    failure = f"cannot grant the blocks: {e}"
                    log.error("kvrail: %s: %s", rid, failure)
                    target = None
                ticket = params.get("push_ticket")
                if target is not None and ticket:
                    failure = self._send_grant(rid, str(ticket), params.get("push_grant_to"), target)
                elif target is not None:
                    self._sched.push_targets[rid] = {"do_remote_decode": True, "push_to": target}
                self._sched.loading[rid] = RemoteBlocks(
                    local, local, "", [], rid, failure=failure, tokens=num_external_tokens
                )
            else:
                self._sched.loading[rid] = self._remote_spec(rid, local, cached, params, (first, num_external_tokens))
            self._sched.new_loads[rid] = self._sched.loading[rid]
            params["do_remote_prefill"] = False  # once
        elif self.mode == "push" and params.get("push_to"):
            self._sched.pushing[rid] = params["push_to"]
            self._sched.prefill_blocks[rid] = list(blocks.get_block_ids()[0])
            self._sched.prompt_tokens[rid] = len(request.prompt_token_ids)

    def _own_block_tokens(self) -> int | None:
        """Tokens per block of this engine's KV caches (None when its ranks
        publish no token-cut geometry)."""
        try:
            return _block_tokens(self._rank_tables())
        except KvrailError:
            return None

    def _remote_spec(
        self, rid: str, local: list[int], cached: int, params: dict[str, Any], window: tuple[int, int]
    ) -> RemoteBlocks:
        """Pull mode, decode side: what to load of the prefill's blocks that
        ``params`` (from the router: anyone's input) name; a load that fails
        at once, saying why, when they are malformed. ``window``: (first
        token, tokens): engines with other block sizes load these tokens, not
        blocks one for one."""
        try:
            offered = RemoteBlocks.from_params(local, list(params["remote_block_ids"]), params)
            problem = offered.generations_problem()
            remote = offered.remote_block_ids
            first, tokens = window
            theirs = _block_tokens(params.get("remote_ranks"))
            # The own block size (its rank tables read) matters only beside a
            # token-cut prefill.
            mine = self._own_block_tokens() if theirs else None
            if mine and theirs and mine != theirs and tokens > 0:
                tokens = min(tokens, len(local) * mine)
                start, n, offset = _token_window(first, tokens, theirs, len(remote))
                tokens = min(tokens, n * theirs - offset)
                ours = local[: -(-tokens // mine)] if tokens > 0 else []
                if problem or not ours:
                    why = problem or f"the prefill engine's blocks do not hold tokens {first}..{first + tokens}"
                    return replace(offered, local_block_ids=ours, remote_block_ids=[], remote_generations={}, failure=why)
                return replace(offered.window(start, n, ours), tokens=tokens, remote_first_token=offset)
            start = cached if cached else max(0, len(remote) - len(local))
            n = max(0, min(len(local), len(remote) - start))
            if problem:
                return replace(offered, local_block_ids=local[:n], remote_block_ids=[], remote_generations={}, failure=problem)
            return offered.window(start, n, local[:n])
        except (KeyError, TypeError, ValueError) as e:
            why = f"malformed kv_transfer_params: {type(e).__name__}: {e}"
            log.error("kvrail: %s: %s", rid, why)
            return RemoteBlocks(list(local), [], "", [], rid, failure=why)

    def _send_grant(self, rid: str, ticket: str, to: Any, target: dict[str, Any]) -> str:
        """Decode side: grants this request's blocks to the prefill engine named
        in ``push_grant_to`` ({"node", "worker"}). Returns why the grant could
        not be sent ("" when it was): then nothing will arrive, and the
        request's load fails at once."""
        node, worker = (to.get("node"), to.get("worker")) if isinstance(to, dict) else (None, None)
        if not isinstance(node, str) or not isinstance(worker, str):
            why = f"push_ticket {ticket} without push_grant_to {{node, worker}}"
            log.error("kvrail: %s: nothing will arrive", why)
            return why
        payload = json.dumps(dict(target, ticket=ticket), separators=(",", ":")).encode()
        try:
            self._scheduler_call(lambda c: c.send_message(node, scheduler_id(worker), GRANT_TOPIC + ticket, payload))
        except KvrailError as e:
            log.error("kvrail: grant of %s to %s/%s failed: %s", rid, node, worker, e)
            return f"the grant to {node}/{worker} failed: {e}"
        log.debug("grant of %s (ticket %s, %d bytes) sent to %s/%s", rid, ticket, len(payload), node, worker)
        return ""

    def _scheduler_call(self, fn: Callable[[Client], T]) -> T:
        """``fn(client)``; a sidecar found gone is reached again at once and
        the call made once more (the request it serves would otherwise wait
        out its timeout)."""
        try:
            return fn(self.client)
        except SidecarUnavailable as e:
            self._link.lost(e)
            client = self._link.connect_now()
            if client is None:
                raise
            return fn(client)

    def _await_grant(self, rid: str, params: dict[str, Any]) -> bool:
        """Prefill side: whether the decode's grant for this request's ticket is
        here (then ``params["push_to"]`` holds it). Gives up after
        ``timeout_s``: the request is then prefilled without a push."""
        s = self._sched
        ticket = str(params["push_ticket"])
        now = time.monotonic()
        self._collect_grants(now)
        got = s.grants.pop(ticket, None)
        if got is not None:
            log.debug("grant for %s (ticket %s) claimed after %.3f s", rid, ticket, now - s.waiting_since.get(rid, now))
            params["push_to"] = got[1]
            s.waiting_since.pop(rid, None)
            return True
        if rid not in s.waiting_since:
            log.debug("%s waits for the grant of ticket %s", rid, ticket)
        since = s.waiting_since.setdefault(rid, now)
        if now - since > self.timeout_s:
            log.error("kvrail: no grant for %s (ticket %s) within %.0f s: prefilling without a push", rid, ticket, self.timeout_s)
            s.waiting_since.pop(rid, None)
            return True
        return False

    def _check_lost(self, e: KvrailError) -> None:
        if _sidecar_gone(e):
            self._link.lost(e)

    def _grant_stream(self, client: Client) -> Notifications | None:
        """Push mode, prefill side: a subscription to the grants decode
        engines send this engine's scheduler (None where none is wanted)."""
        if not self._sched.wants_grants:
            return None
        return client.notifications(worker_id=scheduler_id(self.worker_id), on_end=self._stream_ended)

    def _scheduler_reconnected(self, client: Client) -> None:
        self._sched.pending_messages = self._grant_stream(client)

    def _collect_grants(self, now: float) -> None:
        """Prefill side: takes the grants that arrived (every step, so that
        messages never pile up unread) and forgets unclaimed old ones. A
        sidecar that went away is reached again and subscribed to anew (grants
        sent meanwhile are lost: their requests prefill without a push after
        ``timeout_s``)."""
        s = self._sched
        if not s.wants_grants:
            return
        arrived: list[Notification] = []
        try:
            client = self._link.get()
            if client is not None and s.messages_generation != self._link.generation:
                # A new sidecar: its subscription was made on connecting.
                if s.messages is not None:
                    s.messages.close()
                s.messages, s.pending_messages = s.pending_messages, None
                s.messages_generation = self._link.generation
            if s.messages is None and client is not None:
                s.messages = self._grant_stream(client)
            if s.messages is not None:
                arrived = s.messages.poll()
        except KvrailError as e:
            log.warning("kvrail: reading grants: %s", e)
            self._check_lost(e)
            if s.messages is not None:
                s.messages.close()
                s.messages = None
        for n in arrived:
            if n.kind != MESSAGE or not n.request_id.startswith(GRANT_TOPIC):
                continue
            grant = _parse_grant(n.payload, n.peer, self._layer_count())
            if grant is None:
                log.warning("kvrail: malformed grant from %s/%s dropped", n.peer, n.from_worker)
                continue
            log.debug("grant %s arrived from %s/%s", n.request_id[len(GRANT_TOPIC) :], n.peer, n.from_worker)
            if len(s.grants) >= MAX_PENDING_GRANTS:
                s.grants.pop(next(iter(s.grants)))  # the oldest
            s.grants[n.request_id[len(GRANT_TOPIC) :]] = (now, grant)
        # Grants nobody claimed (their request never came) do not pile up.
        for t, (at, _) in list(s.grants.items()):
            if now - at > self.timeout_s:
                del s.grants[t]

    def _layer_count(self) -> int:
        """Layers the worker registered (from its region table), cached."""
        if not self._sched.num_layers:
            try:
                self._sched.num_layers = len(self._region_table()["layers"])
            except (KvrailError, KeyError, TypeError):
                return 0
        return self._sched.num_layers

    def push_target(self, request_id: str) -> dict[str, Any] | None:
        """Push mode, decode side: the ``kv_transfer_params`` the router gives the
        prefill engine for this request (after its blocks were allocated here)."""
        return self._sched.push_targets.pop(request_id, None)

    def build_connector_meta(self, scheduler_output: Any) -> KvrailConnectorMetadata:
        s = self._sched
        self._collect_grants(time.monotonic())
        meta = KvrailConnectorMetadata(load=s.new_loads, send=s.new_sends, cancel=s.new_cancels)
        s.new_loads, s.new_sends, s.new_cancels = {}, {}, set()
        if self.mode == "push":
            # Blocks added in later steps of a chunked prefill.
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            # A request resumed after preemption gets all its blocks anew.
            resumed = set(getattr(cached, "resumed_req_ids", None) or ())
            for i, rid in enumerate(getattr(cached, "req_ids", []) or []):
                new = cached.new_block_ids[i]
                if rid not in s.prefill_blocks or new is None:
                    continue
                if rid in resumed:
                    s.prefill_blocks[rid] = list(new[0])
                else:
                    s.prefill_blocks[rid].extend(new[0])
            computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            if cached is not None:
                computed.update(zip(cached.req_ids or [], cached.num_computed_tokens or []))
            for rid, target in list(s.pushing.items()):
                scheduled = scheduler_output.num_scheduled_tokens.get(rid)
                if scheduled is None:
                    continue
                # Push once, in the step that computes the prompt's last token.
                if computed.get(rid, 0) + scheduled >= s.prompt_tokens.get(rid, 0):
                    del s.pushing[rid]
                    s.prompt_tokens.pop(rid, None)
                    try:
                        meta.save[rid] = self._push_spec(rid, s.prefill_blocks[rid], target)
                    except (KeyError, TypeError, ValueError) as e:
                        # Another node's grant: nothing is pushed (the decode
                        # recomputes after its timeout), the blocks are freed
                        # as usual, and the engine goes on.
                        log.error("kvrail: %s: malformed grant, nothing pushed: %s", rid, e)
                        continue
                    s.pushed.add(rid)
        return meta

    def _push_spec(self, rid: str, blocks: list[int], target: dict[str, Any]) -> RemoteBlocks:
        """Push mode, prefill side: which of this request's ``blocks`` go to
        the decode's granted blocks. Blocks the decode's prefix cache already
        holds are skipped; engines with other block sizes (both publishing a
        token-cut geometry) move the tokens the decode asked for, from the
        token it asked. Raises ValueError for a malformed grant."""
        remote = list(target["remote_block_ids"])
        tokens, first = _count(target.get("tokens", 0)), _count(target.get("first_token", 0))
        group = target.get("load_group") or f"{target['remote_request_id']}{LOAD_GROUP}0"
        if not isinstance(group, str) or not 0 < len(group.encode()) <= 256:
            raise ValueError(f"load_group must be 1 to 256 bytes of text, not {group!r}")
        theirs = _block_tokens(target.get("remote_ranks"))
        mine = self._own_block_tokens() if theirs and tokens else None
        if theirs and mine and theirs != mine and tokens:
            start, n, offset = _token_window(first, tokens, mine, len(blocks))
            tokens = max(0, min(tokens, n * mine - offset))
            spec = RemoteBlocks.from_params(blocks[start : start + n], remote[: -(-tokens // theirs)], target)
            log.debug("%s: pushing %d tokens from token %d in this step", rid, tokens, first)
            return replace(spec, tokens=tokens, local_first_token=offset, load_group=group)
        local = blocks[int(target.get("skip_blocks", 0)) :]
        n = min(len(local), len(remote))
        log.debug("%s: pushing %d blocks in this step", rid, n)
        return replace(RemoteBlocks.from_params(local[:n], remote[:n], target), load_group=group)

    def update_connector_output(self, connector_output: Any) -> None:
        """Loads the workers finished (or gave up on) are no longer in flight:
        a request aborted after its KV arrived frees its blocks at once (vLLM
        waits for no further report of it)."""
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._sched.loading.pop(rid, None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        s = self._sched
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        aborted = _status_name(request) == "FINISHED_ABORTED"
        if rid in s.loading:
            # Decode side. Aborted while the KV was still arriving: stop the
            # transfers before vLLM reuses the blocks.
            del s.loading[rid]
            if aborted:
                s.new_cancels.add(rid)
                return True, None
            return False, None
        if self.mode == "push":
            s.waiting_since.pop(rid, None)
            s.pushing.pop(rid, None)
            s.prefill_blocks.pop(rid, None)
            s.prompt_tokens.pop(rid, None)
            if rid in s.pushed:
                s.pushed.discard(rid)
                # The blocks are being read by pushes: free them once those
                # end. The response says which blocks were pushed.
                return True, {"pushed_block_ids": list(block_ids)}
            return False, None
        if not params.get("do_remote_decode") or aborted or not block_ids:
            return False, None
        ranks = self._rank_tables()
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_node": self.node,
            "remote_regions": self._regions(),
            "remote_ranks": ranks,
            "remote_block_ids": list(block_ids),
            "remote_request_id": rid,
        }
        every_region = [r for t in ranks for r, _, _ in t["regions"]]
        try:
            # The workers release these generations before the blocks are
            # freed: a decode reading them later (a second decode engine
            # taking the request over) is refused, never handed the KV of
            # whichever request vLLM gave the blocks to next.
            out["remote_generations"] = self._scheduler_call(
                lambda c: {str(r): c.block_generations(r, block_ids) for r in every_region}
            )
        except KvrailError as e:
            log.error("kvrail: %s: the blocks' generations: %s; the decode side recomputes", rid, e)
            out["remote_failure"] = f"the prefill engine's sidecar could not vouch for its blocks: {e}"
            return False, out
        s.new_sends[rid] = list(block_ids)
        return True, out

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Registers the KV caches (one region if the layers are evenly spaced in
        one allocation, else one per layer) and publishes the region table.

        Host caches the engine allocated itself (vLLM's CPU backend) move, in
        place, under shared-memory files the sidecar maps. The files stay
        while the engine lives, so that a restarted sidecar can map them
        again; the engine removes them when it exits (and one that was killed
        has them removed by the next engine on the node)."""
        w = self._work
        w.layer_names = list(kv_caches)
        w.tensors = list(kv_caches.values())
        w.kv_layout = self.kv_layout or _vllm_kv_layout(w.tensors[0])
        w.geometry = _kv_geometry(self._vllm_config, w.tensors[0], self.tp_rank, self.tp_size, self.model_id)
        if w.geometry is None and self.tp_size > 1:
            raise KvrailError(
                f"tensor parallelism needs the KV geometry, which this cache ({tuple(w.tensors[0].shape)}) does not give"
            )
        sweep_adopted_files()
        for t in _distinct_host_storages(w.tensors):
            w.adopted.append(adopt_tensor(t))
        w.regions = self._register(self.client)

    def _register(self, client: Client) -> RegionTable:
        """Registers the KV caches with ``client``'s sidecar, publishes the
        region table the scheduler reads, and returns it."""
        w = self._work
        regions = client.register_layers(w.tensors, w.kv_layout, expose=self.mode == "pull", geometry=w.geometry)
        table = [(rid, start, count) for rid, start, count, _ in regions]
        layout = regions[0][3]
        w.block_bytes, w.planes = layout.block_bytes, layout.planes_per_layer
        tmp = self.region_table_path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "node": self.node,
                    "worker_id": self.worker_id,
                    "tp_rank": self.tp_rank,
                    "tp_size": self.tp_size,
                    "layers": w.layer_names,
                    "regions": table,
                    "geometry": w.geometry.to_json() if w.geometry is not None else None,
                    # Where each region's bytes are (host memory), for tools
                    # that read a rank's blocks back.
                    "region_memory": self._region_memory(regions),
                }
            )
        )
        tmp.replace(self.region_table_path)  # readers never see half a file
        # vLLM kills its workers with SIGKILL at shutdown: the sidecar removes
        # the worker's files once its process is gone.
        files = [a.path for a in w.adopted if a.owned] + [self.region_table_path]
        try:
            client.remove_on_exit(files)
        except KvrailError as e:
            log.warning("kvrail: the sidecar will not remove %s at exit: %s", files, e)
        return table

    def _region_memory(self, regions: list[tuple[int, int, int, Any]]) -> list[dict[str, Any]]:
        """Per host region: its file and layout (empty for GPU caches)."""
        w = self._work
        out = []
        for rid, start, count, layout in regions:
            try:
                _, memory = describe(w.tensors[start : start + count], w.kv_layout)
            except KvrailError:
                continue
            if isinstance(memory, Path):
                out.append({"region": rid, "path": str(memory), "layout": dict(layout.__dict__)})
        return out

    def _reconnected(self, client: Client) -> None:
        """A new sidecar answers (the old one restarted; this runs in the
        reconnecting thread): the caches are registered with it (new region
        ids, published at once for the scheduler's grants) and this worker's
        notifications subscribed to. The engine's thread takes both into use
        with the client (:meth:`_worker_client`)."""
        w = self._work
        regions = self._register(client) if w.tensors else []
        w.pending = (regions, client.notifications(on_end=self._stream_ended))

    def _worker_client(self) -> Client | None:
        """The sidecar's client for this step, None while it is away. Taking
        a reconnected one ends everything the old sidecar ran."""
        w = self._work
        client = self._link.get()
        if client is not None and w.generation != self._link.generation:
            w.generation = self._link.generation
            if w.notes is not None:
                w.notes.close()
            pending, w.pending = w.pending, None
            if pending is not None:
                w.regions, w.notes = pending
            w.drop_everything()
        return client

    def _lost_sidecar(self, error: BaseException) -> None:
        """This node's sidecar went away: every transfer it ran is gone with
        it. Loads in flight fail (vLLM recomputes or fails them, as its
        ``kv_load_failure_policy`` says), blocks kept for sends are freed
        (nobody can read them through a dead sidecar), and the engine goes on
        while the link reconnects."""
        w = self._work
        self._link.lost(error)
        try:
            w.notes.close()
        except Exception:  # noqa: BLE001 - a dead stream
            pass
        w.notes = None
        w.drop_everything()

    def _notifications_ended(self, error: KvrailError) -> None:
        """The notification stream ended: with the sidecar (then everything it
        ran is gone), or while it still answers (another subscriber took this
        worker's stream over, or it ended for a reason it gave): then the
        stream resumes after the last notification seen, nothing missed."""
        w = self._work
        client = self._link.client
        if client is None or not self._link.same_sidecar():
            self._lost_sidecar(error)
            return
        log.error("kvrail: notification stream ended (%s); resuming it", error)
        w.notes.close()
        seq, inc = w.last_seen
        try:
            w.notes = client.notifications(after_sequence=seq, incarnation=inc)
        except KvrailError as e:
            self._lost_sidecar(e)

    def _remove_files(self) -> None:
        """Removes this worker's adopted KV files and its region table (at
        shutdown and at interpreter exit)."""
        w = self._work
        for a in w.adopted:
            a.unlink()
        w.adopted = []
        for path in (self.region_table_path, self.region_table_path.with_suffix(".tmp")):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("kvrail: removing %s: %s", path, e)

    def _plan_pulls(self, rid: str, spec: RemoteBlocks) -> list[tuple[str, Blocks, Blocks]]:
        """The pulls that bring this rank the heads it holds of ``spec``'s
        blocks: (name, source, destination). Each prefill rank holding some
        of them is read once per region overlap, whole blocks when its shard
        is this rank's, else the heads both hold (a head slice). Pulls are
        named ``#i/n`` with ``n`` what each prefill rank serves to all decode
        ranks together, so that it frees the blocks once all were served."""
        w = self._work
        ranks = _ranks_of(spec.remote_ranks or [{"regions": spec.remote_regions, "geometry": None}])
        geometries = [g for _, g in ranks]
        mine = w.geometry
        overlaps = [_overlaps(table, w.regions) for table, _ in ranks]
        if mine is None or any(g is None for g in geometries):
            if len(ranks) != 1 or self.tp_size != 1:
                raise KvrailError(f"{rid}: tensor-parallel engines must both publish their KV geometry")
            per_rank: list[list[tuple[int, range | None]]] = [[(0, None)]]  # whole blocks of rank 0
        else:
            held = [g.head_range for g in geometries]  # type: ignore[union-attr]
            per_rank = []
            for dr in range(self.tp_size):
                want = rank_heads(mine.model_kv_heads, self.tp_size, dr)
                sources = head_sources(want, held)
                if sum(len(h) for _, h in sources) != len(want):
                    raise KvrailError(f"{rid}: the prefill engine's ranks hold heads {held}, not all of {want}")
                per_rank.append(sources)
        # Index each pull among everything its prefill rank serves.
        served = [0] * len(ranks)
        mine_first: dict[tuple[int, int], int] = {}
        for dr, sources in enumerate(per_rank):
            for k, (src, _) in enumerate(sources):
                if dr == self.tp_rank:
                    mine_first[(src, k)] = served[src]
                served[src] += len(overlaps[src])
        out = []
        tpb = mine.tokens_per_block if mine is not None else 0
        for k, (src, heads) in enumerate(per_rank[self.tp_rank]):
            theirs = geometries[src]
            head_slice = None
            if mine is not None and theirs is not None and theirs != mine:
                why = _geometry_mismatch(mine, theirs)
                if why:
                    raise KvrailError(f"{rid}: cannot take the prefill engine's KV: {why}")
                assert heads is not None
                head_slice = HeadSlice(
                    heads.start, len(heads), spec.tokens or len(spec.local_block_ids) * tpb, chunk_tokens(theirs, mine)
                )
            for j, (src_region, src_layer, dst, dst_layer, count) in enumerate(overlaps[src]):
                index = mine_first[(src, k)] + j
                name = f"{spec.remote_request_id}@{rid}:{src}#{index}/{served[src]}"
                out.append(
                    (
                        name,
                        Blocks(
                            src_region,
                            spec.remote_block_ids,
                            src_layer,
                            count,
                            generations=spec.remote_generations.get(str(src_region), ()),
                            slice=head_slice,
                            first_token=spec.remote_first_token if head_slice else 0,
                        ),
                        Blocks(dst, spec.local_block_ids, dst_layer, count),
                    )
                )
        return out

    @_timed
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        w = self._work
        meta: KvrailConnectorMetadata = self._get_connector_metadata()
        client = self._worker_client()
        for rid, spec in meta.load.items():
            w.receiving[rid] = set()
            w.local_blocks[rid] = spec.local_block_ids
            if spec.failure:
                w.fail_load(rid, spec.failure)
                continue
            if client is None:
                # No sidecar (restarting): the load fails now, not at a timeout.
                w.fail_load(rid, "the sidecar is away")
                continue
            if self.mode == "push":
                # Bytes, not pushes: one prefill rank's whole blocks are
                # counted as they land; several ranks' parts of each layer
                # (each head once), or tokens cut from other block sizes,
                # come as one receiver group, which must hold at least every
                # granted token.
                w.push_expected[rid] = len(w.layer_names) * w.planes * w.block_bytes * len(spec.local_block_ids)
                g = w.geometry
                if spec.tokens and g is not None and g.interior != "head_opaque":
                    per_token = g.heads * g.head_size * g.element_bytes
                    w.push_minimum[rid] = len(w.layer_names) * w.planes * per_token * spec.tokens
                else:
                    w.push_minimum[rid] = w.push_expected[rid]
                w.push_deadline[rid] = time.monotonic() + self.timeout_s
                log.debug("%s: rank %d waits for %d pushed bytes", rid, self.tp_rank, w.push_expected[rid])
                continue
            try:
                pulls = self._plan_pulls(rid, spec)
            except KvrailError as e:
                log.error("kvrail: %s", e)
                w.fail_load(rid, str(e))
                continue
            # Several pulls (heads from several prefill ranks, or several
            # regions) complete as one group: one notification for the load,
            # sent once none of them can still write into its blocks.
            group = (f"{spec.remote_request_id}@{rid}:load", len(pulls)) if len(pulls) > 1 else None
            if group is not None:
                w.transfer_owner[group[0]] = rid
                w.load_groups.add(group[0])
            for name, source, dest in pulls:
                try:
                    t = client.pull(name, spec.remote_node, source, dest, group=group)
                except KvrailError as e:
                    log.error("kvrail: pull for %s refused: %s", rid, e)
                    if _sidecar_gone(e):
                        self._lost_sidecar(e)  # fails this load too
                        client = None
                    else:
                        # Failed; it ends once the pulls already started have.
                        w.failed_loads[rid] = list(spec.local_block_ids)
                        w.cancel(client, rid)
                    if group is not None and not w.receiving.get(rid):
                        # No member joined: no notification will come.
                        w.transfer_owner.pop(group[0], None)
                        w.load_groups.discard(group[0])
                    break
                w.receiving[rid].add(t.transfer_id)
                if group is None:
                    w.transfer_owner[name] = rid
        # After the loads: a request aborted in the step its load was planned
        # cancels what just started.
        for rid in meta.cancel:
            if client is None:
                w.fail_load(rid, "the sidecar is away", cancelled=True)
            else:
                w.cancel(client, rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish before the request is scheduled (asynchronous loading), as
        # with vLLM's NixlConnector; nothing to wait for per layer.
        return

    @_timed
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.mode != "push" or not self.has_connector_metadata():
            return
        w = self._work
        meta: KvrailConnectorMetadata = self._get_connector_metadata()
        if not meta.save:
            return
        layer = w.layer_names.index(layer_name)
        client = self._worker_client()
        src_region, src_layer = _layer_region(w.regions, layer)
        for rid, spec in meta.save.items():
            # Tracked before any push: a request none of whose pushes was
            # accepted is still reported finished, and its blocks freed.
            pending = w.sending.setdefault(rid, set())
            if client is None:
                continue  # no sidecar: the decode side gives up after its timeout
            try:
                targets = self._push_targets(spec)
            except KvrailError as e:
                log.error("kvrail: push of %s: %s", rid, e)
                continue
            if layer == 0:
                log.debug("%s: rank %d pushes to %d decode ranks", rid, self.tp_rank, len(targets))
            for suffix, table, head_slice, senders in targets:
                # "/L<layer>" ends what the decode side counts by; the suffix
                # tells this worker's pushes to several decode ranks apart.
                name = f"{spec.remote_request_id}/L{layer}{suffix}"
                # Several prefill ranks sending to a decode rank, or tokens
                # instead of its whole blocks: it hears of every layer of
                # all of them as one, its receiver group. One rank's whole
                # blocks stay ungrouped (the submission ring takes them).
                grouped = senders > 1 or spec.tokens > 0
                load = (spec.load_group, len(w.layer_names) * senders) if grouped else None
                try:
                    dst_region, dst_layer = _layer_region(table, layer)
                    gens = spec.remote_generations.get(str(dst_region), ())
                    args = (
                        spec.remote_node,
                        Blocks(
                            src_region,
                            spec.local_block_ids,
                            src_layer,
                            1,
                            slice=head_slice,
                            first_token=spec.local_first_token if head_slice else 0,
                        ),
                        Blocks(dst_region, spec.remote_block_ids, dst_layer, 1, gens[: len(spec.remote_block_ids)]),
                        None,
                        load,
                    )
                    if load is None:
                        args = args[:3]
                    t = client.push(name, *args)
                except Exception as e:  # noqa: BLE001 - a bad target must not stop the forward pass
                    log.error("kvrail: push of %s layer %d refused: %s", rid, layer, e)
                    if _sidecar_gone(e):
                        self._lost_sidecar(e)
                        client = None
                        break
                    continue
                pending.add(t.transfer_id)
                w.transfer_owner[name] = rid
                w.push_retry[name] = args

    def _push_targets(self, spec: RemoteBlocks) -> list[tuple[str, RegionTable, HeadSlice | None, int]]:
        """Push mode, prefill side: the decode ranks this rank sends heads to,
        each as (name suffix, its region table, the head slice or None for
        whole blocks, how many prefill ranks push to that decode rank). Each
        decode rank gets each of its heads from one prefill rank (the first
        holding it, as a pulling decode rank would choose)."""
        w = self._work
        mine = w.geometry
        if not spec.remote_ranks:
            return [("", spec.remote_regions, None, 1)]
        ranks = _ranks_of(spec.remote_ranks)
        geometries = [g for _, g in ranks]
        cut = [g is not None and g.interior != "head_opaque" for g in geometries]
        if spec.tokens and any(cut) and mine is None:
            # It counts tokens' bytes: whole blocks would end its wait early.
            raise KvrailError("the decode engine takes tokens cut by its geometry, and this engine publishes none")
        if mine is None or any(g is None for g in geometries):
            if len(ranks) != 1 or self.tp_size != 1:
                raise KvrailError("tensor-parallel engines must both publish their KV geometry")
            return [("", ranks[0][0], None, 1)]
        held = [rank_heads(mine.model_kv_heads, self.tp_size, r) for r in range(self.tp_size)]
        out: list[tuple[str, RegionTable, HeadSlice | None, int]] = []
        for d, (table, theirs) in enumerate(ranks):
            assert theirs is not None
            by_token = bool(spec.tokens) and cut[d]
            sources = head_sources(theirs.head_range, held)
            senders = len({src for src, _ in sources})
            for src, heads in sources:
                if src != self.tp_rank:
                    continue
                if theirs == mine and not by_token:
                    out.append((f"/d{d}", table, None, senders))  # type: ignore[arg-type]
                    continue
                why = _geometry_mismatch(theirs, mine)
                if why:
                    raise KvrailError(f"cannot push to decode rank {d}: {why.replace('prefill engine', 'decode engine')}")
                head_slice = HeadSlice(
                    heads.start,
                    len(heads),
                    spec.tokens if by_token else len(spec.local_block_ids) * mine.tokens_per_block,
                    chunk_tokens(mine, theirs),
                )
                out.append((f"/d{d}", table, head_slice, senders))  # type: ignore[arg-type]
        return out

    @_timed
    def wait_for_save(self) -> None:
        # Pushes read blocks vLLM keeps until get_finished reports the request
        # (request_finished returned True), so the forward pass need not wait.
        return

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        w = self._work
        if self.has_connector_metadata():
            meta: KvrailConnectorMetadata = self._get_connector_metadata()
            for rid, blocks in meta.send.items():
                w.serve_blocks[rid] = blocks
                w.serve_expected[rid] = len(blocks) * len(w.layer_names) * w.planes * w.block_bytes
                w.serve_deadline[rid] = time.monotonic() + self.timeout_s
        now = time.monotonic()
        for rid in finished_req_ids:
            w.finished_seen.setdefault(rid, now)
        client = self._worker_client()
        if client is not None and w.notes is not None:
            try:
                arrived = w.notes.poll()
            except KvrailError as e:
                self._notifications_ended(e)
                arrived = []
            for n in arrived:
                w.last_seen = (n.sequence, n.incarnation)
                w.on_notification(n, self._link.client)
        if self._link.client is None:
            # Whatever was started before the sidecar went away has ended.
            w.drop_everything()
        return w.collect(self._link.client)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's newer form of :meth:`get_finished`: failed loads are also
        reported by request (``failed_recving``), which holds for every cache
        layout (block ids alone are ambiguous with several KV cache groups)."""
        sending, recving = self.get_finished(finished_req_ids)
        w = self._work
        failed, w.failed_loads = w.failed_loads, {}
        w.by_request = True
        return _TransferResults(set(sending or ()), set(recving or ()), set(failed))

    def get_block_ids_with_load_errors(self) -> set[int]:
        w = self._work
        if w.by_request:
            # Reported by request in get_transfer_results.
            return set()
        failed, w.failed_loads = w.failed_loads, {}
        return {b for blocks in failed.values() for b in blocks}

    def shutdown(self) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        if self.role == KVConnectorRole.SCHEDULER and self._sched.messages is not None:
            self._sched.messages.close()
            self._sched.messages = None
        if self.role == KVConnectorRole.WORKER:
            w = self._work
            client = self._link.client
            if client is not None:
                for rid in list(w.receiving):
                    w.cancel(client, rid)
            if w.notes is not None:
                w.notes.close()
            if client is not None:
                for rid, _, _ in w.regions:
                    try:
                        client.unregister(rid)
                    except KvrailError as e:
                        log.warning("kvrail: unregister %d: %s", rid, e)
            self._remove_files()
        self._link.close()


@dataclass
class _SchedulerState:
    loading: dict[str, RemoteBlocks] = field(default_factory=dict)
    new_loads: dict[str, RemoteBlocks] = field(default_factory=dict)
    new_sends: dict[str, list[int]] = field(default_factory=dict)
    new_cancels: set[str] = field(default_factory=set)
    push_targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    # push mode, prefill side: grants by ticket (arrival time, target), and
    # when each request started waiting for its grant
    messages: Notifications | None = None
    wants_grants: bool = False
    #: The sidecar connection ``messages`` was subscribed on, and the
    #: subscription made on a new connection, not yet taken into use.
    messages_generation: int = 1
    pending_messages: Notifications | None = None
    grants: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    num_layers: int = 0
    waiting_since: dict[str, float] = field(default_factory=dict)
    pushing: dict[str, dict[str, Any]] = field(default_factory=dict)
    pushed: set[str] = field(default_factory=set)
    prefill_blocks: dict[str, list[int]] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class _Reads:
    """Pull mode, prefill side: what the decode side has read of one request.
    Pulls are named ``#i/n``, so all n served frees the blocks even when the
    decode's prefix cache spared some of them (fewer bytes than offered)."""

    bytes: int = 0
    parts: set[int] = field(default_factory=set)
    total_parts: int | None = None
    first_seen: float = 0.0

    def complete(self, expected_bytes: int) -> bool:
        # Named parts decide: decode ranks reading head slices (replicated
        # heads read by several) add up to other byte counts.
        if self.total_parts is not None:
            return len(self.parts) >= self.total_parts
        return self.bytes >= expected_bytes


class _WorkerState:
    """What the worker-side connector tracks between steps."""

    def __init__(self, notes: Notifications, timeout_s: float) -> None:
        #: This worker's notifications; None while the sidecar is away.
        self.notes: Notifications | None = notes
        self.layer_names: list[str] = []
        self.tensors: list[Any] = []
        self.kv_layout: str | None = None
        #: What this rank's blocks hold (None where the cache does not say).
        self.geometry: KvGeometry | None = None
        #: Host memory moved under shared-memory files (removed at exit).
        self.adopted: list[AdoptedMemory] = []
        self.regions: RegionTable = []
        self.block_bytes = 0
        self.planes = 0
        # request -> transfer ids still running (decode: pulls; prefill: pushes)
        self.receiving: dict[str, set[int]] = {}
        self.sending: dict[str, set[int]] = {}
        self.transfer_owner: dict[str, str] = {}  # transfer request name (or group id) -> request
        # Group ids of loads pulled as one group (their notification ends them).
        self.load_groups: set[str] = set()
        # Push name -> (peer, source, destination), to push once more if the
        # peer's sidecar restarted before it went out.
        self.push_retry: dict[str, tuple[str, Blocks, Blocks]] = {}
        self.local_blocks: dict[str, list[int]] = {}
        # push mode, decode side: layers expected and arrived per request, and
        # when to give up
        self.push_expected: dict[str, int] = {}
        self.push_arrived: dict[str, int] = {}
        #: Push mode: the fewest bytes a complete receiver group may hold,
        #: and what the group said it holds once all its members arrived.
        self.push_minimum: dict[str, int] = {}
        self.push_grouped: dict[str, int] = {}
        self.push_deadline: dict[str, float] = {}
        # pull mode, prefill side: bytes to be read, give-up time
        self.serve_expected: dict[str, int] = {}
        self.serve_deadline: dict[str, float] = {}
        #: ... and the blocks, released (their generations moved on) when
        #: the reads end, before vLLM may reuse them
        self.serve_blocks: dict[str, list[int]] = {}
        # what the decode side has read of each request so far
        self.reads: dict[str, _Reads] = {}
        # finished requests (as vLLM reported them) -> when
        self.finished_seen: dict[str, float] = {}
        self.timeout_s = timeout_s
        self.done_sending: set[str] = set()
        self.done_receiving: set[str] = set()
        #: Loads that failed, not yet reported: request -> its local blocks.
        self.failed_loads: dict[str, list[int]] = {}
        #: vLLM takes failed loads by request (get_transfer_results).
        self.by_request = False
        #: (sequence, incarnation) of the last notification seen.
        self.last_seen = (0, 0)
        #: The sidecar connection in use (the link's generation), and what
        #: the reconnecting thread prepared for the next: (regions, notifications).
        self.generation = 1
        self.pending: tuple[RegionTable, Notifications] | None = None

    def fail_load(self, rid: str, reason: str, cancelled: bool = False) -> None:
        """Ends a load: reported finished receiving, and (unless the request
        was cancelled) failed, so vLLM recomputes or fails it."""
        if rid not in self.receiving and rid not in self.local_blocks:
            return
        if not cancelled:
            log.warning("kvrail: load of %s failed: %s", rid, reason)
            self.failed_loads[rid] = list(self.local_blocks.get(rid, ()))
        self._end_load(rid)

    def _end_load(self, rid: str) -> None:
        self.receiving.pop(rid, None)
        self.push_expected.pop(rid, None)
        self.push_deadline.pop(rid, None)
        self.push_arrived.pop(rid, None)
        self.push_minimum.pop(rid, None)
        self.push_grouped.pop(rid, None)
        self.local_blocks.pop(rid, None)
        self.done_receiving.add(rid)

    def drop_everything(self) -> None:
        """The sidecar went away with every transfer it ran: loads fail,
        sends end (their blocks are freed once vLLM reported the request
        finished)."""
        for rid in list(self.receiving):
            self.fail_load(rid, "the sidecar went away")
        self.transfer_owner.clear()
        self.load_groups.clear()
        self.push_retry.clear()
        self.done_sending.update(self.sending)
        self.sending.clear()
        self.done_sending.update(self.serve_expected)
        self.serve_expected.clear()
        self.serve_deadline.clear()
        self.serve_blocks.clear()
        self.reads.clear()

    def release_served(self, client: Client | None, rid: str) -> None:
        """Pull mode, prefill side: the reads of a request's blocks have ended
        (all served, failed, or given up on). The blocks' generations move on
        before vLLM may reuse them, so a decode that reads them later (another
        engine taking the request over, a late or repeated pull) is refused
        with ``blocks_released`` rather than handed another request's KV."""
        mine = self.serve_blocks.pop(rid, [])
        # Blocks vLLM's prefix cache shares with a request still being read
        # stay at their generation until that one's reads end too.
        shared = {b for other in self.serve_blocks.values() for b in other}
        blocks = [b for b in mine if b not in shared]
        # No sidecar: nobody reads through it; a new one knows no old regions.
        self._release(client, rid, blocks)

    def release_pushed(self, client: Client | None, rid: str) -> None:
        """Push mode, decode side: gives up on a request's pushed layers. The
        blocks' generations move on, so a push still on its way (or one sent
        later from the grant) fails instead of writing into blocks vLLM reuses;
        the blocks can then be freed at once. (A sidecar that restarted since
        the grant knows neither the regions nor the generations it named: its
        pushes are refused anyway.)"""
        self._release(client, rid, self.local_blocks.get(rid, []))

    def _release(self, client: Client | None, rid: str, blocks: list[int]) -> None:
        """Moves ``blocks`` of every region of this rank to their next
        generation (nothing without a sidecar or blocks); a failure is logged."""
        if client is None or not blocks:
            return
        for region, _, _ in self.regions:
            try:
                client.release_blocks(region, blocks)
            except KvrailError as e:
                log.warning("kvrail: releasing blocks of %s: %s", rid, e)

    def cancel(self, client: Client, rid: str) -> None:
        """Stops a load vLLM aborted; it is reported finished once its
        transfers have ended."""
        if rid not in self.receiving:
            return
        if rid in self.push_expected:
            self.release_pushed(client, rid)
            self.fail_load(rid, "aborted", cancelled=True)
            return
        for tid in list(self.receiving[rid]):
            try:
                client.cancel(tid)
            except KvrailError as e:  # already finished: its notification says how
                log.info("kvrail: cancel %d of %s: %s", tid, rid, e)
        # Cancelled: its transfers' failures are not load errors.
        self.local_blocks[rid] = []

    def on_notification(self, n: Notification, client: Client | None) -> None:
        if n.kind == MESSAGE:
            # A peer's message is not a transfer's outcome, whatever its topic.
            return
        if n.kind == PUSH_RECEIVED:
            rid = _pushed_request(n.request_id)
            if rid in self.push_expected and _is_load_group(n.request_id):
                self.push_grouped[rid] = n.bytes
            elif rid in self.push_expected:
                self.push_arrived[rid] = self.push_arrived.get(rid, 0) + n.bytes
                log.debug("%s: %d of %d pushed bytes arrived", rid, self.push_arrived[rid], self.push_expected[rid])
            return
        if n.kind == PULL_SERVED:
            self.part_served(n.request_id, n.bytes)
            return
        owner = self.transfer_owner.pop(n.request_id, None)
        if owner is None:
            if n.kind == FAILED:
                log.warning("kvrail: %s failed: %s", n.request_id, n.failure)
                if "@" in n.request_id:
                    # A decode's read of this worker's blocks failed: the
                    # decode fails its load (and recomputes) and does not read
                    # that part again, so the part has ended; the blocks are
                    # freed once every part has, not after the timeout.
                    self.part_served(n.request_id, 0)
                    return
                # A peer's push into this worker's blocks failed: the request's
                # load has failed; the rest of its layers are not waited for.
                rid = _pushed_request(n.request_id)
                if rid in self.push_expected:
                    self.release_pushed(client, rid)
                    self.fail_load(rid, f"a pushed layer failed: {n.failure}")
            return
        retry = self.push_retry.pop(n.request_id, None)
        if n.kind == FAILED and retry is not None and client is not None and owner in self.sending:
            if n.failure is not None and n.failure.code == "peer_restarted":
                # Queued while the peer's sidecar restarted, and failed with
                # the old session: once more, on the new one (a push granted
                # by the old process names its regions, which the new one
                # refuses).
                try:
                    t = client.push(n.request_id, *retry)
                except KvrailError as e:
                    log.error("kvrail: push %s again after the peer restarted: %s", n.request_id, e)
                else:
                    log.warning("kvrail: %s: the peer restarted; pushed again", n.request_id)
                    self.sending[owner].discard(n.transfer_id)
                    self.sending[owner].add(t.transfer_id)
                    self.transfer_owner[n.request_id] = owner
                    return
        if n.kind == FAILED:
            log.error("kvrail: transfer %s of %s failed: %s", n.request_id, owner, n.failure)
        grouped = n.request_id in self.load_groups
        self.load_groups.discard(n.request_id)
        if n.kind in (PULL_DONE, FAILED) and owner in self.receiving:
            if grouped:
                self.receiving[owner].clear()  # every member has ended
            else:
                self.receiving[owner].discard(n.transfer_id)
            if n.kind == FAILED and self.local_blocks.get(owner):
                self.failed_loads[owner] = list(self.local_blocks[owner])
        if n.kind in (PUSH_DONE, FAILED) and owner in self.sending:
            self.sending[owner].discard(n.transfer_id)

    def part_served(self, pull_name: str, nbytes: int) -> None:
        """Pull mode, prefill side: the part of a request a decode's pull named
        (``<request>@<reader>#i/n``) has ended, with ``nbytes`` read."""
        rid, _, part = pull_name.partition("@")
        reads = self.reads.setdefault(rid, _Reads(first_seen=time.monotonic()))
        reads.bytes += nbytes
        index, _, total = part.rpartition("#")[2].partition("/")
        if index.isdigit() and total.isdigit() and 0 < int(total) <= 4096:
            reads.parts.add(int(index))
            reads.total_parts = int(total)

    def collect(self, client: Client | None) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        for rid, pending in list(self.receiving.items()):
            expected = self.push_expected.get(rid)
            grouped = self.push_grouped.get(rid)
            if grouped is not None:
                least = self.push_minimum.get(rid, 0)
                if grouped < least:
                    # Every member arrived: nothing more will come.
                    self.release_pushed(client, rid)
                    self.fail_load(rid, f"the prefill engine's pushes ended with {grouped} bytes, at least {least} expected")
                    continue
            elif expected is not None:
                if self.push_arrived.get(rid, 0) < expected:
                    if now <= self.push_deadline[rid]:
                        continue
                    self.release_pushed(client, rid)
                    self.fail_load(
                        rid,
                        f"pushed KV incomplete after the timeout: {self.push_arrived.get(rid, 0)} of {expected} bytes arrived",
                    )
                    continue
            elif pending:
                continue
            self._end_load(rid)
        for rid, pending in list(self.sending.items()):
            if not pending:
                del self.sending[rid]
                self.done_sending.add(rid)
        # Reads of requests whose send never registered here, and finished
        # requests that never sent: forgotten after the timeout.
        for rid, reads in list(self.reads.items()):
            if rid not in self.serve_expected and now - reads.first_seen > self.timeout_s:
                del self.reads[rid]
        for rid, at in list(self.finished_seen.items()):
            if now - at > self.timeout_s and rid not in self.serve_expected and rid not in self.sending:
                del self.finished_seen[rid]
        for rid, expected in list(self.serve_expected.items()):
            late = now > self.serve_deadline[rid]
            reads = self.reads.get(rid, _Reads())
            if reads.complete(expected) or late:
                if late:
                    log.warning("kvrail: %s not read within the send timeout; freeing its blocks", rid)
                del self.serve_expected[rid], self.serve_deadline[rid]
                self.reads.pop(rid, None)
                self.release_served(client, rid)
                self.done_sending.add(rid)
        # vLLM only takes finished sends of requests it has reported finished.
        sending = self.done_sending & self.finished_seen.keys()
        self.done_sending -= sending
        for rid in sending:
            del self.finished_seen[rid]
        receiving, self.done_receiving = self.done_receiving, set()
        return (sending or None), (receiving or None)
