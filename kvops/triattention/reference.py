"""Float64 plain-torch reference of TriAttention selection (docs/triattention.md states the semantics).

Independent of every kernel: it gathers K through the page table position by position and evaluates the
formulas as written.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .calibration import Calibration

PHASE_OFFSETS = tuple(2 ** i for i in range(17))  # O = {1, 2, 4, ..., 65536}
MODES = ("union", "per_head", "per_layer_perhead")


def mean_phase_reference(round_starts: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C, S float64 [R, F]: the means over O of cos((p + o) w_f) and sin((p + o) w_f)."""
    pos = round_starts.double().cpu()[:, None] + torch.tensor(PHASE_OFFSETS, dtype=torch.float64)
    angle = pos[:, :, None] * omega.double().cpu()[None, None, :]
    return torch.cos(angle).mean(1), torch.sin(angle).mean(1)


def gather_keys(k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, r: int, start: int, end: int
                ) -> torch.Tensor:
    """float64 [L, Hkv, end - start, D]: the cached keys of request r at positions [start, end)."""
    T = k_pools[0].shape[3]
    pos = torch.arange(start, end)
    pages, slots = page_table[r].long().cpu()[pos // T], pos % T
    return torch.stack([pool[pages, 0, :, slots].double().cpu().permute(1, 0, 2) for pool in k_pools])


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
    """z = (s - mean) / max(std, 1e-6) over the last dim, population std."""
    mean = s.mean(-1, keepdim=True)
    std = s.std(-1, correction=0, keepdim=True) if s.shape[-1] else torch.ones_like(mean)
    return (s - mean) / std.clamp_min(1e-6)


def reduce_reference(z: torch.Tensor, mode: str, num_kv_heads: int) -> torch.Tensor:
    """Row scores from z [L, Hq, n]: union [1, n], per_head [Hkv, n], per_layer_perhead [L*Hkv, n]."""
    L, Hq, n = z.shape
    grouped = z.view(L, num_kv_heads, Hq // num_kv_heads, n).amax(2)  # max over the query heads of a group
    if mode == "union":
        return grouped.amax((0, 1))[None]
    if mode == "per_head":
        return grouped.mean(0)
    if mode == "per_layer_perhead":
        return grouped.reshape(L * num_kv_heads, n)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def topk_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [rows, k]: per row, the ascending indices of the k largest of scores[row, :length]; ties go to the
    lowest index; NaN ranks below -inf; -1 fills a row shorter than k."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for row in range(scores.shape[0]):
        n = int(lengths[row])
        vals = scores[row, :n].double().cpu().nan_to_num(nan=-float("inf"))
        nan = torch.isnan(scores[row, :n].cpu())
        # lexicographic: value descending (NaN last), then index ascending
        order = sorted(range(n), key=lambda i: (bool(nan[i]), -float(vals[i]), i))[:k]
        out[row, :len(order)] = torch.tensor(sorted(order), dtype=torch.int32)
    return out


def select_reference(k_pools, page_table, cache_lengths, prompt_lengths, round_starts, cal: Calibration, budget: int,
                     mode: str = "union", normalize_scores: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(kept int32 [R, rows, budget] ascending cache positions, -1 past the decode tokens; per-request row
    scores float64 [rows, n])."""
    R = page_table.shape[0]
    C, S = mean_phase_reference(round_starts, cal.omega)
    kept, row_scores = [], []
    for r in range(R):
        P, N = int(prompt_lengths[r]), int(cache_lengths[r])
        s = raw_scores_reference(gather_keys(k_pools, page_table, r, P, N), cal, C[r], S[r])
        z = normalize_reference(s) if normalize_scores else s
        rows = reduce_reference(z, mode, cal.num_kv_heads)
        row_scores.append(rows)
        picked = topk_reference(rows, torch.full((rows.shape[0],), N - P), budget)
        kept.append(torch.where(picked >= 0, picked + P, picked))
    return torch.stack(kept), row_scores
