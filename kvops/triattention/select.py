"""TriAttention selection: mean-phase coefficients -> raw scores -> normalized row scores -> top-k keep sets,
one call per round (docs/triattention.md). Every step is a kvops op with a GPU kernel and a CPU path; shapes
are static and nothing syncs with the host, so a warmed-up round captures in a CUDA graph.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .calibration import Calibration
from .phase import mean_phase
from .reference import MODES
from .score import num_rows, reduce_rows, score
from .topk import topk


def score_rows(k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
               prompt_lengths: torch.Tensor, phase: torch.Tensor, cal: Calibration, mode: str, max_decode: int,
               normalize_scores: bool = True, weights: tuple | None = None) -> torch.Tensor:
    """Row scores float32 [R, rows, max_decode] of the decode tokens (column j is cache position P + j); columns
    at or past N - P hold -inf. k_pools: per-layer [page, plane, kv_head, token, dim] views (plane 0 is K);
    phase: [R, 2, F] from mean_phase; weights: cal.score_weights() on the pools' device (made here if None)."""
    if weights is None:
        weights = tuple(w.to(page_table.device) for w in cal.score_weights())
    raw, stats = score(k_pools, page_table, cache_lengths, prompt_lengths, phase, weights, max_decode)
    return reduce_rows(raw, stats, cache_lengths, prompt_lengths, mode, cal.num_kv_heads, normalize_scores)


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
        self._on_device: dict[torch.device, tuple] = {}

    def _calibration_on(self, device: torch.device) -> tuple:
        """(omega, score weights) on `device`, copied once (at warm-up): a host-to-device copy per round would
        cost a transfer each time and cannot be captured in a CUDA graph."""
        if device not in self._on_device:
            cal = self.calibration
            self._on_device[device] = (cal.omega.to(device), tuple(w.to(device) for w in cal.score_weights()))
        return self._on_device[device]

    def select(self, k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
               prompt_lengths: torch.Tensor, round_starts: torch.Tensor) -> torch.Tensor:
        cal = self.calibration
        omega, weights = self._calibration_on(page_table.device)
        R = page_table.shape[0]
        phase = mean_phase(round_starts, omega)
        scores = score_rows(k_pools, page_table, cache_lengths, prompt_lengths, phase, cal, self.mode,
                            self.max_decode, self.normalize_scores, weights)
        count = (cache_lengths - prompt_lengths).clamp(0, self.max_decode).to(torch.int32)
        picked = topk(scores.view(R * self.rows, -1), count.repeat_interleave(self.rows), self.budget)
        picked = picked.view(R, self.rows, self.budget)
        return torch.where(picked >= 0, picked + prompt_lengths.view(R, 1, 1).to(torch.int32), picked)
