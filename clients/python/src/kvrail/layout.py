"""Where each KV block lives in a registered region, and how to derive that
from vLLM's paged per-layer tensors.

Block ``(layer, plane, block)`` starts at
``base_offset + layer*layer_stride + plane*plane_stride + block*block_stride``
and is ``block_bytes`` long (proto/kvrail/v1/sidecar.proto, ``RegionLayout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

from .errors import LayersNotEvenlySpaced, LayoutError
from .v1 import sidecar_pb2 as pb

#: How a layer's tensor orders its planes (K and V) and blocks.
#: ``flash_attn``: ``[2, num_blocks, ...]`` (vLLM's FlashAttention backend),
#: ``flash_infer``: ``[num_blocks, 2, ...]``, ``mla``: ``[num_blocks, ...]`` (one plane).
KvLayout = Literal["flash_attn", "flash_infer", "mla"]


@dataclass(frozen=True)
class Layout:
    """A region's block geometry, in bytes."""

    num_layers: int
    planes_per_layer: int
    num_blocks: int
    block_bytes: int
    layer_stride: int
    plane_stride: int
    block_stride: int
    base_offset: int = 0

    @staticmethod
    def dense(
        num_layers: int, planes_per_layer: int, num_blocks: int, block_bytes: int
    ) -> "Layout":
        """Layers back to back, each ``[planes, num_blocks, block_bytes]``
        (vLLM's FlashAttention layout for ``planes_per_layer=2``)."""
        plane = num_blocks * block_bytes
        return Layout(
            num_layers=num_layers,
            planes_per_layer=planes_per_layer,
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            layer_stride=planes_per_layer * plane,
            plane_stride=plane,
            block_stride=block_bytes,
        )

    def block_offset(self, layer: int, plane: int, block: int) -> int:
        """Byte offset of a block in the region."""
        if not (0 <= layer < self.num_layers and 0 <= plane < self.planes_per_layer):
            raise LayoutError(f"layer {layer} plane {plane} outside {self}")
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"block {block} outside 0..{self.num_blocks}")
        return (
            self.base_offset
            + layer * self.layer_stride
            + plane * self.plane_stride
            + block * self.block_stride
        )

    def extent(self) -> int:
        """Bytes from the region's start to the end of its last block."""
        # Strides are positive, so the block with every index at its largest ends last.
        last = self.block_offset(
            self.num_layers - 1, self.planes_per_layer - 1, self.num_blocks - 1
        )
        return last + self.block_bytes

    def layer_bytes(self) -> int:
        """Bytes of one layer's blocks (all planes)."""
        return self.planes_per_layer * self.num_blocks * self.block_bytes

    def request_bytes(self, num_blocks: int, num_layers: int | None = None) -> int:
        """Bytes moved for ``num_blocks`` blocks over ``num_layers`` layers (default all)."""
        layers = self.num_layers if num_layers is None else num_layers
        return layers * self.planes_per_layer * num_blocks * self.block_bytes

    def shifted(self, base_offset: int) -> "Layout":
        """The same geometry starting ``base_offset`` bytes into the region."""
        return replace(self, base_offset=base_offset)

    def to_proto(self) -> pb.RegionLayout:
        return pb.RegionLayout(
            num_layers=self.num_layers,
            planes_per_layer=self.planes_per_layer,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            base_offset=self.base_offset,
            layer_stride=self.layer_stride,
            plane_stride=self.plane_stride,
            block_stride=self.block_stride,
        )


@dataclass(frozen=True)
class TensorView:
    """What the layout derivation needs of an array: address, shape, byte strides."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int
    device: str  # "cpu" or "cuda:N"

    @staticmethod
    def of(t: Any) -> "TensorView":
        """Reads a numpy array or a torch tensor (without importing either)."""
        if hasattr(t, "__array_interface__"):  # numpy
            address = int(t.__array_interface__["data"][0])
            return TensorView(
                address, tuple(t.shape), tuple(t.strides), int(t.itemsize), "cpu"
            )
        if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch
            size = int(t.element_size())
            dev = t.device
            device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
            return TensorView(
                int(t.data_ptr()),
                tuple(int(s) for s in t.shape),
                tuple(int(s) * size for s in t.stride()),
                size,
                device,
            )
        raise LayoutError(f"expected a numpy array or torch tensor, got {type(t)!r}")


@dataclass(frozen=True)
class PagedLayout:
    """A layout derived from per-layer tensors; ``address`` is layer 0's first byte
    (the layout's ``base_offset`` is 0 there)."""

    layout: Layout
    address: int
    device: str


def _kv_dims(shape: tuple[int, ...], kv_layout: KvLayout | None) -> tuple[int | None, int]:
    """(plane dim or None, block dim) for a layer tensor's shape."""
    if kv_layout is None:
        if len(shape) >= 3 and shape[0] == 2 and shape[1] != 2:
            kv_layout = "flash_attn"
        elif len(shape) >= 3 and shape[1] == 2 and shape[0] != 2:
            kv_layout = "flash_infer"
        else:
            raise LayoutError(
                f"cannot tell planes from blocks in shape {shape}: pass "
                "kv_layout='flash_attn' ([2, num_blocks, ...]), 'flash_infer' "
                "([num_blocks, 2, ...]) or 'mla' ([num_blocks, ...])"
            )
    if kv_layout == "flash_attn":
        return 0, 1
    if kv_layout == "flash_infer":
        return 1, 0
    if kv_layout == "mla":
        return None, 0
    raise LayoutError(f"unknown kv_layout {kv_layout!r}")


def paged_layout(layers: Sequence[Any], kv_layout: KvLayout | None = None) -> PagedLayout:
    """Derives one region layout from vLLM's per-layer KV tensors.

    Every layer must have the same shape, dtype and strides, its blocks' bytes must
    be contiguous (any order of the dims inside a block, e.g. vLLM's HND stride
    permutation), and the layers must be evenly spaced in one allocation
    (otherwise register each layer on its own: ``paged_layout([t])``).
    """
    if not layers:
        raise LayoutError("no layers given")
    views = [TensorView.of(t) for t in layers]
    first = views[0]
    for i, v in enumerate(views[1:], start=1):
        if (v.shape, v.strides, v.itemsize, v.device) != (
            first.shape,
            first.strides,
            first.itemsize,
            first.device,
        ):
            raise LayoutError(
                f"layer {i} is {v.shape} strides {v.strides} on {v.device}, "
                f"layer 0 is {first.shape} strides {first.strides} on {first.device}"
            )
    plane_dim, block_dim = _kv_dims(first.shape, kv_layout)
    if plane_dim is not None and first.shape[plane_dim] != 2:
        raise LayoutError(f"plane dim {plane_dim} of {first.shape} is not 2 (K, V)")
    inner = [
        (first.strides[d], first.shape[d])
        for d in range(len(first.shape))
        if d not in (plane_dim, block_dim)
    ]
    if not inner:
        raise LayoutError(f"shape {first.shape} has no dims inside a block")
    # A block is contiguous when its dims, smallest stride first, pack densely.
    expected = first.itemsize
    for stride, size in sorted(inner):
        if size == 1:
            continue
        if stride != expected:
            raise LayoutError(
                f"a block of shape {first.shape} strides {first.strides} is not "
                "contiguous bytes"
            )
        expected *= size
    block_bytes = first.itemsize * math.prod(size for _, size in inner)
    block_stride = first.strides[block_dim]
    plane_stride = first.strides[plane_dim] if plane_dim is not None else block_bytes
    planes = 2 if plane_dim is not None else 1
    num_blocks = first.shape[block_dim]
    if block_stride <= 0 or plane_stride <= 0:
        raise LayoutError(f"negative or zero strides {first.strides}")
    single = Layout(
        num_layers=1,
        planes_per_layer=planes,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        layer_stride=0,
        plane_stride=plane_stride,
        block_stride=block_stride,
    )
    layer_extent = single.extent()
    if len(views) == 1:
        layer_stride = layer_extent
    else:
        gaps = {b.address - a.address for a, b in zip(views, views[1:])}
        if len(gaps) != 1:
            raise LayersNotEvenlySpaced(
                "layers are not evenly spaced in one allocation; register each layer "
                "as its own region"
            )
        layer_stride = gaps.pop()
        if layer_stride < layer_extent:
            raise LayoutError(
                f"layers {layer_stride} bytes apart overlap ({layer_extent} bytes each)"
            )
    return PagedLayout(
        layout=replace(single, num_layers=len(views), layer_stride=layer_stride),
        address=first.address,
        device=first.device,
    )
