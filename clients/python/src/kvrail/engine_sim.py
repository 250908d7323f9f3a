"""A stand-in for the parts of vLLM that drive a KV connector, for running
:class:`~kvrail.connector.KvrailConnector` without vLLM: the objects it reads
(``Request``, ``KVCacheBlocks``, ``SchedulerOutput``) with vLLM's field names,
and :class:`MiniEngine`, one engine (scheduler + one worker) making the calls in
vLLM's order. The model is replaced by a checkable pattern written layer by layer.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from .connector import KVConnectorRole, KvrailConnector
from .errors import Timeout
from .memory import HostKvCache


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


@dataclass
class Request:
    """The fields of ``vllm.v1.request.Request`` the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    status: RequestStatus = RequestStatus.WAITING


class KVCacheBlocks:
    def __init__(self, block_ids: list[int]) -> None:
        self._ids = block_ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self._ids),)


@dataclass
class NewRequestData:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    # Requests resumed after preemption: their new_block_ids replace the old.
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)


def vllm_config(socket: str, mode: str, engine_id: str, role: str, **extra: Any) -> Any:
    """An object with the attributes of vLLM's ``VllmConfig`` the connector reads."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="KvrailConnector",
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config={"socket": socket, "mode": mode, **extra},
        )
    )


def layer_pattern(seed: int, layer: int, nbytes: int) -> np.ndarray:
    """The bytes of one layer of a request (every plane of every block, in order)."""
    return np.random.default_rng([seed, layer]).integers(0, 256, size=nbytes, dtype=np.uint8)


class MiniEngine:
    """One vLLM-like engine: a scheduler-side and a worker-side connector, a host
    KV cache in shared memory registered through ``register_kv_caches``, a block
    free list, and ``step()`` making the connector calls of one forward pass."""

    def __init__(
        self,
        socket: str,
        mode: str,
        engine_id: str,
        role: str,
        kv: HostKvCache,
        *,
        block_size: int = 16,
        model: tuple[str, int] | None = None,
        layers: list[np.ndarray] | None = None,
        **extra: Any,
    ) -> None:
        """``model``: (name, KV heads), given as vLLM's model config gives
        them, makes the connector derive its KV geometry from ``layers``
        (vLLM's logical ``[2, blocks, tokens, heads, head_size]`` views of
        ``kv``, in HND stride order where the memory holds heads outside
        tokens; default: ``kv.layers``)."""
        cfg = vllm_config(str(socket), mode, engine_id, role, **extra)
        if model is not None:
            name, heads = model
            cfg.model_config = SimpleNamespace(model=name, get_total_num_kv_heads=lambda: heads)
        self.kv = kv
        self.block_size = block_size
        self.layers = layers if layers is not None else kv.layers
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(len(kv.layers))]
        self.scheduler = KvrailConnector(cfg, KVConnectorRole.SCHEDULER)
        self.worker = KvrailConnector(cfg, KVConnectorRole.WORKER)
        self.worker.register_kv_caches(dict(zip(self.layer_names, self.layers)))
        self.free = list(range(kv.layout.num_blocks))
        self.held: dict[str, list[int]] = {}  # blocks vLLM keeps until get_finished
        self.blocks: dict[str, list[int]] = {}
        #: The blocks of the last request prefilled (read back by tests).
        self.blocks_of_last: list[int] = []
        self._finished: set[str] = set()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()

    def _alloc(self, tokens: int) -> list[int]:
        n = math.ceil(tokens / self.block_size)
        if n > len(self.free):
            raise RuntimeError(f"{n} blocks wanted, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def step(
        self,
        new: list[NewRequestData] | None = None,
        scheduled: dict[str, int] | None = None,
        compute: Callable[[int], None] | None = None,
    ) -> None:
        """One forward pass: metadata to the worker, load, per layer compute and
        save, then ``get_finished`` (blocks of finished sends return to the pool)."""
        finished, self._finished = self._finished, set()
        out = SchedulerOutput(new or [], CachedRequestData(), scheduled or {}, finished)
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        for i, name in enumerate(self.layer_names):
            self.worker.wait_for_layer_load(name)
            if compute is not None:
                compute(i)
            self.worker.save_kv_layer(name, self.kv.layers[i], None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(finished)
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(SimpleNamespace(finished_sending=sending, finished_recving=recving))
        for rid in sending or ():
            self.free.extend(self.held.pop(rid))
            self.finished_sending.add(rid)
        self.finished_recving |= recving or set()

    def run_until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Steps (idle passes, as a busy engine would make) until ``done()``."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise Timeout(f"engine condition not met within {timeout} s")
            self.step()
            time.sleep(0.001)

    # Prefill side --------------------------------------------------------

    def prefill(self, req: Request, seed: int, abort: bool = False) -> dict[str, Any] | None:
        """Schedules the whole prompt in one step, writing each layer's KV (the
        pattern of ``seed``) just before ``save_kv_layer``, then finishes the
        request (max_tokens=1, or aborted) and returns its ``kv_transfer_params``."""
        num, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert num == 0
        blocks = self._alloc(len(req.prompt_token_ids))
        self.blocks[req.request_id] = blocks
        self.blocks_of_last = blocks
        self.scheduler.update_state_after_alloc(req, KVCacheBlocks(blocks), 0)
        req.status = RequestStatus.RUNNING
        layer_bytes = self.kv.layout.planes_per_layer * len(blocks) * self.kv.layout.block_bytes

        def compute(layer: int) -> None:
            write_blocks(self.kv, layer, blocks, layer_pattern(seed, layer, layer_bytes))

        self.step(
            [NewRequestData(req.request_id, (blocks,), 0)],
            {req.request_id: len(req.prompt_token_ids)},
            compute,
        )
        return self.finish(req, abort)

    def finish(self, req: Request, abort: bool = False) -> dict[str, Any] | None:
        req.status = RequestStatus.FINISHED_ABORTED if abort else RequestStatus.FINISHED_LENGTH_CAPPED
        blocks = self.blocks.pop(req.request_id)
        delay, params = self.scheduler.request_finished(req, blocks)
        self._finished.add(req.request_id)
        if delay:
            self.held[req.request_id] = blocks
        else:
            self.free.extend(blocks)
        return params

    # Decode side ---------------------------------------------------------

    def admit_remote(self, req: Request, computed: int = 0) -> list[int]:
        """A request whose KV comes from a prefill engine: blocks allocated and the
        load announced, as vLLM's scheduler does before WAITING_FOR_REMOTE_KVS.
        ``computed``: prompt tokens the local prefix cache holds (whole blocks;
        only the rest is loaded, into new blocks)."""
        num, load_async = self.scheduler.get_num_new_matched_tokens(req, computed)
        assert num > 0 and load_async, (num, load_async)
        blocks = self._alloc(num)
        self.blocks[req.request_id] = blocks
        self.scheduler.update_state_after_alloc(req, KVCacheBlocks(blocks), num)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return blocks


def write_blocks(kv: HostKvCache, layer: int, blocks: list[int], data: np.ndarray) -> None:
    """Writes ``data`` into every plane of ``blocks`` of a layer (plane-major)."""
    bb = kv.layout.block_bytes
    i = 0
    for plane in range(kv.layout.planes_per_layer):
        for b in blocks:
            kv.block(layer, plane, b)[:] = data[i : i + bb]
            i += bb


def read_blocks(kv: HostKvCache, layer: int, blocks: list[int]) -> np.ndarray:
    """The bytes of every plane of ``blocks`` of a layer (plane-major)."""
    return np.concatenate(
        [kv.block(layer, plane, b) for plane in range(kv.layout.planes_per_layer) for b in blocks]
    )


def tokens_of(layer: np.ndarray, blocks: list[int], block_size: int, tokens: range) -> np.ndarray:
    """K and V of ``tokens`` of a request held in ``blocks`` of a layer's
    logical ``[2, blocks, block_size, heads, head_size]`` view:
    ``[2, len(tokens), heads, head_size]``, whatever the engine's block size
    and order inside a block."""
    t = np.arange(tokens.start, tokens.stop)
    return layer[:, np.asarray(blocks)[t // block_size], t % block_size]


def mismatched_layers(kv: HostKvCache, blocks: list[int], seed: int) -> list[int]:
    """Layers whose blocks differ from the pattern of ``seed`` (empty: all verified)."""
    bad = []
    for layer in range(kv.layout.num_layers):
        got = read_blocks(kv, layer, blocks)
        if not np.array_equal(got, layer_pattern(seed, layer, got.size)):
            bad.append(layer)
    return bad
