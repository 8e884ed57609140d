"""TriAttention's recency prior (``kvops::triattention_recency_prior_``; Triton, plain torch on the CPU): before the
top-k, each row score of a decode token gains ``prior * clamp(1 - age / n, 0, 1)``, where age is the round's logical
position less the token's and n is the row's decode tokens. The newest tokens gain about `prior`, those older than
n positions nothing: in z-score units, a lean toward recent tokens that the scores can still overrule. It reads
each token's logical position, not its slot: a fill-order compaction leaves slots out of time order
(``kvops.compaction.positions``). Measured on a trained model in benchmarks/RESULTS.md, "Eviction quality".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _triton
from .._checks import check_device, check_float32, check_int32, check_number, overlap
from .._dispatch import python_op, triton_launcher
from ..compaction.positions import SlotPositions, check_slot_positions
from .reference import recency_prior_torch

_BLOCK = 1024


@triton.jit
def _prior_kernel(scores, lengths, round_starts, table, t_stride_s, t_stride_row, seats, stored, bases, prior, n,
                  BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.program_id(1)
    rows = tl.num_programs(1)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    length = tl.load(lengths + r * rows + row)
    q = tl.load(round_starts + r)
    held = tl.load(stored + r)
    keep = j < length
    at = table + tl.load(seats + r).to(tl.int64) * t_stride_s + row.to(tl.int64) * t_stride_row
    p = tl.where(j < held, tl.load(at + j, mask=keep & (j < held), other=0), tl.load(bases + r) + j)
    ramp = 1.0 - (q - p).to(tl.float32) / tl.maximum(length, 1).to(tl.float32)
    ramp = tl.minimum(tl.maximum(ramp, 0.0), 1.0)
    out = scores + (r.to(tl.int64) * rows + row) * n + j
    tl.store(out, tl.load(out, mask=keep) + prior * ramp, mask=keep)


# built ahead of time (kvops/_triton.py): one variant
_PRIOR = _triton.Kernel("triattention_recency_prior", _prior_kernel, {
    "scores": "*fp32", "lengths": "*i32", "round_starts": "*i32", "table": "*i32", "t_stride_s": "i64",
    "t_stride_row": "i64", "seats": "*i32", "stored": "*i32", "bases": "*i32", "prior": "fp32", "n": "i32"},
    variants=[{"BLOCK": _BLOCK}])


def _prior_launch(scores: torch.Tensor, lengths: torch.Tensor, round_starts: torch.Tensor, table: torch.Tensor,
                  seats: torch.Tensor, stored: torch.Tensor, bases: torch.Tensor, prior: float) -> None:
    R, rows, n = scores.shape
    launch = triton_launcher(_PRIOR, scores.device)
    if launch is None:
        recency_prior_torch(scores, lengths, round_starts, SlotPositions(table, seats, stored, bases), prior)
    elif R and rows and n:
        launch[(R, rows, triton.cdiv(n, _BLOCK))](scores, lengths, round_starts, table, table.stride(0),
                                                  table.stride(1), seats, stored, bases, prior, n, BLOCK=_BLOCK)


_prior_op = python_op("triattention_recency_prior_", mutates_args={"scores"})(_prior_launch)


def recency_prior_unchecked(scores, lengths, round_starts, positions: SlotPositions, prior: float) -> None:
    """add_recency_prior_() on arguments its checks have passed (the selector's fresh row scores)."""
    _prior_op(scores, lengths, round_starts, *positions, prior)


def as_slot_positions(what: str, positions, R: int, rows: int, n: int, device: torch.device) -> SlotPositions:
    """`positions` checked: a SlotPositions for R requests and `rows` rows, or an int32 tensor [R, rows, >= n] with
    a contiguous last dim (every slot stored; ``SlotPositions.dense``)."""
    if isinstance(positions, torch.Tensor):
        check_int32(what, device, positions=(positions, 3))
        if positions.shape[0] != R or positions.shape[1] != rows or positions.shape[2] < n or \
                (positions.shape[2] > 1 and positions.stride(2) != 1):
            raise ValueError(f"{what}: positions must be int32 [{R}, {rows}, >= {n}] with a contiguous last dim, got "
                             f"{tuple(positions.shape)} strides {positions.stride()}")
        return SlotPositions.dense(positions)
    check_slot_positions(what, positions, R, rows, device)
    return positions


def add_recency_prior_(scores: torch.Tensor, lengths: torch.Tensor, round_starts: torch.Tensor,
                       positions: SlotPositions | torch.Tensor, prior: float) -> torch.Tensor:
    """Add the recency prior to row scores in place (module docstring).

    Parameters
    ----------
    scores : torch.Tensor
        float32 ``[R, rows, n]``, contiguous: the row scores (``score_rows``); column j is decode token j. Columns
        at or past a row's length are not touched.
    lengths : torch.Tensor
        int32 ``[R, rows]``, contiguous: each row's decode tokens (the top-k's row lengths).
    round_starts : torch.Tensor
        int32 ``[R]``: each request's logical position of the round (the next token's).
    positions : SlotPositions or torch.Tensor
        The logical position of each row's decode token j: a ``kvops.compaction.SlotPositions`` (a table, read
        through each request's seat, stored count and base), or an int32 ``[R, rows, >= n]`` tensor with a
        contiguous last dim.
    prior : float
        The weight, finite and >= 0.

    Returns
    -------
    torch.Tensor
        `scores`.
    """
    what = "add_recency_prior_"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
        raise ValueError(f"{what}: scores must be a 3-D float32 tensor [R, rows, n], got "
                         f"{getattr(scores, 'shape', type(scores).__name__)}")
    device = check_device(what, scores=scores)
    R, rows, n = scores.shape
    check_float32(what, device, scores=(scores, (R, rows, n)))
    check_int32(what, device, lengths=(lengths, 2), round_starts=(round_starts, 1))
    if tuple(lengths.shape) != (R, rows) or not lengths.is_contiguous() or round_starts.shape[0] != R:
        raise ValueError(f"{what}: lengths must be contiguous [{R}, {rows}] and round_starts [{R}], got "
                         f"{tuple(lengths.shape)} and {tuple(round_starts.shape)}")
    positions = as_slot_positions(what, positions, R, rows, n, device)
    check_number(what, "prior", prior, 0)
    for name, t in (("lengths", lengths), ("round_starts", round_starts), *zip(SlotPositions._fields, positions)):
        if overlap(scores, t):
            raise ValueError(f"{what}: scores shares memory with {name}")
    recency_prior_unchecked(scores, lengths, round_starts, positions, float(prior))
    return scores

