"""Slot positions: the logical position of every decode slot, followed through the compaction's permutation
(Triton, plain torch on the CPU).

A compaction in fill order leaves the slots out of time order (the newest tokens fill the evicted slots), so what
needs a token's age (TriAttention's recency prior) reads it from a table kept per request: ``table[seat, row, j]``
is the logical position of the token in decode slot j (cache position P + j) of the request's decision row, for
j below the request's stored count; the slots from there on were written since its last round, in order, so slot
j holds position ``base + j``, where base is the request's logical position less its cache length, plus P. Two
ops keep it:

- ``gather_slot_positions_`` writes the positions of a round's requests, stored or in order, into a dense
  ``[R, rows, width]`` buffer (what ``TriAttentionSelector.select(positions=)`` reads);
- ``follow_slot_positions_`` after the round's compaction: slot m of each request's row receives the position of
  what landed there, ``sources[r, row, m]`` (pack.py: the old cache position of the token that ends at
  ``destination_bases[r] + m``), read from the dense buffer, for m below the new length; the new stored count is
  ``new_lengths[r] - destination_bases[r]``. The table is written, the dense buffer read: no slot is read after
  it is written.

A table row may be a subset of the compaction's list rows (``list_rows``: the decision rows of the scored layers).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _triton
from .._checks import check_disjoint, check_int32
from .._dispatch import python_op, triton_launcher
from .reference import follow_slot_positions_torch, gather_slot_positions_torch

_BLOCK = 512


@triton.jit
def _gather_kernel(table, t_stride_s, t_stride_row, seats, stored, bases, out, o_stride_r, o_stride_row, width,
                   BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.program_id(1)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    seat = tl.load(seats + r).to(tl.int64)
    held = tl.load(stored + r)
    inside = j < width
    p = tl.load(table + seat * t_stride_s + row.to(tl.int64) * t_stride_row + j, mask=inside & (j < held), other=0)
    p = tl.where(j < held, p, tl.load(bases + r) + j)
    tl.store(out + r.to(tl.int64) * o_stride_r + row.to(tl.int64) * o_stride_row + j, p, mask=inside)


@triton.jit
def _follow_kernel(table, t_stride_s, t_stride_row, seats, dense, d_stride_r, d_stride_row, sources,
                   s_stride_r, s_stride_row, list_rows, destination_bases, new_lengths, width, capacity,
                   MAPPED: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.program_id(1)
    m = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    base = tl.load(destination_bases + r)
    n = tl.minimum(tl.load(new_lengths + r) - base, capacity)
    lrow = tl.load(list_rows + row) if MAPPED else row
    keep = m < n
    src = tl.load(sources + r.to(tl.int64) * s_stride_r + lrow.to(tl.int64) * s_stride_row + m, mask=keep,
                  other=-1) - base
    ok = keep & (src >= 0) & (src < width)
    p = tl.load(dense + r.to(tl.int64) * d_stride_r + row.to(tl.int64) * d_stride_row + src, mask=ok, other=-1)
    seat = tl.load(seats + r).to(tl.int64)
    tl.store(table + seat * t_stride_s + row.to(tl.int64) * t_stride_row + m, p, mask=keep)


# built ahead of time (kvops/_triton.py)
_GATHER = _triton.Kernel("compaction_gather_slot_positions", _gather_kernel, {
    "table": "*i32", "t_stride_s": "i64", "t_stride_row": "i64", "seats": "*i32", "stored": "*i32", "bases": "*i32",
    "out": "*i32", "o_stride_r": "i64", "o_stride_row": "i64", "width": "i32"}, variants=[{"BLOCK": _BLOCK}])
_FOLLOW = _triton.Kernel("compaction_follow_slot_positions", _follow_kernel, {
    "table": "*i32", "t_stride_s": "i64", "t_stride_row": "i64", "seats": "*i32", "dense": "*i32",
    "d_stride_r": "i64", "d_stride_row": "i64", "sources": "*i32", "s_stride_r": "i64", "s_stride_row": "i64",
    "list_rows": "*i32", "destination_bases": "*i32", "new_lengths": "*i32", "width": "i32", "capacity": "i32"},
    variants=[{"MAPPED": False, "BLOCK": _BLOCK}, {"MAPPED": True, "BLOCK": _BLOCK}])


def _gather_launch(table: torch.Tensor, seats: torch.Tensor, stored: torch.Tensor, bases: torch.Tensor,
                   out: torch.Tensor) -> None:
    R, rows, width = out.shape
    launch = triton_launcher(_GATHER, out.device)
    if launch is None:
        gather_slot_positions_torch(table, seats, stored, bases, out)
    elif R and rows and width:
        launch[(R, rows, triton.cdiv(width, _BLOCK))](table, table.stride(0), table.stride(1), seats, stored, bases,
                                                       out, out.stride(0), out.stride(1), width, BLOCK=_BLOCK)


def _follow_launch(table: torch.Tensor, seats: torch.Tensor, dense: torch.Tensor, sources: torch.Tensor,
                   list_rows: Optional[torch.Tensor], destination_bases: torch.Tensor, new_lengths: torch.Tensor) -> None:
    R, rows, width = dense.shape
    capacity = min(table.shape[2], sources.shape[2])
    launch = triton_launcher(_FOLLOW, dense.device)
    if launch is None:
        follow_slot_positions_torch(table, seats, dense, sources, list_rows, destination_bases, new_lengths)
    elif R and rows and capacity:
        launch[(R, rows, triton.cdiv(capacity, _BLOCK))](
            table, table.stride(0), table.stride(1), seats, dense, dense.stride(0), dense.stride(1), sources,
            sources.stride(0), sources.stride(1), seats if list_rows is None else list_rows, destination_bases,
            new_lengths, width, capacity, MAPPED=list_rows is not None, BLOCK=_BLOCK)


_gather_op = python_op("compaction_gather_slot_positions_", mutates_args={"out"})(_gather_launch)
_follow_op = python_op("compaction_follow_slot_positions_", mutates_args={"table"})(_follow_launch)


def _check_table(what: str, table: torch.Tensor, seats: torch.Tensor, rows: int, R: int) -> torch.device:
    device = check_int32(what, table=(table, 3), seats=(seats, 1))
    if table.shape[1] != rows or (table.shape[2] > 1 and table.stride(2) != 1) or seats.shape[0] != R:
        raise ValueError(f"{what}: table must be int32 [seats, {rows}, width] with a contiguous last dim and seats "
                         f"[{R}], got {tuple(table.shape)} strides {table.stride()} and {tuple(seats.shape)}")
    return device


def gather_slot_positions_(table: torch.Tensor, seats: torch.Tensor, stored: torch.Tensor, bases: torch.Tensor,
                           out: torch.Tensor) -> torch.Tensor:
    """The logical positions of R requests' decode slots, from the table or in order (module docstring).

    Parameters
    ----------
    table : torch.Tensor
        int32 ``[S, rows, C]``, last dim contiguous: per seat, the stored positions.
    seats, stored, bases : torch.Tensor
        int32 ``[R]``: each request's seat in [0, S), its stored slots (at most C), and the logical position
        slot 0 would hold in order (its logical position less its cache length, plus P).
    out : torch.Tensor
        int32 ``[R, rows, width]``, last dim contiguous: receives slot j's position for every j < width.

    Seats, stored counts and bases are read on the device unchecked (a seat outside [0, S) reads out of bounds:
    the caller keeps them, as TriAttentionManager does). Returns `out`.
    """
    what = "gather_slot_positions_"
    device = check_int32(what, out=(out, 3), stored=(stored, 1), bases=(bases, 1))
    R, rows, _ = out.shape
    _check_table(what, table, seats, rows, R)
    check_int32(what, device, table=(table, 3))
    if stored.shape[0] != R or bases.shape[0] != R or (out.shape[2] > 1 and out.stride(2) != 1):
        raise ValueError(f"{what}: stored and bases must be [{R}] and out's last dim contiguous")
    check_disjoint(what, "tensors", [out], [("table", table), ("seats", seats), ("stored", stored),
                                           ("bases", bases)])
    _gather_op(table, seats, stored, bases, out)
    return out


def follow_slot_positions_(table: torch.Tensor, seats: torch.Tensor, dense: torch.Tensor, sources: torch.Tensor,
                           destination_bases: torch.Tensor, new_lengths: torch.Tensor,
                           list_rows: torch.Tensor | None = None) -> torch.Tensor:
    """After a compaction: each request's table row takes the positions of what landed in its slots (module
    docstring).

    Parameters
    ----------
    table : torch.Tensor
        int32 ``[S, rows, C]``, last dim contiguous: written at the requests' seats, slots m < new length - base
        (and < C).
    seats : torch.Tensor
        int32 ``[R]``: each request's seat in [0, S) (read on the device unchecked).
    dense : torch.Tensor
        int32 ``[R, rows, width]``: the positions before the compaction (``gather_slot_positions_``).
    sources, destination_bases, new_lengths : torch.Tensor
        The compaction's lists (``CompactionParams``): int32 ``[R, list_rows, capacity]``, ``[R]``, ``[R]``. A
        source outside the dense buffer (a refused request's -1) gives position -1.
    list_rows : torch.Tensor, optional
        int32 ``[rows]``: the list row of each table row (the identity when None).

    Returns `table`.
    """
    what = "follow_slot_positions_"
    device = check_int32(what, dense=(dense, 3), sources=(sources, 3), destination_bases=(destination_bases, 1),
                         new_lengths=(new_lengths, 1))
    R, rows, _ = dense.shape
    _check_table(what, table, seats, rows, R)
    check_int32(what, device, table=(table, 3), **({} if list_rows is None else {"list_rows": (list_rows, 1)}))
    if sources.shape[0] != R or destination_bases.shape[0] != R or new_lengths.shape[0] != R or \
            (list_rows is None and sources.shape[1] < rows) or (list_rows is not None and list_rows.shape[0] != rows):
        raise ValueError(f"{what}: sources [{R}, list rows, capacity], destination_bases and new_lengths [{R}] and "
                         f"list_rows [{rows}] (or None, with at least {rows} list rows)")
    for name, t in (("dense", dense), ("sources", sources)):
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{what}: {name} needs a contiguous last dim")
    check_disjoint(what, "tensors", [table], [("dense", dense), ("sources", sources), ("seats", seats),
                                             ("destination_bases", destination_bases), ("new_lengths", new_lengths)]
                   + ([] if list_rows is None else [("list_rows", list_rows)]))
    _follow_op(table, seats, dense, sources, list_rows, destination_bases, new_lengths)
    return table
