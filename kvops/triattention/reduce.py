"""TriAttention normalize-and-reduce (``kvops::triattention_reduce_``; csrc/triattention: CUDA and CPU): merges the
scorer's per-chunk partials into each (r, l, h)'s mean and population std over its finite scores, normalizes,
and reduces to the mode's rows. A token with a non-finite score (a NaN or Inf key, or absent) in any (layer,
head) its row reduces over gets -inf there, so it ranks below every other token and no statistic sees it. The
union row needs every head's statistics, which exist only once the whole scoring pass is done, so it is produced
here and not inside the scorer (that would need a grid-wide barrier). Column j is cache position P + j; columns
at or past N - P are -inf in the rows. On request the op also writes the top-k's per-row lengths and offsets, so
that a round runs no elementwise op between its kernels.
"""

from __future__ import annotations

import torch

from .._checks import check_bool, check_float32, check_int, check_int32, check_no_meta_mix
from ..compaction.compact import MODES, decision_rows
from .score import CHUNK, STATS


@torch.library.register_fake("kvops::triattention_reduce_")
def _reduce_fake(raw, stats, prompt_lengths, cache_lengths, rows, row_mode, num_kv_heads, normalize, k_scale=None,
                 row_lengths=None, row_offsets=None):
    check_no_meta_mix("triattention_reduce_", raw, stats, prompt_lengths, cache_lengths, rows, k_scale, row_lengths,
                      row_offsets)


def reduce_rows(raw: torch.Tensor, stats: torch.Tensor, cache_lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                mode: str, num_kv_heads: int, normalize: bool = True, k_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Row scores float32 [R, rows, n] from score()'s outputs: z = (s - mean) / max(std, 1e-6) per (r, l, h)
    over the finite scores when normalizing, then union = max over (l, h); per_head = mean over l of max over the
    group's heads; per_layer_perhead = max over the group's heads, row l * Hkv + g. Columns past N - P, and
    columns with a non-finite score in any (l, h) the row reduces over, are -inf.

    k_scale: float32 [L, Hkv] on raw's device, positive and finite (its values are checked when it is on the host):
    the keys' dequantization scale (fp8 caches; a score is linear in its key, so the scale multiplies it). Without
    normalization it is applied; with it, it is not read: z-scores do not change when every score of an (r, l, h)
    is multiplied by one positive factor."""
    what = "triattention reduce"
    if mode not in MODES:
        raise ValueError(f"{what}: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(raw, torch.Tensor) or raw.dim() != 4:
        raise ValueError(f"{what}: raw must be a 4-D [R, L, Hq, n] tensor (score()'s first output)")
    R, L, Hq, n = raw.shape
    if check_int(what, "num_kv_heads", num_kv_heads, 1) and Hq % num_kv_heads:
        raise ValueError(f"{what}: num_kv_heads must divide the {Hq} query heads, got {num_kv_heads}")
    check_float32(what, raw.device, raw=(raw, (R, L, Hq, n)),
                  stats=(stats, (R, L, Hq, -(-n // CHUNK), STATS)))
    check_int32(what, raw.device, cache_lengths=(cache_lengths, 1), prompt_lengths=(prompt_lengths, 1))
    if cache_lengths.shape[0] != R or prompt_lengths.shape[0] != R:
        raise ValueError(f"{what}: cache_lengths and prompt_lengths must have {R} entries (one per request)")
    check_bool(what, "normalize", normalize)
    if k_scale is not None:
        check_float32(what, raw.device, k_scale=(k_scale, (L, num_kv_heads)))
        if k_scale.device.type == "cpu" and not torch.compiler.is_compiling():  # a device one: no sync here
            check_k_scale_values(what, k_scale)
    return reduce_unchecked(raw, stats, cache_lengths, prompt_lengths, mode, num_kv_heads, normalize, k_scale)


def check_k_scale_values(what: str, k_scale: torch.Tensor) -> None:
    """k_scale's values positive and finite: <= 0 would flip or erase the scores, NaN would drop them. Reads them
    (a sync when on a GPU: the selector reads its k_scale once, at construction)."""
    host = k_scale.detach().cpu()
    if not bool((torch.isfinite(host) & (host > 0)).all()):
        raise ValueError(f"{what}: k_scale must be positive and finite, got {host.flatten()[:8].tolist()}")


def reduce_unchecked(raw, stats, cache_lengths, prompt_lengths, mode, num_kv_heads, normalize, k_scale,
                     topk_args: bool = False):
    """reduce_rows() on arguments its checks have passed (score()'s fresh outputs in the selector). With
    `topk_args`, returns (rows, row_lengths, row_offsets): int32 [R, rows] each, the decode count and the prompt
    length of each row's request, as kvops.topk takes them."""
    R, L, _, n = raw.shape
    shape = (R, decision_rows(mode, L, num_kv_heads))
    rows = torch.empty((*shape, n), dtype=torch.float32, device=raw.device)
    lengths = offsets = None
    if topk_args:
        lengths, offsets = torch.empty((2, *shape), dtype=torch.int32, device=raw.device).unbind()
    if R:
        torch.ops.kvops.triattention_reduce_(raw, stats, prompt_lengths, cache_lengths, rows, mode, num_kv_heads,
                                             normalize, None if normalize else k_scale, lengths, offsets)
    return (rows, lengths, offsets) if topk_args else rows
