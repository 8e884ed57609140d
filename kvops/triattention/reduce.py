"""TriAttention normalize-and-reduce (``kvops::triattention_reduce_``; Triton, torch on the CPU): merges the
scorer's per-chunk partials into each (r, l, h)'s mean and population std over its finite scores, normalizes,
and reduces to the mode's rows. A token with a non-finite score (a NaN or Inf key, or absent) in any (layer,
head) its row reduces over gets -inf there, so it ranks below every other token and no statistic sees it. The
union row needs every head's statistics, which exist only once the whole scoring pass is done, so it is produced
here and not inside the scorer (that would need a grid-wide barrier). Column j is cache position P + j; columns
at or past N - P are -inf in the rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._checks import check_float32, check_int, check_int32
from .._dispatch import python_op, triton_launcher
from ..compaction.compact import MODES, decision_rows
from .reference import reduce_torch
from .score import CHUNK, STATS


@triton.jit
def _moments_kernel(stats, prompt_lengths, cache_lengths, moments, n, NC, planes, CHUNK: tl.constexpr,
                    STATS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """moments[r, plane] = (mean, max(std, 1e-6)) of the finite scores of (r, layer, head), merged from the
    scorer's chunk partials (Chan et al.): once per plane, not once per column block of the reduce."""
    r = tl.program_id(0)
    plane = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    count = tl.minimum(tl.maximum(tl.load(cache_lengths + r) - tl.load(prompt_lengths + r), 0), n)
    c = tl.arange(0, BLOCK_C)
    live = (plane < planes)[:, None] & ((c < NC) & (c * CHUNK < count))[None, :]  # partials the scorer wrote
    part = stats + ((r.to(tl.int64) * planes + plane)[:, None] * NC + c[None, :]) * STATS    # [BLOCK_P, BLOCK_C]
    m = tl.load(part, mask=live, other=0.0)
    m2 = tl.load(part + 1, mask=live, other=0.0)
    w = tl.load(part + 2, mask=live, other=0.0)  # the partial's finite scores
    total = tl.maximum(tl.sum(w, 1), 1.0)
    mean = tl.sum(m * w, 1) / total
    var = tl.sum(m2 + w * (m - mean[:, None]) * (m - mean[:, None]), 1) / total
    out = moments + (r.to(tl.int64) * planes + plane) * 2
    tl.store(out, mean, mask=plane < planes)
    tl.store(out + 1, tl.maximum(tl.sqrt(var), 1e-6), mask=plane < planes)


@triton.jit
def _reduce_kernel(raw, moments, k_scale, prompt_lengths, cache_lengths, rows, n, ROWS, L: tl.constexpr,
                   Hq: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, MODE: tl.constexpr, NORMALIZE: tl.constexpr,
                   SCALED: tl.constexpr, BLOCK_J: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (R, rows, column blocks); a union row split over SPLIT layer blocks has grid (R, SPLIT, column blocks)
    and writes each block's partial maxima (+inf still marking a poisoned column) to rows [R, SPLIT, n], which
    _max_kernel finishes."""
    r = tl.program_id(0)
    row = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    count = tl.minimum(tl.maximum(tl.load(cache_lengths + r) - tl.load(prompt_lengths + r), 0), n)
    valid = j < count
    dh = tl.arange(0, GP)  # a KV head's G query heads (padded to a power of two), loaded as one tile
    live_h = dh < G
    # The (layer, group) blocks this row reduces. Trip counts are constexprs (Triton 3.6's interpreter cannot
    # range() over an int argument).
    if MODE == 2:    # per_layer_perhead: row = layer * Hkv + g
        l_lo = row // (Hq // G)
        h_lo = (row % (Hq // G)) * G
    else:            # union: every (layer, group) of layer block `row`; per_head: every layer, KV head `row`'s group
        l_lo = row * (L // SPLIT) if MODE == 0 else 0
        h_lo = 0 if MODE == 0 else row * G
    acc = tl.full([BLOCK_J], 0.0 if MODE == 1 else -float("inf"), tl.float32)
    for dl in range(0, 1 if MODE == 2 else L // SPLIT):
        for dg in range(0, Hq // G if MODE == 0 else 1):
            plane = (r.to(tl.int64) * L + l_lo + dl) * Hq + h_lo + dg * G + dh                  # [GP]
            s = tl.load(raw + plane[:, None] * n + j[None, :], mask=live_h[:, None] & valid[None, :], other=0.0)
            # A non-finite score (NaN too) becomes +inf: it survives the max over heads, the max or sum over
            # layers, and the normalization, so +inf at the end marks the column poisoned (one compare, no
            # reduction of its own). The statistics count only finite scores.
            s = tl.where(tl.abs(s) < float("inf"), s, float("inf"))
            if SCALED:  # the keys' scale of (layer, KV head) [L, Hkv]: a positive factor of every score
                s = s * tl.load(k_scale + (l_lo + dl) * (Hq // G) + (h_lo + dg * G) // G)
            if NORMALIZE:  # (r, layer, h)'s mean and std, merged once by _moments_kernel
                mean = tl.load(moments + plane * 2, mask=live_h, other=0.0)
                std = tl.load(moments + plane * 2 + 1, mask=live_h, other=1.0)
                s = (s - mean[:, None]) / std[:, None]
            best = tl.max(tl.where(live_h[:, None], s, -float("inf")), 0)  # max over the group's heads
            if MODE == 1:
                acc += best
            else:
                acc = tl.maximum(acc, best)
    if MODE == 1:
        acc = acc / L
    if SPLIT == 1:
        acc = tl.where(valid & (acc < float("inf")), acc, -float("inf"))
    tl.store(rows + (r.to(tl.int64) * ROWS + row) * n + j, acc, mask=j < n)


@triton.jit
def _max_kernel(partial, prompt_lengths, cache_lengths, rows, n, SPLIT: tl.constexpr, BLOCK_J: tl.constexpr):
    """rows[r, 0] = the max over a split union's layer blocks, -inf where poisoned or past the decode tokens."""
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    count = tl.minimum(tl.maximum(tl.load(cache_lengths + r) - tl.load(prompt_lengths + r), 0), n)
    acc = tl.full([BLOCK_J], -float("inf"), tl.float32)
    for s in range(0, SPLIT):
        acc = tl.maximum(acc, tl.load(partial + (r.to(tl.int64) * SPLIT + s) * n + j, mask=j < n, other=0.0))
    tl.store(rows + r.to(tl.int64) * n + j, tl.where((j < count) & (acc < float("inf")), acc, -float("inf")),
             mask=j < n)


def union_splits(requests: int, blocks: int, layers: int, programs: int) -> int:
    """Layer blocks for a union row: the fewest that divide the layers and give at least `programs` programs (the
    SM count), so a round of few requests is not a few programs each looping over every layer; 1 when the
    requests alone fill the GPU. The max over blocks is exact, so the rows do not depend on it."""
    for split in range(1, layers + 1):
        if layers % split == 0 and requests * blocks * split >= programs:
            return split
    return layers


def _reduce_launch(raw: torch.Tensor, stats: torch.Tensor, prompt_lengths: torch.Tensor, cache_lengths: torch.Tensor,
                   rows: torch.Tensor, row_mode: str, num_kv_heads: int, normalize: bool,
                   k_scale: Optional[torch.Tensor] = None) -> None:
    # (row_mode: a custom op's argument may not be called `mode`, a keyword of torch's dispatch-mode machinery)
    launch = triton_launcher(_reduce_kernel, raw.device)
    if launch is None:
        reduce_torch(raw, stats, prompt_lengths, cache_lengths, rows, row_mode, num_kv_heads, normalize, k_scale)
        return
    R, L, Hq, n = raw.shape
    moments = raw.new_empty(R, L * Hq, 2) if normalize else raw  # (unread without normalization)
    if normalize:
        block_p = 32
        triton_launcher(_moments_kernel, raw.device)[(R, triton.cdiv(L * Hq, block_p))](
            stats, prompt_lengths, cache_lengths, moments, n, stats.shape[3], L * Hq, CHUNK=CHUNK, STATS=STATS,
            BLOCK_P=block_p, BLOCK_C=max(triton.next_power_of_2(stats.shape[3]), 2))
    # A union program loops over every (layer, group): narrower blocks give it more programs to overlap those
    # loops (docs/triattention.md, "Speed"), and with few requests the layers are split over programs too.
    block_j = 512 if row_mode == "union" else 1024
    blocks = triton.cdiv(n, block_j)
    split = 1
    if row_mode == "union":  # (16 programs in the interpreter, so that the tests split)
        split = union_splits(R, blocks, L, torch.cuda.get_device_properties(raw.device).multi_processor_count
                             if raw.is_cuda else 16)
    out = rows if split == 1 else raw.new_empty(R, split, n)  # partial maxima per layer block
    launch[(R, split if row_mode == "union" else rows.shape[1], blocks)](
        raw, moments, raw if k_scale is None else k_scale, prompt_lengths, cache_lengths, out, n, out.shape[1], L=L,
        Hq=Hq, G=Hq // num_kv_heads, GP=triton.next_power_of_2(Hq // num_kv_heads), MODE=MODES.index(row_mode),
        NORMALIZE=normalize, SCALED=k_scale is not None, BLOCK_J=block_j, SPLIT=split)
    if split > 1:
        triton_launcher(_max_kernel, raw.device)[(R, blocks)](out, prompt_lengths, cache_lengths, rows, n,
                                                              SPLIT=split, BLOCK_J=block_j)


_reduce_op = python_op("triattention_reduce_", mutates_args={"rows"})(_reduce_launch)


def reduce_rows(raw: torch.Tensor, stats: torch.Tensor, cache_lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                mode: str, num_kv_heads: int, normalize: bool = True, k_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Row scores float32 [R, rows, n] from score()'s outputs: z = (s - mean) / max(std, 1e-6) per (r, l, h)
    over the finite scores when normalizing, then union = max over (l, h); per_head = mean over l of max over the
    group's heads; per_layer_perhead = max over the group's heads, row l * Hkv + g. Columns past N - P, and
    columns with a non-finite score in any (l, h) the row reduces over, are -inf.

    k_scale: float32 [L, Hkv] on raw's device, positive: the keys' dequantization scale (fp8 caches; a score is
    linear in its key, so the scale multiplies it). Without normalization it is applied; with it, it is not read:
    z-scores do not change when every score of an (r, l, h) is multiplied by one positive factor."""
    what = "triattention reduce"
    if mode not in MODES:
        raise ValueError(f"{what}: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(raw, torch.Tensor) or raw.dim() != 4:
        raise ValueError(f"{what}: raw must be a 4-D [R, L, Hq, n] tensor (score()'s first output)")
    R, L, Hq, n = raw.shape
    if check_int(what, "num_kv_heads", num_kv_heads, 1) and Hq % num_kv_heads:
        raise ValueError(f"{what}: num_kv_heads must divide the {Hq} query heads, got {num_kv_heads}")
    check_float32(what, raw.device, raw=(raw, (R, L, Hq, n)),
                  stats=(stats, (R, L, Hq, triton.cdiv(n, CHUNK), STATS)))
    check_int32(what, raw.device, cache_lengths=(cache_lengths, 1), prompt_lengths=(prompt_lengths, 1))
    if cache_lengths.shape[0] != R or prompt_lengths.shape[0] != R:
        raise ValueError(f"{what}: cache_lengths and prompt_lengths must have {R} entries (one per request)")
    if k_scale is not None:
        check_float32(what, raw.device, k_scale=(k_scale, (L, num_kv_heads)))
    return reduce_unchecked(raw, stats, cache_lengths, prompt_lengths, mode, num_kv_heads, normalize, k_scale)


def reduce_unchecked(raw, stats, cache_lengths, prompt_lengths, mode, num_kv_heads, normalize, k_scale):
    """reduce_rows() on arguments its checks have passed (score()'s fresh outputs in the selector)."""
    R, L, _, n = raw.shape
    rows = torch.empty((R, decision_rows(mode, L, num_kv_heads), n), dtype=torch.float32, device=raw.device)
    if R and n:
        _reduce_op(raw, stats, prompt_lengths, cache_lengths, rows, mode, num_kv_heads, normalize,
                   None if normalize else k_scale)
    return rows
