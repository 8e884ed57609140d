"""PageBlobCodec: a paged-KV page <-> one fixed-size NVFP4 blob, in one fused kernel per direction."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .._checks import (as_device, check_bool, check_device, check_device_or_host, check_disjoint, check_int,
                       overlap)
from .layout import PoolLayout, RowSpec, plan_layout


STAGING_BYTES = 64 << 20  # a staged transfer's device buffer, at least (PageBlobCodec's staging_rows)


class PageBlobCodec:
    """The kernel-level codec: encodes the rows of page indices across several hot pools into fixed-size blobs
    (cold pages), one fused kernel per direction. Engines usually reach it through ``kvops.codecs``, whose
    ``ColdPageCodec`` interface configures one per layer group.

    pools: the hot pools (or anything with .shape and .dtype): dim 0 is the page index, the last dim
        is the row (contiguous); any dims between; every dim but the page dim non-empty (refused here
        otherwise). specs: one RowSpec per pool.
    The layout is fixed at construction (see kvops.nvfp4.layout for the blob format). Calls take the
    pools again, which must keep those shapes and dtypes; strides are read per call.
    staging_rows: the cold pages a staged transfer's device buffer holds (``encode``/``decode`` with
        ``staged=True``; docs/nvfp4.md, "Staged transfers"); default max(4, 64 MiB / cold_page_bytes), as
        TensorRT-LLM sizes its own (max(64 MiB, 3 pages)). One buffer per direction and device, allocated at the
        first staged call.
    """

    def __init__(self, pools: Sequence, specs: Sequence[RowSpec], staging_rows: int | None = None):
        what = "PageBlobCodec"
        if not isinstance(pools, (list, tuple)) or not isinstance(specs, (list, tuple)):
            raise TypeError(f"{what}: pools and specs must be lists, got {type(pools).__name__} and "
                            f"{type(specs).__name__}")
        for i, p in enumerate(pools):
            if not (hasattr(p, "shape") and hasattr(p, "dtype")):
                raise TypeError(f"{what}: pools[{i}] must be a tensor (or have .shape and .dtype), got "
                                f"{type(p).__name__}")
        self.specs = list(specs)
        self.layouts: list[PoolLayout]
        self.layouts, self.cold_page_bytes = plan_layout([(tuple(p.shape), p.dtype) for p in pools], self.specs)
        self.plan = [v for lay in self.layouts for v in lay.plan()]
        self._refused: dict[torch.device, torch.Tensor] = {}
        if staging_rows is None:
            staging_rows = max(4, -(-STAGING_BYTES // max(self.cold_page_bytes, 1)))
        check_int(what, "staging_rows", staging_rows, 2)
        self.staging_rows = staging_rows
        self._staging: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def refused(self, device: torch.device | str) -> torch.Tensor:
        """int32 [1] on `device`: how many (page, pool, plane)s decode has left untouched on that device because
        their blob's global scale was not positive and finite (a slot never encoded, or corrupt). decode adds to
        it on the device, without a sync; read it with ``int(...)``, reset it with ``.zero_()``. Call this once
        before capturing decodes in a CUDA graph (it allocates the counter the first time)."""
        device = as_device("PageBlobCodec.refused", device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._refused:
            self._refused[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._refused[device]

    @property
    def hot_page_bytes(self) -> int:
        """Bytes of one page across all pools in the hot dtype."""
        return sum(math.prod(lay.shape[1:]) * lay.dtype.itemsize for lay in self.layouts)

    def allocate(self, num_slots: int, device: torch.device | str = "cpu", pin_memory: bool | None = None) -> torch.Tensor:
        """Zeroed cold pages [num_slots, cold_page_bytes]; host memory is pinned when CUDA is available (or as
        `pin_memory` says)."""
        check_int("PageBlobCodec.allocate", "num_slots", num_slots)
        if pin_memory is not None:
            check_bool("PageBlobCodec.allocate", "pin_memory", pin_memory)
        device = as_device("PageBlobCodec.allocate", device)
        if device.type == "meta":
            raise ValueError("PageBlobCodec.allocate: device must be a real device (the codec writes the cold pages), "
                             "got meta")
        if pin_memory is None:
            pin_memory = device.type == "cpu" and torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():  # torch would say "Found no NVIDIA driver"
            raise ValueError("PageBlobCodec.allocate: pin_memory=True needs CUDA, which this process does not have")
        return torch.zeros(num_slots, self.cold_page_bytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)

    def _check(self, what: str, pools: Sequence[torch.Tensor], cold_pages: torch.Tensor,
               page_pairs: torch.Tensor) -> None:
        if not isinstance(pools, (list, tuple)) or len(pools) != len(self.layouts):
            raise ValueError(f"{what}: pools must be a list of {len(self.layouts)} pools, got "
                             f"{len(pools) if isinstance(pools, (list, tuple)) else type(pools).__name__}")
        device = check_device(what, pools=pools)
        check_device_or_host(what, device, cold_pages=cold_pages, page_pairs=page_pairs)
        for i, (p, lay) in enumerate(zip(pools, self.layouts)):
            if tuple(p.shape) != lay.shape or p.dtype != lay.dtype:
                raise ValueError(f"{what}: pools[{i}] was configured as {lay.shape} {lay.dtype}, got "
                                 f"{tuple(p.shape)} {p.dtype}")
        if cold_pages.dim() != 2 or cold_pages.shape[1] != self.cold_page_bytes:
            raise ValueError(f"{what}: cold_pages must be [num_slots, {self.cold_page_bytes}], got "
                             f"{tuple(cold_pages.shape)}")
        # page_pairs too: a call that wrote over its own pairs would read garbage pairs after the first
        check_disjoint(what, "pools", pools, [("cold_pages", cold_pages), ("page_pairs", page_pairs)])
        if overlap(page_pairs, cold_pages):
            raise ValueError(f"{what}: page_pairs shares memory with cold_pages")

    def _staging_buffer(self, what: str, pools: Sequence[torch.Tensor], cold_pages: torch.Tensor,
                        page_pairs: torch.Tensor, staged: bool, encode: bool):
        """The device buffer of a staged call in this direction (allocated once), or None. A call the staged path
        cannot serve is refused before the buffer is allocated (the op checks the same again)."""
        check_bool(what, "staged", staged)
        if not staged:
            return None
        device = pools[0].device
        if device.type != "cuda":
            raise ValueError(f"{what}: staged transfers need the pools on the GPU, got {device}")

        def where(t: torch.Tensor) -> str:
            return f"on {t.device}" if not t.is_cpu else "in pinned host memory" if t.is_pinned() else \
                "in pageable host memory"

        if not (cold_pages.is_cpu and cold_pages.is_pinned() and page_pairs.is_cpu and page_pairs.is_pinned()):
            raise ValueError(f"{what}: staging serves cold_pages in pinned host memory with page_pairs in pinned "
                             f"host memory; got cold_pages {where(cold_pages)} and page_pairs {where(page_pairs)}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, encode)
        if key not in self._staging:
            self._staging[key] = torch.empty(self.staging_rows, self.cold_page_bytes, dtype=torch.uint8, device=device)
        return self._staging[key]

    @property
    def staging_bytes(self) -> int:
        """Device bytes of one staged direction's buffer (``staging_rows`` cold pages)."""
        return self.staging_rows * self.cold_page_bytes

    def encode(self, pools: Sequence[torch.Tensor], cold_pages: torch.Tensor, page_pairs: torch.Tensor,
               validate: bool = False, staged: bool = False) -> None:
        """Encode pages into blobs: ``cold_pages[slot] <- encode(pools[:][page])`` for each pair.

        Parameters
        ----------
        pools : list of torch.Tensor
            The pools the codec was configured with (same shapes and dtypes; strides are read per call), on one
            device, sharing no memory with each other or with cold_pages.
        cold_pages : torch.Tensor
            uint8 ``[slots, cold_page_bytes]`` on the pools' device or in pinned host memory, written in place by
            the kernel (so no two of its elements may share memory, as after an ``expand``).
        page_pairs : torch.Tensor
            int32 ``[n, 2]`` of (slot, page), on the device or pinned host.
        validate : bool
            Range-check device-resident pairs too (a sync); host-resident pairs are always checked.
        staged : bool
            For cold_pages in pinned host memory and page_pairs in pinned host memory: encode in chunks into a
            device buffer and let the copy engine move each chunk to the host, so the SMs work only for the
            encode (docs/nvfp4.md, "Staged transfers"). Same bytes as the direct call, which stores into the
            host memory from the kernel. Under a CUDA graph the copies' slots are the ones the pairs held at
            capture.

        Notes
        -----
        Enqueued on the current stream (a staged call also uses a side stream, ordered after the current one's
        earlier work and before its later work); no host sync, no allocation (but the staged buffer, at the first
        staged call: make that one before any capture). One staged encode at a time per codec and device.
        """
        self._check("PageBlobCodec.encode", pools, cold_pages, page_pairs)
        check_bool("PageBlobCodec.encode", "validate", validate)
        staging = self._staging_buffer("PageBlobCodec.encode", pools, cold_pages, page_pairs, staged, True)
        torch.ops.kvops.nvfp4_encode_pages_(list(pools), cold_pages, page_pairs, self.plan, validate, staging)

    def decode(self, cold_pages: torch.Tensor, pools: Sequence[torch.Tensor], page_pairs: torch.Tensor,
               validate: bool = False, staged: bool = False) -> None:
        """Decode blobs into pages, hot dtype restored: ``pools[:][page] <- decode(cold_pages[slot])``.

        Parameters
        ----------
        cold_pages : torch.Tensor
            uint8 ``[slots, cold_page_bytes]`` written by ``encode``, on the pools' device or pinned host.
        pools : list of torch.Tensor
            As for ``encode``; written in place (so no two elements of a pool may share memory).
        page_pairs : torch.Tensor
            int32 ``[n, 2]`` of (page, slot), on the device or pinned host.
        validate : bool
            Check device-resident pairs and read every pair's global scales back (a sync); a bad one raises
            ValueError naming the slot before anything is written.
        staged : bool
            The mirror of ``encode``'s: the copy engine moves chunks of host blobs into a device buffer and the
            kernels decode them from there. One staged decode at a time per codec and device.

        Notes
        -----
        Without validate, a plane whose blob holds a global scale that encode never writes (not positive and
        finite: a zeroed slot that was never encoded, or corruption) is left untouched and counted in
        ``refused(device)``.
        """
        self._check("PageBlobCodec.decode", pools, cold_pages, page_pairs)
        check_bool("PageBlobCodec.decode", "validate", validate)
        staging = self._staging_buffer("PageBlobCodec.decode", pools, cold_pages, page_pairs, staged, False)
        torch.ops.kvops.nvfp4_decode_pages_(cold_pages, list(pools), page_pairs, self.plan, validate,
                                           self.refused(pools[0].device), staging)
