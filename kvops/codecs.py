"""The cold-page codec interface an engine's page migration calls, and its two implementations.

An engine describes each layer group's pools once (``configure``); afterwards it asks for the fixed cold-page
size, which groups may share one call, where the page indices must live, and encodes or decodes batches of
(cold slot, page) pairs on a stream. ``NVFP4ColdPageCodec`` compresses (kvops.nvfp4); ``LosslessColdPageCodec``
concatenates the rows bit-exactly with the same kernels, so the cold-page machinery can be tested without
compression.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

from ._checks import check_bool, check_disjoint, check_int
from .config import NVFP4ColdPageConfig
from .nvfp4 import PageBlobCodec, RowSpec


@dataclass(frozen=True)
class LayerGroupPools:
    """One layer group's pools: the tensors of a page (dim 0 is the page, the last dim the row) and the dim
    holding K/V (None when K and V are separate pools or there is one plane)."""

    layer_group: int
    pools: tuple[torch.Tensor, ...]
    plane_dim: int | None = 1

    def __post_init__(self):
        what = "LayerGroupPools"
        check_int(what, "layer_group", self.layer_group)
        if not isinstance(self.pools, (list, tuple)) or not self.pools:
            raise TypeError(f"{what}: pools must be a non-empty list or tuple of tensors, got "
                            f"{type(self.pools).__name__} {self.pools!r}"[:300])
        for i, pool in enumerate(self.pools):
            if not isinstance(pool, torch.Tensor):
                raise TypeError(f"{what}: pools[{i}] must be a tensor, got {type(pool).__name__}")
        object.__setattr__(self, "pools", tuple(self.pools))
        if self.plane_dim is not None:
            check_int(what, "plane_dim", self.plane_dim, 1)


class ColdPageCodec:
    """The engine-facing interface: configure -> cold_page_bytes / batching_layer_group_id / page_index_location
    -> encode / decode, per layer group. Each group is served by a kernel-level ``kvops.nvfp4.PageBlobCodec``."""

    def __init__(self):
        self._codecs: dict[int, PageBlobCodec] = {}
        self._pools: dict[int, tuple[torch.Tensor, ...]] = {}
        self._batch_ids: dict[int, int] = {}
        self.configure_error: str | None = None  # why the last configure() returned False

    def row_spec(self, group: LayerGroupPools) -> RowSpec:
        raise NotImplementedError

    def configure(self, groups: Sequence[LayerGroupPools]) -> bool:
        """Plan every layer group, replacing the previous configuration; False (and the previous configuration
        kept) when a group's layout cannot be expressed, with the reason in ``configure_error``. Caller errors
        raise, changing nothing: TypeError for an item that is not a LayerGroupPools, ValueError for a layer group
        id given twice."""
        what = f"{type(self).__name__}.configure"
        if not isinstance(groups, (list, tuple)):
            raise TypeError(f"{what}: groups must be a list or tuple of LayerGroupPools, got {type(groups).__name__}")
        for i, group in enumerate(groups):
            if not isinstance(group, LayerGroupPools):
                raise TypeError(f"{what}: groups[{i}] must be a LayerGroupPools, got {type(group).__name__}")
        ids = [group.layer_group for group in groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}: layer group ids must be distinct, got {ids}")
        codecs, signatures = {}, {}
        for group in groups:
            try:
                codec = PageBlobCodec(group.pools, [self.row_spec(group)] * len(group.pools))
                # every later call's checks of the pools, now: a decode of no pages (the pools are its outputs)
                device = group.pools[0].device
                codec.decode(torch.empty(0, codec.cold_page_bytes, dtype=torch.uint8, device=device), group.pools,
                             torch.empty(0, 2, dtype=torch.int32, device=device))
            except ValueError as e:
                self.configure_error = f"layer group {group.layer_group}: {e}"
                return False
            codecs[group.layer_group] = codec
            # Groups batch together only when everything the kernel reads from them is identical.
            signatures[group.layer_group] = tuple((tuple(p.shape), tuple(p.stride()), p.dtype, p.device)
                                                  for p in group.pools) + (self.row_spec(group),)
        # a pool in two groups would be encoded or decoded twice (within a group the decode above refused it)
        check_disjoint(what, "the groups' pools (in order)", [p for group in groups for p in group.pools])
        first: dict[tuple, int] = {}
        self._batch_ids = {g: first.setdefault(sig, g) for g, sig in signatures.items()}
        self._codecs, self.configure_error = codecs, None
        self._pools = {d.layer_group: tuple(d.pools) for d in groups}
        return True

    def _codec(self, layer_group: int) -> PageBlobCodec:
        check_int(type(self).__name__, "layer_group", layer_group)
        if layer_group not in self._codecs:
            raise ValueError(f"{type(self).__name__}: layer group {layer_group} is not configured")
        return self._codecs[layer_group]

    def cold_page_bytes(self, layer_group: int) -> int:
        return self._codec(layer_group).cold_page_bytes

    def layout_tag(self, layer_group: int) -> int:
        """The uint32 every cold page of the group begins with (its first section's layout tag, kvops.nvfp4.layout):
        a host-side check that a slot holds one of this group's pages, before decoding it."""
        return self._codec(layer_group).layouts[0].tag

    def batching_layer_group_id(self, layer_group: int) -> int:
        """Groups with the same id have provably identical layouts (shapes, strides, dtypes, row specs)."""
        self._codec(layer_group)
        return self._batch_ids[layer_group]

    def page_index_location(self, layer_group: int) -> str:
        """'device' or 'host': the kernels take page pairs from either; device pairs avoid a copy per call."""
        self._codec(layer_group)
        return "device" if self._pools[layer_group][0].is_cuda else "host"

    @staticmethod
    def _on(stream):
        if stream is None:
            return contextlib.nullcontext()
        if not isinstance(stream, torch.cuda.Stream):  # torch.cuda.stream() would ignore anything else silently
            raise TypeError(f"ColdPageCodec: stream must be None or a torch.cuda.Stream, got {type(stream).__name__}")
        return torch.cuda.stream(stream)

    def encode(self, layer_group: int, dst_base: torch.Tensor, page_pairs: torch.Tensor, stream=None,
               staged: bool = False) -> None:
        """Encode pages into cold slots: page_pairs int32 [N, 2] of (slot in dst_base, page). `staged`: through a
        device buffer and the copy engine, for a pinned host dst_base and host pairs (``PageBlobCodec.encode``)."""
        codec = self._codec(layer_group)
        if isinstance(dst_base, torch.Tensor):  # the group's own pools: PageBlobCodec.encode checks them
            check_disjoint(f"{type(self).__name__}.encode", "the other groups' pools",
                           [p for g, pools in self._pools.items() if g != layer_group for p in pools],
                           [("dst_base", dst_base)])
        with self._on(stream):
            codec.encode(self._pools[layer_group], dst_base, page_pairs, staged=staged)

    def decode(self, layer_group: int, src_base: torch.Tensor, page_pairs: torch.Tensor, stream=None,
               validate: bool = False, staged: bool = False) -> None:
        """Decode cold slots into pages: page_pairs int32 [N, 2] of (page, slot in src_base). A plane whose slot
        holds no valid global scale (never encoded, or corrupt) is left untouched and counted in
        ``refused(layer_group)``; with validate, every slot's scales are read first (a sync) and such a slot raises
        ValueError before anything is written. `staged`: as for ``encode``."""
        check_bool(f"{type(self).__name__}.decode", "validate", validate)
        with self._on(stream):
            self._codec(layer_group).decode(src_base, self._pools[layer_group], page_pairs, validate=validate,
                                            staged=staged)

    def refused(self, layer_group: int) -> torch.Tensor:
        """The group's decode refusal counter (``kvops.nvfp4.PageBlobCodec.refused``) on its pools' device."""
        return self._codec(layer_group).refused(self._pools[layer_group][0].device)


class LosslessColdPageCodec(ColdPageCodec):
    def row_spec(self, group: LayerGroupPools) -> RowSpec:
        return RowSpec.lossless(plane_dim=group.plane_dim)


class NVFP4ColdPageCodec(ColdPageCodec):
    def __init__(self, config: NVFP4ColdPageConfig):
        super().__init__()
        if not isinstance(config, NVFP4ColdPageConfig):
            raise TypeError(f"NVFP4ColdPageCodec: config must be an NVFP4ColdPageConfig, got {type(config).__name__}")
        self.config = config

    def row_spec(self, group: LayerGroupPools) -> RowSpec:
        spec = self.config.row_spec()
        return RowSpec(spec.quantized_range, spec.residual_range, spec.global_scale, group.plane_dim)
