"""What a region's KV blocks hold (one tensor-parallel rank's shard of a
model's KV cache), and head slices: how ranks sharded differently exchange
the heads they share (``proto/kvrail/v1/sidecar.proto``, ``KvGeometry`` and
``HeadSlice``; the planning itself is the sidecar's, in ``kvrail-core``).

A head-sliced transfer moves model heads ``[head_start, head_start +
head_count)`` of the request's first ``tokens`` tokens as one stream both
sidecars map onto their own blocks: layer, plane, chunk of ``chunk_tokens``
tokens, head, token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from .errors import LayoutError
from .v1 import sidecar_pb2 as pb

#: How a block orders what it holds: ``nhd`` ([tokens, heads, head_size]),
#: ``hnd`` ([heads, tokens, head_size]), ``head_opaque`` (each head's bytes
#: contiguous in a kernel's own order, as vLLM's CPU backend packs them: heads
#: can be sliced, tokens cannot).
Interior = Literal["nhd", "hnd", "head_opaque"]

_INTERIOR = {
    "nhd": pb.BLOCK_INTERIOR_NHD,
    "hnd": pb.BLOCK_INTERIOR_HND,
    "head_opaque": pb.BLOCK_INTERIOR_HEAD_OPAQUE,
}


@dataclass(frozen=True)
class KvGeometry:
    """One rank's shard: heads ``[head_start, head_start + heads)`` of the
    model's ``model_kv_heads``, ``head_size`` elements per head and token
    (per plane), ``tokens_per_block`` tokens per block."""

    model: str
    dtype: str
    element_bytes: int
    head_size: int
    model_kv_heads: int
    head_start: int
    heads: int
    tokens_per_block: int
    interior: Interior

    def to_proto(self) -> pb.KvGeometry:
        if self.interior not in _INTERIOR:
            raise LayoutError(f"interior must be one of {sorted(_INTERIOR)}, not {self.interior!r}")
        return pb.KvGeometry(
            model=self.model,
            dtype=self.dtype,
            element_bytes=self.element_bytes,
            head_size=self.head_size,
            model_kv_heads=self.model_kv_heads,
            head_start=self.head_start,
            heads=self.heads,
            tokens_per_block=self.tokens_per_block,
            interior=_INTERIOR[self.interior],
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "KvGeometry":
        """From its JSON form, checked (another engine wrote it): ValueError
        for a missing or mistyped field."""
        values = {k: d[k] for k in KvGeometry.__dataclass_fields__}
        for k, v in values.items():
            if k in ("model", "dtype", "interior"):
                if not isinstance(v, str):
                    raise ValueError(f"geometry {k} must be text, not {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 32:
                raise ValueError(f"geometry {k} must be a 32-bit unsigned integer, not {v!r}")
        if values["interior"] not in _INTERIOR:
            raise ValueError(f"geometry interior must be one of {sorted(_INTERIOR)}")
        return KvGeometry(**values)

    @property
    def head_range(self) -> range:
        return range(self.head_start, self.head_start + self.heads)


@dataclass(frozen=True)
class HeadSlice:
    head_start: int
    head_count: int
    tokens: int
    chunk_tokens: int

    def to_proto(self) -> pb.HeadSlice:
        return pb.HeadSlice(
            head_start=self.head_start,
            head_count=self.head_count,
            tokens=self.tokens,
            chunk_tokens=self.chunk_tokens,
        )


def rank_heads(model_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads tensor-parallel rank ``rank`` of ``tp`` holds, as vLLM
    shards them (with more ranks than heads, one head replicated on
    ``tp // model_kv_heads`` consecutive ranks)."""
    if tp <= model_kv_heads:
        per = model_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // model_kv_heads)
    return range(head, head + 1)


def head_sources(dest: range, sources: Sequence[range]) -> list[tuple[int, range]]:
    """Which source (index into ``sources``) sends which of ``dest``'s heads:
    each head once, from the first source holding it, consecutive heads from
    one source as one slice."""
    out: list[tuple[int, range]] = []
    for head in dest:
        src = next((i for i, s in enumerate(sources) if head in s), None)
        if src is None:
            continue
        if out and out[-1][0] == src and out[-1][1].stop == head:
            out[-1] = (src, range(out[-1][1].start, head + 1))
        else:
            out.append((src, range(head, head + 1)))
    return out


def chunk_tokens(a: KvGeometry, b: KvGeometry) -> int:
    """The stream's chunk that leaves both sides the fewest runs."""
    if a.interior == "nhd" and b.interior == "nhd":
        return 1
    return max(a.tokens_per_block, b.tokens_per_block)


def whole_blocks_match(a: KvGeometry, b: KvGeometry) -> bool:
    """Whether blocks can move whole between the two (same shard, same
    shape): no head slice needed."""
    return a == b
