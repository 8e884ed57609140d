"""TriAttention selection: mean-phase coefficients -> raw scores -> normalized row scores -> top-k keep sets,
one call per round (docs/triattention.md). Every step is a kvops op with a GPU kernel and a CPU path; shapes
are static and nothing syncs with the host, so a warmed-up round captures in a CUDA graph.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._checks import INT32_MAX, check_bool, check_device, check_int, check_number
from ..distributed import all_reduce_union_rows_, check_group, check_heads_covered, check_same_on_ranks, rank_kv_heads
from .calibration import Calibration, check_calibration
from ..compaction.compact import MODES, decision_rows
from .phase import check_round_starts
from .prior import as_slot_positions, recency_prior_unchecked
from .reduce import check_k_scale_values, reduce_unchecked
from .score import check_round_inputs, score_unchecked
from ..topk import topk
from ..topk.ops import topk_unchecked


def score_rows(k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
               prompt_lengths: torch.Tensor, phase: torch.Tensor, cal: Calibration, mode: str, max_decode: int,
               normalize_scores: bool = True, weights: tuple | None = None, k_scale: torch.Tensor | None = None,
               topk_args: bool = False):
    """Row scores float32 [R, rows, max_decode] of the decode tokens (column j is cache position P + j); columns
    at or past N - P hold -inf. k_pools: per-layer [page, plane, kv_head, token, dim] views (plane 0 is K);
    phase: [R, 2, F] from mean_phase; weights: cal.score_weights() on the pools' device (made here if None).
    With `topk_args`, (rows, row_lengths, row_offsets) as reduce_unchecked gives them. The arguments are those
    TriAttentionSelector.select has checked (check_round_inputs); score() and reduce_rows() are the checked
    entries of the two steps."""
    if weights is None:
        weights = tuple(w.to(page_table.device) for w in cal.score_weights())
    raw, stats = score_unchecked(k_pools, page_table, cache_lengths, prompt_lengths, phase, weights, max_decode)
    return reduce_unchecked(raw, stats, cache_lengths, prompt_lengths, mode, cal.num_kv_heads, normalize_scores,
                            k_scale, topk_args)


class TriAttentionSelector:
    """One selection round for a batch of due requests (static shapes, no host sync, graph-capturable once warm).

    Parameters
    ----------
    calibration : Calibration
        The model's statistics (``load_calibration``); its fields are checked here (``check_calibration``: a
        device sync when it sits on a GPU).
    budget : int
        Decode tokens kept per decision row, in [1, 2**31 - 1].
    mode : str
        ``"union"`` (one row per request), ``"per_head"`` (one per KV head) or ``"per_layer_perhead"``.
    normalize_scores : bool
        z-score each (layer, head)'s scores over the request's decode tokens before reducing.
    max_decode : int, optional
        The most decode tokens a request may hold, in [budget, 2**31 - 1]; it sizes the score buffers. When None,
        each call takes the bound from its page table (``columns * page_size``), so any length the table holds is
        scored.
    k_scale : torch.Tensor, optional
        The keys' dequantization scale of an fp8 cache (vLLM's ``k_scale``): float32 ``[L]`` (per layer) or
        ``[L, Hkv]`` (per layer and KV head), positive and finite. With ``normalize_scores`` it cannot change a
        keep set (a z-score ignores a positive factor common to its (layer, head)), so it is checked and not
        used; without, every score of (layer, KV head) is multiplied by its scale. Under tensor parallelism,
        ``[L, len(kv_heads)]`` for this rank's heads.
    process_group : torch.distributed.ProcessGroup, optional
        Tensor parallelism (kvops.distributed): this rank's pools hold the KV heads `kv_heads` of every layer,
        and the other ranks of the group hold the rest. per_head and per_layer_perhead select this rank's heads'
        rows alone; union all-reduces (MAX) its row so that every rank keeps the model's set. None: one rank.
    kv_heads : range, optional
        The model's KV heads this rank holds; by default the rank's block of the even split
        (``kvops.distributed.rank_kv_heads``). The calibration is the model's: it is sliced to these heads.
    recency_prior : float
        A lean toward recent tokens, finite and >= 0: before the top-k, the row score of a decode token of age a
        (the round start less its logical position) gains ``recency_prior * clamp(1 - a / n, 0, 1)``, n the row's
        decode tokens, in the units of the row scores (z-scores when normalized; kvops.triattention.prior). It
        needs each token's logical position (``select(positions=)``). 0 (the default) adds nothing.
    """

    def __init__(self, calibration: Calibration, budget: int, mode: str = "union", normalize_scores: bool = True,
                 max_decode: int | None = None, k_scale: torch.Tensor | None = None, process_group=None,
                 kv_heads: range | None = None, recency_prior: float = 0.0):
        what = "TriAttentionSelector"
        check_calibration(what, calibration)  # first: the KV-head split below reads its fields
        self.process_group = check_group(what, process_group)
        self.kv_heads = rank_kv_heads(what, self.process_group, calibration.num_kv_heads, kv_heads)
        self.model_kv_heads = calibration.num_kv_heads
        if len(self.kv_heads) != calibration.num_kv_heads:
            calibration = calibration.for_kv_heads(self.kv_heads)
        if mode not in MODES:
            raise ValueError(f"{what}: mode must be one of {MODES}, got {mode!r}")
        check_int(what, "budget", budget, 1, INT32_MAX)
        check_bool(what, "normalize_scores", normalize_scores)
        if max_decode is not None:
            check_int(what, "max_decode", max_decode, budget, INT32_MAX)
        self.calibration, self.budget, self.mode, self.normalize_scores = calibration, budget, mode, normalize_scores
        self.max_decode = max_decode
        self.recency_prior = float(check_number(what, "recency_prior", recency_prior, 0))
        self.rows = decision_rows(mode, calibration.num_layers, calibration.num_kv_heads)
        self.k_scale = None if k_scale is None else _check_k_scale(what, k_scale, calibration)
        self._on_device: dict[torch.device, tuple] = {}

    @property
    def settings(self) -> torch.Tensor:
        """What must be the same on every rank of a process group for the ranks to run one round (int64): the
        mode, budget, max_decode (0: the table's reach), normalize_scores, the model's layers and KV heads, and the
        recency prior's bits."""
        prior = torch.tensor([self.recency_prior], dtype=torch.float64).view(torch.int64)
        return torch.cat((torch.tensor([MODES.index(self.mode), self.budget, self.max_decode or 0,
                                        self.normalize_scores, self.calibration.num_layers, self.model_kv_heads],
                                       dtype=torch.int64), prior))

    def _calibration_on(self, device: torch.device) -> tuple:
        """(omega, score weights) on `device`, copied once (at warm-up): a host-to-device copy per round would
        cost a transfer each time and cannot be captured in a CUDA graph."""
        if device not in self._on_device:
            cal = self.calibration
            k_scale = None if self.k_scale is None else self.k_scale.to(device)
            self._on_device[device] = (cal.omega.to(device), tuple(w.to(device) for w in cal.score_weights()), k_scale)
        return self._on_device[device]

    def select(self, k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
               prompt_lengths: torch.Tensor, round_starts: torch.Tensor, validate: bool = False,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """Keep sets of one round.

        Parameters
        ----------
        k_pools : list of torch.Tensor
            Per-layer 5-D views ``[page, plane, kv_head, token, dim]`` (plane 0 is K), bf16, fp16 or fp8 (e4m3fn, e5m2),
            with the calibration's layer count, KV-head count and head_dim.
        page_table : torch.Tensor
            int32 ``[R, pages]``: request r's cache position p lives in page ``page_table[r, p // page_size]``.
        cache_lengths, prompt_lengths : torch.Tensor
            int32 ``[R]``: tokens cached, and the prompt (never evicted) at their start. Host prompt lengths are
            checked to be >= 0 on every call (no sync); device ones only with `validate`.
        round_starts : torch.Tensor
            int32/int64 ``[R]``: each request's logical position (RoPE) of the round, >= 0 (checked as the
            prompt lengths are).
        validate : bool
            Check on the host (a sync) that 0 <= prompt <= cache length <= the table's reach, that round starts
            are >= 0, that no request holds more than max_decode decode tokens, and that every page-table entry
            below a cache length is inside the pools; raises ValueError naming the request. With a process group,
            first (on every rank, two or three small all-reduces) that the page table, lengths and round starts are
            the same on every rank and that the ranks' heads cover the model's. Without it, a position whose page is
            absent (-1, outside the pools, or past the table) scores -inf and ranks last, and decode tokens past an
            explicit max_decode are not scored (leave max_decode unset, or check lengths on the host as the manager
            does).
        positions : SlotPositions or torch.Tensor, optional
            The logical position of each row's decode token j (cache position P + j): a
            ``kvops.compaction.SlotPositions`` (the table a round keeps), or an int32 ``[R, rows, >= max_decode]``
            tensor with a contiguous last dim. Needed with a recency prior, and read only then.

        Returns
        -------
        torch.Tensor
            int32 ``[R, rows, budget]``: ascending cache positions of the decode tokens to keep, -1 past a
            request's decode tokens.
        """
        what = "TriAttentionSelector.select"
        cal = self.calibration
        device = check_round_inputs(what, k_pools, page_table, cache_lengths, prompt_lengths, cal.num_layers,
                                    cal.num_query_heads, cal.num_freqs)
        # query head h reads KV head h // group: pools of another model would score against the wrong heads
        heads, head_dim = k_pools[0].shape[2], k_pools[0].shape[4]
        if heads != cal.num_kv_heads:
            raise ValueError(f"{what}: k_pools have {heads} KV heads; the calibration has {cal.num_kv_heads} (for "
                             f"{cal.num_query_heads} query heads); pools and calibration must describe one model")
        if head_dim != cal.head_dim:
            raise ValueError(f"{what}: k_pools have head_dim {head_dim}; the calibration has {cal.head_dim}; "
                             f"pools and calibration must describe one model")
        check_bool(what, "validate", validate)
        check_round_starts(what, round_starts, device)
        if round_starts.shape[:1] != page_table.shape[:1]:
            raise ValueError(f"{what}: round_starts must be [{page_table.shape[0]}] (one per page-table row), got "
                             f"{tuple(round_starts.shape)}")
        max_decode = self.max_decode or page_table.shape[1] * k_pools[0].shape[3]
        if self.recency_prior:
            if positions is None:
                raise ValueError(f"{what}: a recency prior needs positions (each decode token's logical position)")
            positions = as_slot_positions(what, positions, page_table.shape[0], self.rows, max_decode, device)
        group = self.process_group
        if validate and group is not None:  # first, on every rank: then the local checks agree too
            check_same_on_ranks(what, group, device, selector_settings=self.settings, page_table=page_table,
                                cache_lengths=cache_lengths, prompt_lengths=prompt_lengths, round_starts=round_starts)
            if self.mode == "union":
                check_heads_covered(what, group, device, self.kv_heads, self.model_kv_heads)
        if validate:
            _check_round(what, k_pools, page_table, cache_lengths, prompt_lengths, round_starts, max_decode)
        omega, weights, k_scale = self._calibration_on(device)
        R = page_table.shape[0]
        # four host calls: mean phase, score, reduce (which also writes the top-k's per-row lengths and offsets: the
        # decode count and the prompt), top-k; no elementwise op between them
        phase = torch.empty((R, 2, cal.num_freqs), dtype=torch.float32, device=device)
        torch.ops.kvops.triattention_mean_phase_(round_starts.contiguous(), omega, phase)
        scores, lengths, offsets = score_rows(k_pools, page_table, cache_lengths, prompt_lengths, phase, cal, self.mode,
                                              max_decode, self.normalize_scores, weights, k_scale, topk_args=True)
        if group is not None and self.mode == "union":
            all_reduce_union_rows_(scores, lengths.view(R), group)
        if self.recency_prior:
            starts = round_starts if round_starts.dtype == torch.int32 else round_starts.to(torch.int32)
            recency_prior_unchecked(scores, lengths, starts, positions, self.recency_prior)
        # decode index i is cache position prompt + i: the top-k adds the row's prompt length as it writes
        args = (scores.view(R * self.rows, scores.shape[-1]), lengths.view(-1), self.budget)
        picked = topk(*args, offsets=offsets.view(-1), validate=True) if validate else \
            topk_unchecked(*args, offsets=offsets.view(-1))
        return picked.view(R, self.rows, self.budget)


def _check_k_scale(what: str, k_scale, cal: Calibration) -> torch.Tensor:
    """k_scale as float32 [L, Hkv] (a per-layer scale repeated over the KV heads), on the host once: refused
    unless float32, [L] or [L, Hkv], positive and finite."""
    L, Hkv = cal.num_layers, cal.num_kv_heads
    if not isinstance(k_scale, torch.Tensor) or k_scale.dtype != torch.float32:
        raise TypeError(f"{what}: k_scale must be a float32 tensor, got "
                        f"{getattr(k_scale, 'dtype', type(k_scale).__name__)}")
    check_device(what, k_scale=k_scale)  # a meta one has no values to read
    if tuple(k_scale.shape) not in ((L,), (L, Hkv)):
        raise ValueError(f"{what}: k_scale must be [{L}] (per layer) or [{L}, {Hkv}] (per layer and KV head), got "
                         f"{tuple(k_scale.shape)}")
    host = k_scale.detach().cpu()
    check_k_scale_values(what, host)
    return host.reshape(L, -1).expand(L, Hkv).contiguous()


def _check_round(what: str, k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
                 prompt_lengths: torch.Tensor, round_starts: torch.Tensor, max_decode: int) -> None:
    """The lengths, round starts and page-table entries a round reads, read back on the host (a sync)."""
    P, T = k_pools[0].shape[0], k_pools[0].shape[3]
    n, p, table = cache_lengths.long().cpu(), prompt_lengths.long().cpu(), page_table.long().cpu()

    def fail(bad: torch.Tensor, message) -> None:
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            raise ValueError(f"{what}: request {r} (prompt {int(p[r])}, cache length {int(n[r])}): {message}")

    fail((p < 0) | (n < p), "prompt_lengths and cache_lengths need 0 <= prompt <= cache length")
    fail(round_starts.cpu() < 0, "round_starts must be >= 0")
    fail(n > table.shape[1] * T, f"the cache length exceeds the page table ({table.shape[1]} pages of {T})")
    fail(n - p > max_decode, f"more decode tokens than max_decode={max_decode}; they would not be scored")
    cols = torch.arange(table.shape[1])
    read = (cols >= (p // T)[:, None]) & (cols * T < n[:, None])
    fail((read & ((table < 0) | (table >= P))).any(1), f"a page-table entry it reads is outside [0, {P})")
