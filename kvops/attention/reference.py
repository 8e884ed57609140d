"""Plain-torch reference of kvops.attention.decode_attention, independent of csrc/: each request's positions are
gathered page by page into a dense K and V, every query head repeats its KV head, and softmax attention runs in
float64 under an explicit causal mask."""

from __future__ import annotations

import math

import torch


def decode_attention(query, k_cache, v_cache, page_table, lengths, starts=None, scale=None, k_scale=1.0,
                     v_scale=1.0):
    """The semantics of kvops.attention.decode_attention (see there), in float64; returns query's dtype."""
    R, Hq, q, D = query.shape
    pages, Hkv, S, _ = k_cache.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    capacity = page_table.shape[1] * S
    out = torch.zeros(R, q, Hq, D, dtype=torch.float64)
    for r in range(R):
        length = min(max(int(lengths[r]), 0), capacity)
        start = 0 if starts is None else min(max(int(starts[r]), 0), length)
        held = [(int(page_table[r, p // S]), p % S, p) for p in range(start, length)]
        held = [(page, slot, p) for page, slot, p in held if 0 <= page < pages]
        if not held:
            continue
        page = torch.tensor([h[0] for h in held])
        slot = torch.tensor([h[1] for h in held])
        position = torch.tensor([h[2] for h in held])
        k = k_cache.cpu()[page, :, slot].double() * k_scale  # [n, Hkv, D]
        v = v_cache.cpu()[page, :, slot].double() * v_scale
        k = k.repeat_interleave(Hq // Hkv, dim=1)               # [n, Hq, D]
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        for i in range(q):
            visible = position < length - (q - 1 - i)
            if not visible.any():
                continue
            qi = query[r, :, i].cpu().double()                  # [Hq, D]
            scores = torch.einsum("hd,nhd->hn", qi, k[visible]) * scale
            out[r, i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[visible])
    return out.to(query.dtype).to(query.device)
