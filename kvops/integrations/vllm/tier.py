"""A host tier of cold blocks: one kvops cold page (``kvops.codecs``) per block across every layer.

Engine-neutral (nothing here imports vLLM): ``BlobTier`` takes each layer's block pages as vLLM lays them out
(``layouts.BlockLayout``), a ``ColdPageCodec`` and a slot count, and moves blocks between the cache and slots of
host memory. On the GPU a transfer is one fused kernel per direction, enqueued on a side stream per direction
(each after the work already on the current stream, in submission order) and finished when its event has fired;
with ``staged`` the copy engine moves the cold pages (``PageBlobCodec``, "Staged transfers"). On the CPU a transfer
gathers the blocks into a staging pool, encodes it and is done when the call returns (the CPU backend has no copy
engine to overlap with, and a thread would compete with the forward's OpenMP threads for the same cores).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ...codecs import ColdPageCodec, LayerGroupPools
from ...nvfp4 import plan_layout
from .layouts import BlockLayout

STAGING_BLOCKS = 16  # CPU: blocks gathered per encode (the staging pools' pages)


def _group(layouts: Sequence[BlockLayout], pools: Sequence[torch.Tensor]) -> LayerGroupPools:
    planes = {lay.plane_dim for lay in layouts}
    if len(planes) != 1 or len({lay.zero_copy for lay in layouts}) != 1:
        raise ValueError("kvops BlobTier: every layer must have the same kind of block layout, got "
                         f"{sorted({(lay.backend, lay.isa) for lay in layouts}, key=str)}")
    return LayerGroupPools(0, tuple(pools), planes.pop())


def cold_block_bytes(layouts: Sequence[BlockLayout], codec: ColdPageCodec) -> int:
    """The bytes of one block's cold page across these layers, without any tensor (a scheduler sizes the tier)."""
    pools = [torch.empty(lay.pool_shape(1), dtype=lay.dtype, device="meta") for lay in layouts]
    group = _group(layouts, pools)
    spec = codec.row_spec(group)
    return plan_layout([(tuple(p.shape), p.dtype) for p in pools], [spec] * len(pools))[1]


@dataclass
class Transfer:
    """One store or load: done once ``done()`` says so (a GPU transfer's event fired; a CPU one at once)."""

    blocks: int
    cold_bytes: int
    seconds: float | None = None
    _events: tuple | None = None
    _keep: list = field(default_factory=list)  # the pinned pairs the kernel reads, until it has

    def done(self) -> bool:
        if self._events is None:
            return True
        if not self._events[1].query():
            return False
        self._finish()
        return True

    def wait(self) -> None:
        if self._events is not None:
            self._events[1].synchronize()
            self._finish()

    def _finish(self) -> None:
        start, end = self._events
        self.seconds = start.elapsed_time(end) / 1e3
        self._events, self._keep = None, []


class BlobTier:
    """Cold pages of a paged cache's blocks in host memory (pinned where CUDA is).

    pages: per layer, its blocks as int8 ``[num_blocks, page_bytes]`` (vLLM's offloading view); layouts: per layer,
    how a page holds K and V; codec: an unconfigured ``NVFP4ColdPageCodec`` or ``LosslessColdPageCodec``;
    num_slots: cold pages held. ``store``/``load`` return a ``Transfer``; ``stats`` counts blocks and bytes."""

    def __init__(self, pages: Sequence[torch.Tensor], layouts: Sequence[BlockLayout], codec: ColdPageCodec,
                 num_slots: int, staged: bool = False):
        what = "kvops BlobTier"
        if len(pages) != len(layouts) or not pages:
            raise ValueError(f"{what}: one layout per layer's pages, got {len(pages)} pages and {len(layouts)} "
                             "layouts")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"{what}: num_slots must be a positive int, got {num_slots!r}")
        self.layouts = list(layouts)
        self.device = pages[0].device
        self.num_blocks = pages[0].shape[0]
        if any(p.shape[0] != self.num_blocks for p in pages):
            raise ValueError(f"{what}: every layer must have the same number of blocks, got "
                             f"{sorted({p.shape[0] for p in pages})}")
        self.zero_copy = layouts[0].zero_copy
        if self.zero_copy:
            self._planes = None
            pools = [lay.pool(p) for lay, p in zip(layouts, pages)]
        else:
            self._planes = [lay.planes(p) for lay, p in zip(layouts, pages)]
            pools = [torch.empty(lay.pool_shape(STAGING_BLOCKS), dtype=lay.dtype, device=self.device)
                     for lay in layouts]
        self._pools = pools
        self.codec = codec
        if not codec.configure([_group(layouts, pools)]):
            raise ValueError(f"{what}: the codec cannot lay out these blocks: {codec.configure_error}")
        self.cold_page_bytes = codec.cold_page_bytes(0)
        self.hot_page_bytes = sum(lay.page_bytes for lay in layouts)
        cuda = self.device.type == "cuda"
        if staged and not cuda:
            raise ValueError(f"{what}: staged transfers need the cache on a GPU, got {self.device}")
        self.staged = staged
        self.slots = torch.zeros(num_slots, self.cold_page_bytes, dtype=torch.uint8, pin_memory=cuda)
        self._tags = self.slots.numpy()[:, :4].view(np.uint32)[:, 0]  # each slot's first word, read in place
        self._tag = codec.layout_tag(0)
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if cuda else None
        self.stats = {"stored_blocks": 0, "loaded_blocks": 0, "stored_bytes": 0, "loaded_bytes": 0}

    def _pairs(self, first: np.ndarray, second: np.ndarray) -> torch.Tensor:
        pairs = torch.from_numpy(np.stack([first, second], axis=1).astype(np.int32))
        return pairs.pin_memory() if self._streams is not None else pairs

    def _check(self, what: str, blocks, slots) -> tuple[np.ndarray, np.ndarray]:
        blocks, slots = np.asarray(blocks).reshape(-1), np.asarray(slots).reshape(-1)
        for name, ids in (("blocks", blocks), ("slots", slots)):
            if ids.size and ids.dtype.kind not in "iu":
                raise TypeError(f"kvops BlobTier.{what}: {name} must be integers, got {ids.dtype}")
        blocks, slots = blocks.astype(np.int64), slots.astype(np.int64)
        if blocks.shape != slots.shape:
            raise ValueError(f"kvops BlobTier.{what}: {blocks.size} blocks for {slots.size} slots")
        for name, ids, bound in (("blocks", blocks, self.num_blocks), ("slots", slots, self.slots.shape[0])):
            if ids.size and (ids.min() < 0 or ids.max() >= bound):
                raise ValueError(f"kvops BlobTier.{what}: {name} must lie in [0, {bound}), got "
                                 f"{ids[(ids < 0) | (ids >= bound)][:4].tolist()}")
        if np.unique(blocks if what == "load" else slots).size != blocks.size:
            raise ValueError(f"kvops BlobTier.{what}: each {'block' if what == 'load' else 'slot'} may be written "
                             "once per call")
        if what == "load":  # every slot one of this tier's cold pages (a host read: the slots live in host memory)
            stale = slots[self._tags[slots] != self._tag]
            if stale.size:
                raise ValueError(f"kvops BlobTier.load: slots {stale[:4].tolist()} hold no cold page of this tier "
                                 "(never stored, or overwritten)")
        return blocks, slots

    def store(self, blocks, slots) -> Transfer:
        """Encode ``blocks[i]`` into ``slots[i]``."""
        return self._move(True, *self._check("store", blocks, slots))

    def load(self, slots, blocks) -> Transfer:
        """Decode ``slots[i]`` into ``blocks[i]``. A slot that holds no cold page of this tier (never stored) raises
        ValueError before anything is written; one whose scales are corrupt raises on the CPU, and on the GPU leaves
        its block as it was and counts in ``refused()``."""
        return self._move(False, *self._check("load", blocks, slots))

    def _move(self, store: bool, blocks: np.ndarray, slots: np.ndarray) -> Transfer:
        n = blocks.size
        if self._streams is not None:  # the codec's pairs: (slot, block) to encode, (block, slot) to decode
            if store:
                run = lambda pairs: self.codec.encode(0, self.slots, pairs, staged=self.staged)  # noqa: E731
            else:
                run = lambda pairs: self.codec.decode(0, self.slots, pairs, staged=self.staged)  # noqa: E731
            transfer = self._on_gpu(0 if store else 1, run, self._pairs(slots, blocks) if store else
                                    self._pairs(blocks, slots), n)
            return self._count(store, transfer)
        start = time.perf_counter()
        for i in range(0, n, STAGING_BLOCKS):  # through the staging pools, STAGING_BLOCKS at a time
            chunk, part = torch.from_numpy(blocks[i:i + STAGING_BLOCKS]), slots[i:i + STAGING_BLOCKS]
            staged = np.arange(part.size)
            if store:
                for lay, planes, pool in zip(self.layouts, self._planes, self._pools):
                    lay.gather(planes, chunk, pool[:part.size])
                self.codec.encode(0, self.slots, self._pairs(part, staged))
            else:
                self.codec.decode(0, self.slots, self._pairs(staged, part), validate=True)
                for lay, planes, pool in zip(self.layouts, self._planes, self._pools):
                    lay.scatter(planes, chunk, pool[:part.size])
        return self._count(store, Transfer(n, n * self.cold_page_bytes, time.perf_counter() - start))

    def _count(self, store: bool, transfer: Transfer) -> Transfer:
        """Counts a transfer once it is enqueued (GPU) or done (CPU): a refused one counts nothing."""
        done = "stored" if store else "loaded"
        self.stats[f"{done}_blocks"] += transfer.blocks
        self.stats[f"{done}_bytes"] += transfer.cold_bytes
        return transfer

    def _on_gpu(self, direction: int, run, pairs: torch.Tensor, n: int) -> Transfer:
        stream = self._streams[direction]
        # a store reads what the forward wrote; a load writes blocks the current stream may still be zeroing
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            run(pairs)
            end.record(stream)
        return Transfer(n, n * self.cold_page_bytes, _events=(start, end), _keep=[pairs])

    def refused(self) -> int:
        """Planes a GPU load left untouched because their slot held no valid cold page (a host read)."""
        return int(self.codec.refused(0))
