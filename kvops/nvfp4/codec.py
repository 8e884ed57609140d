"""ColdPageCodec: a paged-KV page <-> one fixed-size NVFP4 blob, in one fused kernel per direction."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .layout import PoolLayout, RowSpec, plan_layout


class ColdPageCodec:
    """Encodes the rows of page indices across several hot pools into fixed-size cold pages.

    pools: the hot pools (or anything with .shape and .dtype): dim 0 is the page index, the last dim
        is the row (contiguous); any dims between. specs: one RowSpec per pool.
    The layout is fixed at construction (see kvops.nvfp4.layout for the blob format). Calls take the
    pools again, which must keep those shapes and dtypes; strides are read per call.
    """

    def __init__(self, pools: Sequence, specs: Sequence[RowSpec]):
        self.specs = list(specs)
        self.layouts: list[PoolLayout]
        self.layouts, self.cold_page_bytes = plan_layout([(tuple(p.shape), p.dtype) for p in pools], self.specs)
        self.plan = [v for lay in self.layouts for v in lay.plan()]

    @property
    def hot_page_bytes(self) -> int:
        """Bytes of one page across all pools in the hot dtype."""
        return sum(math.prod(lay.shape[1:]) * torch.empty((), dtype=lay.dtype).element_size() for lay in self.layouts)

    def allocate(self, num_slots: int, device: torch.device | str = "cpu", pin_memory: bool | None = None) -> torch.Tensor:
        """Zeroed cold pages [num_slots, cold_page_bytes]; host memory is pinned when CUDA is available."""
        device = torch.device(device)
        if pin_memory is None:
            pin_memory = device.type == "cpu" and torch.cuda.is_available()
        return torch.zeros(num_slots, self.cold_page_bytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)

    def _check(self, pools: Sequence[torch.Tensor], cold_pages: torch.Tensor) -> None:
        if len(pools) != len(self.layouts):
            raise ValueError(f"pools: expected {len(self.layouts)} pools, got {len(pools)}")
        for i, (p, lay) in enumerate(zip(pools, self.layouts)):
            if tuple(p.shape) != lay.shape or p.dtype != lay.dtype:
                raise ValueError(f"pools[{i}]: configured as {lay.shape} {lay.dtype}, got {tuple(p.shape)} {p.dtype}")
        if cold_pages.dim() != 2 or cold_pages.shape[1] != self.cold_page_bytes:
            raise ValueError(f"cold_pages: expected [num_slots, {self.cold_page_bytes}], got {tuple(cold_pages.shape)}")

    def encode(self, pools: Sequence[torch.Tensor], cold_pages: torch.Tensor, page_pairs: torch.Tensor,
               validate: bool = False) -> None:
        """cold_pages[slot] <- encode(pages) for each (slot, page) row of int32 page_pairs [n, 2].

        Enqueued on the current stream; no host sync, no allocation. cold_pages may be pinned host
        memory (written directly by the kernel). page_pairs may be on the device or pinned host;
        host-resident pairs are range-checked before launch, device-resident ones when validate=True.
        """
        self._check(pools, cold_pages)
        torch.ops.kvops.nvfp4_encode_pages(list(pools), cold_pages, page_pairs, self.plan, validate)

    def decode(self, cold_pages: torch.Tensor, pools: Sequence[torch.Tensor], page_pairs: torch.Tensor,
               validate: bool = False) -> None:
        """pools[page] <- decode(cold_pages[slot]) for each (page, slot) row of page_pairs; hot dtype restored."""
        self._check(pools, cold_pages)
        torch.ops.kvops.nvfp4_decode_pages(cold_pages, list(pools), page_pairs, self.plan, validate)
