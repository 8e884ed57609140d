"""vLLM's KV cache blocks as the paged cache ``TriAttentionManager`` rounds run on (pure torch: nothing here
imports vLLM).

The manager reads a cache through a small interface (``length``, ``resident``, ``page_table``, ``shrink``,
``views``, ``page_size``, ``device``, ``num_kv_heads``, ``head_dim``: ``kvops.cache.PagedKVCache`` is the
reference). ``BlockCache`` gives it over an engine's block pool: the engine's worker tells it each request's
length and block ids (its block-table row) and hears, through ``on_shrink``, how many blocks a round left a
request.

Where the pages are a kvops pool as they are (vLLM's GPU backends, ``layouts.BlockLayout.zero_copy``), a round
reads and moves tokens in vLLM's pages. vLLM's CPU backend packs K transposed, so a round's requests are gathered
into a staging pool first (``stage``), the round runs there, and ``shrink`` scatters the blocks each request keeps
back into its own; that costs two copies of the due requests' KV per round (benchmarks/bench_vllm.py measures it).

``physical_length`` is the rule both vLLM processes share: the scheduler sizes block allocations by it and the
worker checks every round against it.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import triton

from .layouts import BlockLayout


def physical_length(prompt: int, length: int, budget: int, beta: int) -> int:
    """The tokens a request holds once `length` tokens (logical, the prompt's `prompt` first) have been written
    and its due rounds have run, under ``TriAttentionManager``'s rule with one token written per decode step: a
    round is due when the decode tokens held exceed `budget` and `beta` were written since the last round (or
    since the prompt), and leaves `budget` of them. The first round comes at max(budget + 1, beta) decode
    tokens, every later one `beta` tokens after it."""
    decoded, first = length - prompt, max(budget + 1, beta)
    if decoded < first:
        return length
    return prompt + budget + (decoded - first) % beta


class BlockCache:
    """The manager's paged-cache interface over an engine's blocks: `pages` are every layer's blocks (vLLM's int8
    pages ``[num_blocks, page_bytes]``), all of `layout`. The engine keeps `lengths` (request id -> tokens held)
    current before each hook and answers `block_ids(rid)` (the request's blocks in order); after a round,
    ``shrink`` calls ``on_shrink(rid, blocks)`` with the blocks the request still needs."""

    def __init__(self, pages: Sequence[torch.Tensor], layout: BlockLayout,
                 block_ids: Callable[[object], Sequence[int]], on_shrink: Callable[[object, int], None]):
        if not pages:
            raise ValueError("kvops BlockCache: no layers")
        self.layout, self.block_ids, self.on_shrink = layout, block_ids, on_shrink
        self.page_size, self.num_kv_heads, self.head_dim = layout.tokens, layout.heads, layout.head_size
        self.device = pages[0].device
        self.lengths: dict = {}
        self.staging_seconds = 0.0
        if layout.zero_copy:  # [blocks, heads, tokens, 2, dim] -> the compaction's [page, plane, head, token, dim]
            self._views = [layout.pool(p).permute(0, 3, 1, 2, 4) for p in pages]
            self._planes = None
        else:
            self._planes = [layout.planes(p) for p in pages]
            self._staged: dict = {}  # request id -> (first staging page, blocks), for the round being run
            self._allocate(1)

    # -- the manager's interface ----------------------------------------------------------------------------
    def views(self) -> list[torch.Tensor]:
        """Per-layer 5-D [page, plane, head, token, dim] views: vLLM's pages, or the staging pools."""
        return self._views

    @property
    def pools(self) -> list[torch.Tensor]:
        return self._views

    def length(self, rid) -> int:
        return self.lengths[rid]

    def resident(self, rid) -> bool:
        return rid in self.lengths

    def page_table(self, rids: Sequence, width: int, device=None) -> torch.Tensor:
        """int32 [R, width], -1 past each request's pages: its block ids, or its staging pages."""
        table = torch.full((len(rids), width), -1, dtype=torch.int32)
        for i, rid in enumerate(rids):
            if self._planes is None:
                ids = torch.as_tensor(list(self.block_ids(rid))[:width], dtype=torch.int32)
            else:  # the blocks below the staged ones are neither read nor moved: -1 as past the end
                first, skip, blocks = self._staged[rid]
                ids = torch.cat([torch.full((skip,), -1, dtype=torch.int32),
                                 torch.arange(first, first + len(blocks), dtype=torch.int32)])
            table[i, :len(ids)] = ids
        return table if device is None else table.to(device)

    def shrink(self, rids: Sequence, new_lengths: Sequence[int]) -> None:
        """A round left each request `new_lengths[i]` tokens: staged ones get the blocks they keep back; every one
        tells the engine how many blocks it still needs."""
        for rid, n in zip(rids, new_lengths):
            if not 0 <= n <= self.lengths[rid]:
                raise ValueError(f"kvops BlockCache.shrink: request {rid!r} holds {self.lengths[rid]} tokens, a "
                                 f"round cannot leave it {n}")
        keep = [triton.cdiv(n, self.page_size) for n in new_lengths]
        if self._planes is not None:
            for rid, k in zip(rids, keep):
                first, skip, blocks = self._staged.pop(rid)
                self._move(False, blocks[:k - skip], first)
        for rid, n, k in zip(rids, new_lengths, keep):
            self.lengths[rid] = n
            self.on_shrink(rid, k)

    # -- staging (vLLM's CPU backend) -----------------------------------------------------------------------
    @property
    def staged(self) -> bool:
        return self._planes is not None

    def stage(self, rids: Sequence, protected: Sequence[int]) -> bool:
        """Copies the requests' blocks into the staging pools before their round (a no-op for zero-copy pages),
        but those wholly inside each request's first `protected` tokens (its prompt and sinks, which a round
        neither reads nor moves). Returns True when the staging pools were reallocated: the manager must bind
        them again (``TriAttentionManager.rebind``)."""
        if self._planes is None or not rids:
            return False
        N, blocks, skips = self.page_size, [], []
        for rid, p in zip(rids, protected):
            if not 0 <= p <= self.lengths[rid]:
                raise ValueError(f"kvops BlockCache.stage: request {rid!r} holds {self.lengths[rid]} tokens, "
                                 f"{p} protected")
            ids = list(self.block_ids(rid))[p // N:triton.cdiv(self.lengths[rid], N)]
            blocks.append(torch.as_tensor(ids, dtype=torch.long))
            skips.append(p // N)
        need = max(sum(len(b) for b in blocks), 1)
        grown = self._views[0].shape[0] < need
        if grown:  # in powers of two, so rounds of similar sizes reuse one binding
            self._allocate(1 << (need - 1).bit_length())
        self._staged.clear()
        first = 0
        for rid, skip, b in zip(rids, skips, blocks):
            self._staged[rid] = (first, skip, b)
            self._move(True, b, first)
            first += len(b)
        return grown

    def _allocate(self, pages: int) -> None:
        shape = (pages, 2, self.num_kv_heads, self.page_size, self.head_dim)
        self._views = [torch.empty(shape, dtype=self.layout.dtype, device=self.device) for _ in self._planes]

    def _move(self, gather: bool, blocks: torch.Tensor, first: int) -> None:
        """Staging pages first.. <-> vLLM blocks `blocks`, every layer (host time in ``staging_seconds``)."""
        start = time.perf_counter()
        for planes, view in zip(self._planes, self._views):
            staging = view[first:first + len(blocks)].transpose(1, 2)  # the layout's [n, heads, 2, tokens, dim]
            if gather:
                self.layout.gather(planes, blocks, staging)
            else:
                self.layout.scatter(planes, blocks, staging)
        self.staging_seconds += time.perf_counter() - start
