"""Plain-torch reference of compaction semantics: gather everything, then scatter, out of place.

Independent of the move lists and the kernels: it reads the decision directly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .compact import decision_row


def fill_order(kept_positions: list[int], base: int) -> list[int]:
    """Fill order, written out: the kept positions (then the tail), ascending, that lie below the new length
    stay; the evicted slots below it, ascending, take the others in ascending order. Returns the old position of
    what ends at base + m, for each m."""
    end = base + len(kept_positions)
    stay = {p for p in kept_positions if p < end}
    movers = iter(p for p in kept_positions if p >= end)
    return [p if p in stay else next(movers) for p in range(base, end)]


def compact_reference(pools: Sequence[torch.Tensor], page_table: torch.Tensor, kept: torch.Tensor,
                      scored_lengths: torch.Tensor, tail_lengths: torch.Tensor, destination_bases: torch.Tensor,
                      layer_windows: Sequence[int] | None = None, order: str = "ordered"
                      ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Returns (new pools as uint8 byte views [P, 2, H, T, row_bytes], new_lengths). order: "ordered" or "fill"
    (window layers compact in order either way)."""
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
                if windows[layer] > 0:
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
