"""Plain-torch references of compaction, the oracles the tests compare against.

- ``compact_reference`` (with ``fill_order`` and ``ring_order``): the semantics, gather everything then scatter,
  out of place; independent of the move lists and the kernels (it reads the decision directly).
- ``pack_move_sources_torch`` (with ``fill_lists_torch`` and ``moves_torch``): the move lists of pack.py in
  batched torch, the rule the Triton kernel and kvops::compaction_fill_lists_ follow (and the CPU path of
  ``kvops::compaction_pack_move_sources_`` in order).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .rows import decision_row

INT32_MAX = 2**31 - 1


def fill_order(kept_positions: list[int], base: int) -> list[int]:
    """Fill order, written out: the kept positions (then the tail), ascending, that lie below the new length
    stay; the evicted slots below it, ascending, take the others in ascending order. Returns the old position of
    what ends at base + m, for each m."""
    end = base + len(kept_positions)
    stay = {p for p in kept_positions if p < end}
    movers = iter(p for p in kept_positions if p >= end)
    return [p if p in stay else next(movers) for p in range(base, end)]


def ring_order(scored: int, base: int, K: int, offset: int) -> list[int]:
    """The window row as a ring, written out: the time order of the scored tokens is the ring's K slots from
    base + offset (wrapping at base + K), then the slots from base + K; the newest K are kept, and the i-th oldest
    of them ends at base + (offset + e + i) % K, e = scored - base - K being the number evicted. Returns the old
    position of what ends at base + m, for each m < K."""
    by_age = [base + (offset + j) % K for j in range(K)] + list(range(base + K, scored))
    e = scored - base - K
    landed = [0] * K
    for i, position in enumerate(by_age[e:]):
        landed[(offset + e + i) % K] = position
    return landed


def compact_reference(pools: Sequence[torch.Tensor], page_table: torch.Tensor, kept: torch.Tensor,
                      scored_lengths: torch.Tensor, tail_lengths: torch.Tensor, destination_bases: torch.Tensor,
                      layer_windows: Sequence[int] | None = None, order: str = "ordered",
                      window_offsets: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Returns (new pools as uint8 byte views [P, 2, H, T, row_bytes], new_lengths). order: "ordered" or "fill"
    (window layers compact in order, or with window_offsets as rings: ``ring_order``)."""
    src_bytes = [p.view(torch.uint8) for p in pools]  # bit-exact for every dtype
    out = [b.clone() for b in src_bytes]
    L, H, T = len(pools), pools[0].shape[2], pools[0].shape[3]
    R, rows, K = kept.shape
    windows = list(layer_windows or [0] * L)
    for r in range(R):
        scored, tail, base = int(scored_lengths[r]), int(tail_lengths[r]), int(destination_bases[r])
        tail_src = torch.arange(scored, scored + tail)
        for layer in range(L):
            for head in range(H):
                if windows[layer] > 0 and window_offsets is not None:
                    src = torch.tensor(ring_order(scored, base, K, int(window_offsets[r])), dtype=torch.long)
                elif windows[layer] > 0:
                    src = torch.arange(scored - K, scored)
                else:
                    src = kept[r, decision_row(rows, L, H, layer, head)].long().cpu()
                src = torch.cat([src, tail_src])
                if order == "fill" and windows[layer] == 0:
                    src = torch.tensor(fill_order(src.tolist(), base), dtype=torch.long)
                dst = base + torch.arange(src.numel())
                pt = page_table[r].long().cpu()
                values = src_bytes[layer][pt[src // T], :, head, src % T]
                out[layer][pt[dst // T], :, head, dst % T] = values
    return out, (destination_bases + K + tail_lengths).to(torch.int32)


def fill_lists_torch(kept, scored_lengths, tail_lengths, destination_bases, capacity):
    """The fill-mode lists of the decision rows, [R, rows, capacity] (the kernel's rule, with searchsorted)."""
    R, rows, K = kept.shape
    i = torch.arange(capacity, device=kept.device)
    scored, tail, base = (t.long()[:, None, None] for t in (scored_lengths, tail_lengths, destination_bases))
    n, big = K + tail, torch.iinfo(torch.int64).max
    U = torch.where(i < K, torch.nn.functional.pad(kept.long(), (0, capacity - K)), scored + i - K)
    U = torch.where(i < n, U, big)                                                   # kept + tail, ascending
    s = (U < base + n).sum(-1, keepdim=True)                                         # how many stay
    d = base + i
    lo = torch.searchsorted(torch.where(i < s, U, big).contiguous(), d.expand(R, rows, capacity).contiguous())
    stays = (lo < s) & (U.gather(-1, lo.clamp(max=capacity - 1)) == d)
    mover = U.gather(-1, (s + i - lo).clamp(0, capacity - 1))
    return torch.where(i < n, torch.where(stays, d, mover), -1).int()


def moves_torch(sources, destination_bases, new_lengths):
    """moves of every list row: the ascending indices m < n whose source is not base + m, then -1."""
    i = torch.arange(sources.shape[2], device=sources.device)
    base = destination_bases[:, None, None]
    moving = (i < (new_lengths[:, None, None] - base)) & (sources != base + i) & (sources >= 0)
    ascending = torch.where(moving, i, sources.shape[2]).sort(-1).values  # the moving indices first
    return ascending.masked_fill_(i >= moving.sum(-1, keepdim=True), -1)


def ring_sources_torch(scored_lengths, destination_bases, window_offsets, K):
    """The ring window row's first K sources, [R, K] int32 (the kernel's inverse of ``ring_order``)."""
    scored, base, offset = (t.long()[:, None] for t in (scored_lengths, destination_bases, window_offsets))
    e = (scored - base - K).clamp(min=0)  # refused requests are overwritten after
    j = e + (torch.arange(K, device=scored.device) - offset - e).remainder(K)  # the age of the token landing at m
    return torch.where(j < K, base + (offset + j).remainder(K), base + j).int()


def pack_move_sources_torch(kept, scored_lengths, tail_lengths, destination_bases, sources, new_lengths, moves=None,
                            window_offsets=None):
    """pack_move_sources in batched torch: writes sources, new_lengths and (fill order) moves as pack.py states."""
    R, rows, K = kept.shape
    m = torch.arange(sources.shape[2], device=kept.device, dtype=torch.int32)
    scored, tail = scored_lengths[:, None], tail_lengths[:, None]
    tail_part = torch.where(m[K:] < K + tail, scored + m[K:] - K, -1)  # [R, capacity - K]
    sources[:, :rows, :K] = kept
    if sources.shape[1] > rows:
        sources[:, rows, :K] = scored - K + m[:K] if window_offsets is None or K == 0 else \
            ring_sources_torch(scored_lengths, destination_bases, window_offsets, K)
    sources[:, :, K:] = tail_part[:, None, :]
    if moves is not None:
        sources[:, :rows] = fill_lists_torch(kept, scored_lengths, tail_lengths, destination_bases, sources.shape[2])
    scored, tail, base = scored_lengths.long(), tail_lengths.long(), destination_bases.long()  # no overflow
    before = scored + tail.clamp(min=0)
    refused = (tail < 0) | (tail > sources.shape[2] - K) | (base < 0) | (base + K > scored) | (before > INT32_MAX)
    if window_offsets is not None:
        refused |= (window_offsets < 0) | (window_offsets >= max(K, 1))
    sources.masked_fill_(refused[:, None, None], -1)
    new_lengths.copy_(torch.where(refused, before.clamp(0, INT32_MAX), base + K + tail))
    if moves is not None:
        moves.copy_(moves_torch(sources, destination_bases, new_lengths))



def slot_positions_torch(table: torch.Tensor, seats: torch.Tensor, stored: torch.Tensor, bases: torch.Tensor,
                         width: int) -> torch.Tensor:
    """int32 [R, rows, width]: every decode slot's logical position (positions.py states it): slot j of request r
    holds table[seats[r], row, j] below stored[r], else bases[r] + j."""
    j = torch.arange(width, device=table.device)
    rows = table[seats.long().clamp(0, max(table.shape[0] - 1, 0))]  # a seat outside the table: read, not used
    if rows.shape[2] < width:
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[2]))
    return torch.where(j < stored[:, None, None], rows[..., :width], bases[:, None, None] + j).int()


def follow_slot_positions_torch(table: torch.Tensor, seats: torch.Tensor, stored: torch.Tensor, bases: torch.Tensor,
                                sources: torch.Tensor, list_rows: torch.Tensor | None, destination_bases: torch.Tensor,
                                new_lengths: torch.Tensor) -> None:
    """kvops::compaction_follow_slot_positions_ in torch, out of place: table[seats[r], row, m] = the position
    before the compaction of what landed at m (``sources`` less the base), for m below the new length (and the
    table's width); -1 for a -1 source."""
    R, rows = seats.shape[0], table.shape[1]
    capacity = min(table.shape[2], sources.shape[2])
    width = int(max(capacity, int((sources.max() - destination_bases.min()).clamp(min=0)) + 1)) if R else 0
    before = slot_positions_torch(table, seats, stored, bases, width)
    lists = sources if list_rows is None else sources[:, list_rows.long()]
    for r in range(R):
        if not 0 <= int(seats[r]) < table.shape[0]:
            continue  # a seat outside the table writes nothing (the kernel's rule)
        base = int(destination_bases[r])
        n = max(0, min(int(new_lengths[r]) - base, capacity))
        src = lists[r, :rows, :n].long() - base
        ok = (src >= 0) & (src < width)
        table[int(seats[r]), :, :n] = torch.where(ok, before[r].gather(1, src.clamp(0, width - 1)), -1).int()
