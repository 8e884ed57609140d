"""Plain-torch references of TriAttention selection (docs/triattention.md states the semantics), the oracles the
tests compare against.

- ``*_reference`` and ``select_reference``: float64 and independent of every kernel: they gather K through the
  page table position by position and evaluate the formulas as written.
- ``mean_phase_torch``, ``score_torch`` and ``reduce_torch``: each op in batched float32 torch, with the kernels'
  outputs and layouts (the scorer's chunk partials): what the ops run on the CPU, and the kernels' oracles.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..compaction.reference import slot_positions_torch
from ..compaction.rows import MODES
from .calibration import Calibration
from ..topk.reference import topk_reference
from .score import CHUNK, STATS

PHASE_OFFSETS = tuple(2 ** i for i in range(17))  # O = {1, 2, 4, ..., 65536}


def mean_phase_reference(round_starts: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C, S float64 [R, F]: the means over O of cos((p + o) w_f) and sin((p + o) w_f)."""
    pos = round_starts.double().cpu()[:, None] + torch.tensor(PHASE_OFFSETS, dtype=torch.float64)
    angle = pos[:, :, None] * omega.double().cpu()[None, None, :]
    return torch.cos(angle).mean(1), torch.sin(angle).mean(1)


def gather_keys(k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, r: int, start: int, end: int
                ) -> torch.Tensor:
    """float64 [L, Hkv, end - start, D]: the cached keys of request r at positions [start, end); NaN where the
    position's page is absent (past the page table, or an entry outside [0, num_pages))."""
    T, P = k_pools[0].shape[3], k_pools[0].shape[0]
    pos = torch.arange(start, end)
    table = torch.cat([page_table[r].long().cpu(), torch.full((int(end) // T + 1,), -1)])
    pages, slots = table[pos // T], pos % T
    present = (pages >= 0) & (pages < P)
    keys = torch.stack([pool[pages.clamp(0, P - 1), 0, :, slots].double().cpu().permute(1, 0, 2) for pool in k_pools])
    return torch.where(present[None, None, :, None], keys, float("nan"))


def raw_scores_reference(keys: torch.Tensor, cal: Calibration, C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """s float64 [L, Hq, n] for one request, keys [L, Hkv, n, D], C and S [F] of its round start."""
    F = cal.num_freqs
    kr, ki = keys[..., :F], keys[..., F:2 * F]                            # [L, Hkv, n, F]
    kr, ki = (x.repeat_interleave(cal.group_size, dim=1) for x in (kr, ki))  # query head h reads KV head h // G
    qr = cal.q_mean.real.double().cpu()[:, :, None, :]
    qi = cal.q_mean.imag.double().cpu()[:, :, None, :]
    extra = cal.q_abs_mean.double().cpu()[:, :, None, :] - cal.q_mean.abs().double().cpu()[:, :, None, :]
    fss = cal.freq_scale_sq.double().cpu()
    C, S = C.double().cpu(), S.double().cpu()
    terms = kr * (qr * C - qi * S) + ki * (qr * S + qi * C) + extra * torch.sqrt(kr * kr + ki * ki)
    return (terms * fss).sum(-1)


def normalize_reference(s: torch.Tensor) -> torch.Tensor:
    """z = (s - mean) / max(std, 1e-6) over the finite values of the last dim, population std; non-finite
    values stay as they are."""
    finite = torch.isfinite(s)
    count = finite.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(finite, s, 0).sum(-1, keepdim=True) / count
    std = (torch.where(finite, s - mean, 0) ** 2).sum(-1, keepdim=True).div(count).sqrt()
    return torch.where(finite, (s - mean) / std.clamp_min(1e-6), s)


def reduce_reference(z: torch.Tensor, mode: str, num_kv_heads: int) -> torch.Tensor:
    """Row scores from z [L, Hq, n]: union [1, n], per_head [Hkv, n], per_layer_perhead [L*Hkv, n]. A column
    with a non-finite value in any (layer, head) the row reduces over is -inf."""
    L, Hq, n = z.shape
    poisoned = (~torch.isfinite(z)).view(L, num_kv_heads, Hq // num_kv_heads, n).any(2)
    grouped = z.view(L, num_kv_heads, Hq // num_kv_heads, n).amax(2)  # max over the query heads of a group
    if mode == "union":
        rows, poisoned = grouped.amax((0, 1))[None], poisoned.any(1).any(0)[None]
    elif mode == "per_head":
        rows, poisoned = grouped.mean(0), poisoned.any(0)
    elif mode == "per_layer_perhead":
        rows, poisoned = grouped.reshape(L * num_kv_heads, n), poisoned.reshape(L * num_kv_heads, n)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return rows.masked_fill(poisoned, -float("inf"))


def select_reference(k_pools, page_table, cache_lengths, prompt_lengths, round_starts, cal: Calibration, budget: int,
                     mode: str = "union", normalize_scores: bool = True, k_scale: torch.Tensor | None = None,
                     recency_prior: float = 0.0, positions: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(kept int32 [R, rows, budget] ascending cache positions, -1 past the decode tokens; per-request row
    scores float64 [rows, n]). k_scale: [L] or [L, Hkv], the keys' dequantization scale (fp8 caches);
    recency_prior with positions [R, rows, >= n], the logical position of each row's decode token j: the row
    score of a token of age a = round start - position gains recency_prior * clamp(1 - a / n, 0, 1)."""
    R = page_table.shape[0]
    C, S = mean_phase_reference(round_starts, cal.omega)
    kept, row_scores = [], []
    for r in range(R):
        P, N = int(prompt_lengths[r]), int(cache_lengths[r])
        keys = gather_keys(k_pools, page_table, r, P, N)                          # [L, Hkv, n, D]
        if k_scale is not None:
            keys = keys * k_scale.double().cpu().reshape(keys.shape[0], -1)[:, :, None, None]
        s = raw_scores_reference(keys, cal, C[r], S[r])
        z = normalize_reference(s) if normalize_scores else s
        rows = reduce_reference(z, mode, cal.num_kv_heads)
        if recency_prior:
            age = int(round_starts[r]) - positions[r, :, :N - P].double().cpu()
            rows = rows + recency_prior * (1 - age / max(N - P, 1)).clamp(0, 1)
        row_scores.append(rows)
        picked = topk_reference(rows, torch.full((rows.shape[0],), N - P), budget)
        kept.append(torch.where(picked >= 0, picked + P, picked))
    return torch.stack(kept), row_scores


def recency_prior_torch(scores: torch.Tensor, lengths: torch.Tensor, round_starts: torch.Tensor, positions,
                        prior: float) -> None:
    """kvops::triattention_recency_prior_ in float32 torch (kvops/triattention/prior.py states it); positions: a
    SlotPositions."""
    n = scores.shape[2]
    age = (round_starts[:, None, None] - slot_positions_torch(*positions, n)).float()
    length = lengths[..., None]
    ramp = (1 - age / length.clamp(min=1).float()).clamp(0, 1)
    scores.add_(torch.where(torch.arange(n, device=scores.device) < length, prior * ramp, 0))


def mean_phase_torch(round_starts: torch.Tensor, omega: torch.Tensor, phase: torch.Tensor) -> None:
    """kvops::triattention_mean_phase_ in float64 torch: phase[:, 0] = C, phase[:, 1] = S (mean_phase_reference)."""
    offsets = torch.tensor(PHASE_OFFSETS, dtype=torch.float64, device=omega.device)
    angle = (round_starts.double()[:, None, None] + offsets[None, :, None]) * omega.double()[None, None, :]
    phase[:, 0].copy_(angle.cos().mean(1))
    phase[:, 1].copy_(angle.sin().mean(1))


def score_torch(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats):
    """kvops::triattention_score_ in batched float32 torch: writes raw and the chunk partials in stats as the
    CuTe scorer does (score.py states the layout), leaving what the kernel leaves unwritten."""
    R, L, Hq, n = raw.shape
    Hkv, T = k_pools[0].shape[2], k_pools[0].shape[3]
    G, F = Hq // Hkv, q_real.shape[-1]
    j = torch.arange(n, device=raw.device)
    count = (cache_lengths - prompt_lengths).clamp(0, n)
    valid = j[None, :] < count[:, None]                                             # [R, n]
    pos = prompt_lengths.long()[:, None] + j[None, :]
    cols = pos // T
    pages = page_table.long().gather(1, cols.clamp(0, page_table.shape[1] - 1))
    present = (cols < page_table.shape[1]) & (pages >= 0) & (pages < k_pools[0].shape[0])  # else absent: NaN
    pages = torch.where(present, pages, 0)
    slots = pos % T
    C, S = phase[:, 0, None, :], phase[:, 1, None, :]                               # [R, 1, F]
    for layer in range(L):
        keys = k_pools[layer][pages, 0, :, slots].float()                          # [R, n, Hkv, D]
        kr, ki = keys[..., :F], keys[..., F:2 * F]
        qr, qi = q_real[layer][None], q_imag[layer][None]                          # [1, Hq, F]
        a = (qr * C - qi * S).view(R, Hkv, G, F)
        b = (qr * S + qi * C).view(R, Hkv, G, F)
        s = (torch.einsum("rngf,rgif->rgin", kr, a) + torch.einsum("rngf,rgif->rgin", ki, b)
             + torch.einsum("rngf,gif->rgin", torch.sqrt(kr * kr + ki * ki), q_extra[layer].view(Hkv, G, F)))
        s = torch.where(present[:, None], s.reshape(R, Hq, n), float("nan"))
        raw[:, layer] = torch.where(valid[:, None], s, raw[:, layer])  # like the kernel
    # partials over the finite scores; chunks with no decode token keep whatever they held (the kernel does not
    # write them)
    nc = stats.shape[3]
    width = (count[:, None] - torch.arange(nc, device=raw.device)[None] * CHUNK).clamp(0, CHUNK)  # [R, nc]
    padded = torch.nn.functional.pad(raw, (0, nc * CHUNK - n)).view(R, L, Hq, nc, CHUNK)
    live = (torch.arange(CHUNK, device=raw.device) < width[:, None, None, :, None]) & torch.isfinite(padded)
    cnt = live.sum(-1).float()
    mean = torch.where(live, padded, 0).sum(-1) / cnt.clamp(min=1)
    m2 = torch.where(live, (padded - mean[..., None]) ** 2, 0).sum(-1)
    written = (width > 0)[:, None, None, :, None]
    stats.copy_(torch.where(written, torch.stack([mean, m2, cnt], -1), stats))


def reduce_torch(raw, stats, prompt_lengths, cache_lengths, rows, mode, num_kv_heads, normalize, k_scale=None):
    """kvops::triattention_reduce_ in batched float32 torch: writes the mode's row scores into rows from score()'s
    outputs, merging the chunk partials as the Triton kernels do (reduce.py states the rule)."""
    R, L, Hq, n = raw.shape
    count = (cache_lengths - prompt_lengths).clamp(0, n)
    valid = torch.arange(n, device=raw.device)[None, :] < count[:, None]             # [R, n]
    s = torch.where(valid[:, None, None], raw, 0)
    finite = torch.isfinite(s)
    s = torch.where(finite, s, 0)
    if k_scale is not None:  # [L, Hkv]: query head h scores KV head h // G
        s = s * k_scale.repeat_interleave(Hq // num_kv_heads, 1)[None, :, :, None]
    if normalize:
        nc = stats.shape[3]
        written = (count[:, None] > torch.arange(nc, device=raw.device)[None] * CHUNK)[:, None, None, :]
        m, m2, cnt = (torch.where(written, stats[..., i], 0) for i in range(STATS))  # [R, L, Hq, nc]
        total = cnt.sum(-1).clamp(min=1)
        mean = (m * cnt).sum(-1) / total
        var = (m2 + cnt * (m - mean[..., None]) ** 2).sum(-1) / total
        s = (s - mean[..., None]) / var.sqrt().clamp_min(1e-6)[..., None]
    G = Hq // num_kv_heads
    grouped = s.view(R, L, num_kv_heads, G, n).amax(3)                                 # [R, L, Hkv, n]
    poisoned = ~finite.view(R, L, num_kv_heads, G, n).all(3)                          # [R, L, Hkv, n]
    if mode == "union":
        out, poisoned = grouped.amax((1, 2))[:, None], poisoned.any(2).any(1)[:, None]
    elif mode == "per_head":
        out, poisoned = grouped.mean(1), poisoned.any(1)
    else:
        out, poisoned = grouped.reshape(R, -1, n), poisoned.reshape(R, -1, n)
    rows.copy_(torch.where(valid[:, None] & ~poisoned, out, -float("inf")))
