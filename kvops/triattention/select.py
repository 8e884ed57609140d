"""TriAttention selection: mean-phase coefficients -> row scores -> top-k keep sets, one call per round.

`score_rows` is the scoring math as batched torch (no host syncs, static shapes, so it also runs and captures on
the GPU); it is the CPU path and today's GPU path. The fused CuTe DSL scorer (docs/triattention.md) is to replace
it on the GPU.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .calibration import Calibration
from .phase import mean_phase
from .reference import MODES
from .topk import topk


def num_rows(mode: str, num_layers: int, num_kv_heads: int) -> int:
    return {"union": 1, "per_head": num_kv_heads, "per_layer_perhead": num_layers * num_kv_heads}[mode]


def score_rows(k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
               prompt_lengths: torch.Tensor, phase: torch.Tensor, cal: Calibration, mode: str, max_decode: int,
               normalize_scores: bool = True) -> torch.Tensor:
    """Row scores float32 [R, rows, max_decode] of the decode tokens (column j is cache position P + j); columns
    at or past N - P hold -inf. k_pools: per-layer [page, plane, kv_head, token, dim] views (plane 0 is K);
    phase: [R, 2, F] from mean_phase; `cal` should already be on the pools' device (then the .to calls are free)."""
    T = k_pools[0].shape[3]
    L, Hkv, G, F = cal.num_layers, cal.num_kv_heads, cal.group_size, cal.num_freqs
    device = page_table.device
    j = torch.arange(max_decode, device=device)
    count = (cache_lengths - prompt_lengths).clamp(0, max_decode)                   # [R] decode tokens
    valid = j[None, :] < count[:, None]                                             # [R, n]
    pos = prompt_lengths.long()[:, None] + j[None, :]
    col = (pos // T).clamp(max=page_table.shape[1] - 1)
    pages = page_table.long().gather(1, col).clamp(min=0)
    slots = pos % T
    C, S = phase[:, 0], phase[:, 1]                                                 # [R, F]
    q = cal.q_mean.to(device)
    qr, qi = q.real.view(L, Hkv, G, F), q.imag.view(L, Hkv, G, F)
    extra = (cal.q_abs_mean.to(device) - q.abs()).view(L, Hkv, G, F)
    fss = cal.freq_scale_sq.to(device)
    n_valid = count.clamp(min=1).to(torch.float32)[:, None, None, None]
    rows = None
    for layer in range(L):
        keys = k_pools[layer][pages, 0, :, slots].float()                          # [R, n, Hkv, D]
        kr, ki = keys[..., :F], keys[..., F:2 * F]
        a = fss * (qr[layer][None] * C[:, None, None] - qi[layer][None] * S[:, None, None])  # [R, Hkv, G, F]
        b = fss * (qr[layer][None] * S[:, None, None] + qi[layer][None] * C[:, None, None])
        e = fss * extra[layer]                                                      # [Hkv, G, F]
        s = (torch.einsum("rngf,rgif->rgin", kr, a) + torch.einsum("rngf,rgif->rgin", ki, b)
             + torch.einsum("rngf,gif->rgin", torch.sqrt(kr * kr + ki * ki), e))    # [R, Hkv, G, n]
        if normalize_scores:
            m = valid[:, None, None, :]
            mean = torch.where(m, s, 0).sum(-1, keepdim=True) / n_valid
            var = torch.where(m, (s - mean) ** 2, 0).sum(-1, keepdim=True) / n_valid
            s = (s - mean) / var.sqrt().clamp_min(1e-6)
        grouped = s.amax(2)                                                         # [R, Hkv, n]
        if mode == "union":
            rows = grouped.amax(1, keepdim=True) if rows is None else torch.maximum(rows, grouped.amax(1, keepdim=True))
        elif mode == "per_head":
            rows = grouped if rows is None else rows + grouped
        else:
            rows = grouped if rows is None else torch.cat([rows, grouped], 1)
    if mode == "per_head":
        rows = rows / L
    return torch.where(valid[:, None, :], rows, -float("inf"))


class TriAttentionSelector:
    """One selection round for a batch of due requests: returns kept int32 [R, rows, budget], ascending cache
    positions of the decode tokens to keep (-1 past a request's decode tokens). Static shapes, no host sync."""

    def __init__(self, calibration: Calibration, budget: int, mode: str = "union", normalize_scores: bool = True,
                 max_decode: int | None = None):
        if mode not in MODES:
            raise ValueError(f"TriAttentionSelector: mode must be one of {MODES}, got {mode!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"TriAttentionSelector: budget must be a positive int, got {budget!r}")
        self.calibration, self.budget, self.mode, self.normalize_scores = calibration, budget, mode, normalize_scores
        self.max_decode = max_decode or 2 * budget
        if self.max_decode < budget:
            raise ValueError(f"TriAttentionSelector: max_decode {self.max_decode} is below the budget {budget}")
        self.rows = num_rows(mode, calibration.num_layers, calibration.num_kv_heads)
        self._on_device: dict[torch.device, Calibration] = {}

    def _calibration_on(self, device: torch.device) -> Calibration:
        """The statistics on `device`, copied once (at warm-up): a host-to-device copy per round would cost a
        transfer each time and cannot be captured in a CUDA graph."""
        if device not in self._on_device:
            self._on_device[device] = self.calibration.to(device)
        return self._on_device[device]

    def select(self, k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
               prompt_lengths: torch.Tensor, round_starts: torch.Tensor) -> torch.Tensor:
        cal = self._calibration_on(page_table.device)
        if len(k_pools) != cal.num_layers or k_pools[0].dim() != 5 or k_pools[0].shape[2] != cal.num_kv_heads:
            raise ValueError(f"TriAttentionSelector.select: expected {cal.num_layers} pools of [page, plane, "
                             f"{cal.num_kv_heads}, token, dim], got {len(k_pools)} of {tuple(k_pools[0].shape)}")
        if k_pools[0].shape[4] < 2 * cal.num_freqs:
            raise ValueError(f"TriAttentionSelector.select: head_dim {k_pools[0].shape[4]} is smaller than the "
                             f"calibration's rotary dims {2 * cal.num_freqs}")
        R = page_table.shape[0]
        phase = mean_phase(round_starts, cal.omega)
        scores = score_rows(k_pools, page_table, cache_lengths, prompt_lengths, phase, cal, self.mode,
                            self.max_decode, self.normalize_scores)
        count = (cache_lengths - prompt_lengths).clamp(0, self.max_decode).to(torch.int32)
        picked = topk(scores.view(R * self.rows, -1), count.repeat_interleave(self.rows), self.budget)
        picked = picked.view(R, self.rows, self.budget)
        return torch.where(picked >= 0, picked + prompt_lengths.view(R, 1, 1).to(torch.int32), picked)
