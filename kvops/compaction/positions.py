"""Slot positions: the logical position of every decode slot, followed through the compaction's permutation
(Triton, plain torch on the CPU).

A compaction in fill order leaves the slots out of time order (the newest tokens fill the evicted slots), so what
needs a token's age (TriAttention's recency prior) reads it from a table kept per request, a ``SlotPositions``:
``table[seats[r], row, j]`` is the logical position of the token in decode slot j (cache position P + j) of
request r's decision row, for j below ``stored[r]``; the slots from there on were written since the request's last
round, in order, so slot j holds position ``bases[r] + j`` (bases: the request's logical position less its cache
length, plus P). ``follow_slot_positions_`` keeps the table after a round's compaction: slot m of each request's
row receives the position of what landed there, ``sources[r, row, m]`` (pack.py: the old cache position of the
token that ends at ``destination_bases[r] + m``), for m below the new length; the caller's new stored count is
``new_lengths[r] - destination_bases[r]``. In place, in one launch:

- in fill order (with the compaction's ``moves``) it writes only the slots that move, and the slots past the old
  stored count that stay (they were in order; now they are stored). Every moved token comes from at or past the
  new length, where nothing is written, so no slot is read after it is written;
- in order, sources never lie below their slot (pack.py's contract): each program walks its row in ascending
  blocks, every load of a block before any store (a CTA barrier), so a slot is read before it is overwritten.

A table row may be a subset of the compaction's list rows (``list_rows``: the decision rows of the scored layers).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .. import _triton
from .._checks import check_disjoint, check_int32
from .._dispatch import python_op, triton_launcher
from .reference import follow_slot_positions_torch

_BLOCK = 256


class SlotPositions(NamedTuple):
    """The logical positions of R requests' decode slots (module docstring): int32 ``table`` [S, rows, C] (last
    dim contiguous), and int32 ``seats``, ``stored``, ``bases`` [R]. Seats in [0, S), distinct, and stored counts
    in [0, C] are the caller's to keep: host seats are checked on every call; device ones are read on the device,
    where a seat outside [0, S) writes nothing (no sync to check them), and distinct seats are trusted."""

    table: torch.Tensor
    seats: torch.Tensor
    stored: torch.Tensor
    bases: torch.Tensor

    @classmethod
    def dense(cls, positions: torch.Tensor) -> "SlotPositions":
        """Every slot stored: positions int32 [R, rows, width] (request r in seat r). Allocates three [R]
        tensors; a round keeps a table instead."""
        R, device = positions.shape[0], positions.device
        return cls(positions, torch.arange(R, dtype=torch.int32, device=device),
                   torch.full((R,), positions.shape[2], dtype=torch.int32, device=device),
                   torch.zeros(R, dtype=torch.int32, device=device))


def check_slot_positions(what: str, positions: SlotPositions, R: int, rows: int | None,
                         device: torch.device) -> None:
    """A SlotPositions for R requests of `rows` table rows (any number when None) on `device`."""
    if not isinstance(positions, SlotPositions):
        raise TypeError(f"{what}: positions must be a kvops.compaction.SlotPositions or an int32 tensor, got "
                        f"{type(positions).__name__}")
    table, seats, stored, bases = positions
    check_int32(what, device, table=(table, 3), seats=(seats, 1), stored=(stored, 1), bases=(bases, 1))
    if (rows is not None and table.shape[1] != rows) or (table.shape[2] > 1 and table.stride(2) != 1) or \
            not seats.shape[0] == stored.shape[0] == bases.shape[0] == R:
        raise ValueError(f"{what}: positions.table must be int32 [seats, {rows or 'rows'}, width] with a contiguous "
                         f"last dim, and seats, stored and bases [{R}]; got {tuple(table.shape)} strides {table.stride()}, "
                         f"{tuple(seats.shape)}, {tuple(stored.shape)}, {tuple(bases.shape)}")


@triton.jit
def _follow_kernel(table, t_stride_s, t_stride_row, seats, stored, bases, sources, s_stride_r, s_stride_row, moves,
                   list_rows, destination_bases, new_lengths, capacity, seat_count, MAPPED: tl.constexpr,
                   FILL: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.program_id(1)
    seat = tl.load(seats + r)
    seated = (seat >= 0) & (seat < seat_count)  # a seat outside the table writes nothing (n = -1 runs no loop)
    at = table + tl.where(seated, seat, 0).to(tl.int64) * t_stride_s + row.to(tl.int64) * t_stride_row
    held = tl.maximum(tl.load(stored + r), 0)
    first = tl.load(bases + r)
    base = tl.load(destination_bases + r)
    n = tl.where(seated, tl.minimum(tl.load(new_lengths + r) - base, capacity), -1)
    lrow = tl.load(list_rows + row) if MAPPED else row
    lists = r.to(tl.int64) * s_stride_r + lrow.to(tl.int64) * s_stride_row
    i = tl.arange(0, BLOCK)
    if FILL:
        start = 0
        more = n > 0
        while more:  # the moves, ascending then -1: until a block holds a -1
            m = tl.load(moves + lists + start + i, mask=start + i < n, other=-1)
            ok = (m >= 0) & (m < n)
            src = tl.load(sources + lists + m, mask=ok, other=-1) - base
            stays = (src >= 0) & (src < held)
            p = tl.where(stays, tl.load(at + src, mask=ok & stays, other=0), first + src)
            tl.store(at + m, tl.where(src >= 0, p, -1), mask=ok)
            start += BLOCK
            more = (start < n) & (tl.min(m) >= 0)
        start = held
        while start < n:  # slots past the stored ones whose token stays: in order
            m = start + i
            src = tl.load(sources + lists + m, mask=m < n, other=-1) - base
            tl.store(at + m, first + m, mask=(m < n) & (src == m))
            start += BLOCK
    else:
        start = 0
        while start < n:  # (while loops: bounds loaded at run time, in the interpreter too)
            m = start + i
            src = tl.load(sources + lists + m, mask=m < n, other=-1) - base
            stays = (src >= 0) & (src < held)
            p = tl.where(stays, tl.load(at + src, mask=(m < n) & stays, other=0), first + src)
            tl.debug_barrier()  # every load of the block before any store: a source may be another lane's slot
            tl.store(at + m, tl.where(src >= 0, p, -1), mask=m < n)
            tl.debug_barrier()
            start += BLOCK


# built ahead of time (kvops/_triton.py)
_FOLLOW = _triton.Kernel("compaction_follow_slot_positions", _follow_kernel, {
    "table": "*i32", "t_stride_s": "i64", "t_stride_row": "i64", "seats": "*i32", "stored": "*i32", "bases": "*i32",
    "sources": "*i32", "s_stride_r": "i64", "s_stride_row": "i64", "moves": "*i32", "list_rows": "*i32",
    "destination_bases": "*i32", "new_lengths": "*i32", "capacity": "i32", "seat_count": "i32"},
    variants=[{"MAPPED": mapped, "FILL": fill, "BLOCK": _BLOCK} for mapped in (False, True) for fill in (False, True)])


def _follow_launch(table: torch.Tensor, seats: torch.Tensor, stored: torch.Tensor, bases: torch.Tensor,
                   sources: torch.Tensor, moves: Optional[torch.Tensor], list_rows: Optional[torch.Tensor],
                   destination_bases: torch.Tensor, new_lengths: torch.Tensor) -> None:
    R, rows = seats.shape[0], table.shape[1]
    launch = triton_launcher(_FOLLOW, table.device)
    if launch is None:
        follow_slot_positions_torch(table, seats, stored, bases, sources, list_rows, destination_bases, new_lengths)
    elif R and rows:
        launch[(R, rows)](table, table.stride(0), table.stride(1), seats, stored, bases, sources, sources.stride(0),
                          sources.stride(1), sources if moves is None else moves, seats if list_rows is None
                          else list_rows, destination_bases, new_lengths, min(table.shape[2], sources.shape[2]),
                          table.shape[0], MAPPED=list_rows is not None, FILL=moves is not None, BLOCK=_BLOCK)


_follow_op = python_op("compaction_follow_slot_positions_", mutates_args={"table"})(_follow_launch)


def follow_slot_positions_(positions: SlotPositions, sources: torch.Tensor, destination_bases: torch.Tensor,
                           new_lengths: torch.Tensor, moves: torch.Tensor | None = None,
                           list_rows: torch.Tensor | None = None) -> torch.Tensor:
    """After a compaction: each request's table row takes the positions of what landed in its slots (module
    docstring). Returns ``positions.table``.

    Parameters
    ----------
    positions : SlotPositions
        The table as it was before the compaction, with the requests' seats, stored counts and bases; written in
        place at their seats, slots m below the new length less the base (and the table's width).
    sources, destination_bases, new_lengths : torch.Tensor
        The compaction's lists (``CompactionParams``): int32 ``[R, list_rows, capacity]`` (last dim contiguous),
        ``[R]``, ``[R]``. A request the compaction refused (-1 lists) gets -1 positions.
    moves : torch.Tensor, optional
        The compaction's moves in fill order (the shape of sources, contiguous): only the slots that move, and
        those past the stored ones, are written. None: lists in order.
    list_rows : torch.Tensor, optional
        int32 ``[rows]``: the list row of each table row, in [0, list_rows) (the identity when None).
    """
    what = "follow_slot_positions_"
    device = check_int32(what, sources=(sources, 3), destination_bases=(destination_bases, 1),
                         new_lengths=(new_lengths, 1), **({} if moves is None else {"moves": (moves, 3)}),
                         **({} if list_rows is None else {"list_rows": (list_rows, 1)}))
    R = sources.shape[0]
    check_slot_positions(what, positions, R, None, device)
    rows = positions.table.shape[1]
    if destination_bases.shape[0] != R or new_lengths.shape[0] != R or \
            (list_rows is None and sources.shape[1] < rows) or (list_rows is not None and list_rows.shape[0] != rows) \
            or (sources.shape[2] > 1 and sources.stride(2) != 1) or \
            (moves is not None and (moves.shape != sources.shape or not moves.is_contiguous())):
        raise ValueError(f"{what}: sources [{R}, list rows, capacity] (last dim contiguous), destination_bases and "
                         f"new_lengths [{R}], moves like sources (contiguous) and list_rows [{rows}] (or None, with "
                         f"at least {rows} list rows)")
    if list_rows is not None and list_rows.device.type == "cpu" and list_rows.numel() and \
            not torch.compiler.is_compiling() and \
            not 0 <= int(list_rows.min()) <= int(list_rows.max()) < sources.shape[1]:
        raise ValueError(f"{what}: list_rows must lie in [0, {sources.shape[1]}), got {list_rows.tolist()}")
    table, seats, stored, bases = positions
    if seats.device.type == "cpu" and seats.numel() and not torch.compiler.is_compiling():
        bad = (seats < 0) | (seats >= table.shape[0])
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            raise ValueError(f"{what}: positions.seats[{r}] = {int(seats[r])} is outside the table's "
                             f"{table.shape[0]} seats [0, {table.shape[0]})")
    check_disjoint(what, "tensors", [table], [("seats", seats), ("stored", stored), ("bases", bases),
                                             ("sources", sources), ("destination_bases", destination_bases),
                                             ("new_lengths", new_lengths)]
                   + [(name, t) for name, t in (("moves", moves), ("list_rows", list_rows)) if t is not None])
    _follow_op(table, seats, stored, bases, sources, moves, list_rows, destination_bases, new_lengths)
    return table
