"""kvops.attention.decode_attention: a wrapper over torch.ops.kvops.attention_decode, with its fake beside it."""

from __future__ import annotations

import math

import torch

from .._checks import check_device, check_int, check_no_meta_mix

HEAD_DIMS = (64, 128, 256)                   # what the kernels serve (csrc/attention/attention.cpp checks it)
QUERY_DTYPES = (torch.bfloat16, torch.float16)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     lengths: torch.Tensor, *, starts: torch.Tensor | None = None, scale: float | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int = 0) -> torch.Tensor:
    """Attention of each request's last query tokens over the tokens it holds in a paged cache.

    Grouped-query heads read their KV head once (nothing is repeated). On the GPU the KV length is split across
    CTAs (flash-decoding) so that a small batch still fills every SM, and the lengths are read on the device: a
    CUDA graph or a compiled step replays on new lengths without recompiling.

    Parameters
    ----------
    query : torch.Tensor
        bf16 or fp16 ``[requests, q_heads, q_tokens, head_dim]``, head_dim 64, 128 or 256 (contiguous); the other
        dims may be strided (a transposed ``[requests, q_tokens, q_heads, head_dim]`` projection needs no copy).
    k_cache, v_cache : torch.Tensor
        ``[pages, kv_heads, page_size, head_dim]``, query's dtype or float8_e4m3fn; q_heads a multiple of kv_heads;
        token rows 16-byte aligned. The planes of a kvops pool ``[page, plane, head, token, dim]`` are such views
        (``pool[:, 0]``, ``pool[:, 1]``), and so is a dense ``[batch, kv_heads, tokens, head_dim]`` cache with one
        page per row.
    page_table : torch.Tensor
        int32 ``[requests, max_pages]``: position p of request r lives in page ``page_table[r, p // page_size]``,
        slot ``p % page_size``. A page id outside ``[0, pages)`` holds nothing (its positions are skipped).
    lengths : torch.Tensor
        int32 ``[requests]``: positions each request holds, the query tokens' own included (written before the
        call), clamped to ``[0, max_pages * page_size]``.
    starts : torch.Tensor, optional
        int32 ``[requests]``: the first position each request attends to (left padding before it); 0 when None.
    scale : float, optional
        The softmax scale; ``1 / sqrt(head_dim)`` when None.
    k_scale, v_scale : float
        Dequantization scales of an fp8 cache (K and V are multiplied by them); 1 for bf16/fp16.
    num_splits : int
        KV-length splits per (request, KV head) on the GPU, in [0, 256]; 0 chooses from the shapes and the SM count.

    Returns
    -------
    torch.Tensor
        ``[requests, q_tokens, q_heads, head_dim]`` of query's dtype. Query token i attends causally to positions
        ``[start, length - (q_tokens - 1 - i))``; a row that sees no position is zeros.
    """
    what = "kvops.attention.decode_attention"
    check_device(what, query=query, k_cache=k_cache, v_cache=v_cache, page_table=page_table, lengths=lengths,
                 **({} if starts is None else {"starts": starts}))
    if scale is None:  # a placeholder for a shape the op refuses (naming query or head_dim) before using it
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.dim() == 4 and query.shape[-1] > 0 else 1.0
    for name, value in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            shown = "" if isinstance(value, torch.Tensor) else f" {value!r}"  # a traced tensor has no repr
            raise TypeError(f"{what}: {name} must be a float, got {type(value).__name__}{shown}")
    check_int(what, "num_splits", num_splits, 0)  # the op bounds it (csrc/attention/attention.h's kMaxSplits)
    return torch.ops.kvops.attention_decode(query, k_cache, v_cache, page_table, lengths, starts, float(scale),
                                            float(k_scale), float(v_scale), num_splits)


@torch.library.register_fake("kvops::attention_decode")
def _decode_fake(query, k_cache, v_cache, page_table, lengths, starts, scale, k_scale=1.0, v_scale=1.0,
                 num_splits=0):
    check_no_meta_mix("attention_decode", query, k_cache, v_cache, page_table, lengths, starts)
    if query.dim() != 4:  # the op's own error (csrc/attention/attention.cpp), raised where the trace needs a shape
        raise ValueError(f"attention_decode: query must be 4-D [requests, q_heads, q_tokens, head_dim], got shape "
                         f"{list(query.shape)}")
    R, Hq, q, D = query.shape
    return query.new_empty((R, q, Hq, D))
