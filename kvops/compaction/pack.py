"""pack_move_sources: decisions, tails and windows -> per-request move lists, one launch per batch (Triton in
order, the native kvops::compaction_fill_lists_ in fill order).

Request r gets `list_rows` lists of equal length n_r = K + tail_lengths[r], stored padded in
``sources[r, row, :]`` (capacity K + max_tail, -1 past the end):

- rows ``0 .. rows-1``: ``kept[r, row]`` (the decision), then the tail ``scored_length .. +tail``;
- row ``rows`` (only when sources has one more row than kept): the window row, the latest K scored
  tokens ``scored_length - K .. scored_length``, then the tail. With ``window_offsets`` (fill order only) the
  window is a ring instead: the K tokens above the base are in time order from slot ``base + window_offsets[r]``,
  wrapping at ``base + K``, and the scored tokens past ``base + K`` follow in order. The e = scored_length - base
  - K oldest are evicted; the newest e take their slots, in order, and the tail moves down by e, so the ring's
  offset becomes ``(window_offsets[r] + e) % K`` (the caller keeps it) and only e + tail tokens move, where in
  order every one of the K + tail does.

Lists in order (the default) move every kept token behind the first evicted one down. In fill order
(with a ``moves`` buffer; the decision rows only, since a sliding-window layer needs its tokens in order) only the
tokens that sit at or past the new length move, each into an evicted slot below it: with U = the kept
positions then the tail (ascending) and s of them below the new length, those s stay where they are
(their list entry is their own position, which the move skips), and the j-th free slot below the new
length, in ascending order, takes U[s + j]. Either way ``sources[r, row, m]`` is the old position of the
token that ends at ``destination_bases[r] + m``: the permutation an engine needs for per-slot metadata.

Fill order also writes ``moves`` (the shape of sources): per list row, the ascending indices m whose token
actually moves (source != destination: the free slots of a decision row), then -1. The compaction walks
those instead of the whole list, so a round that evicts beta of K + beta tokens touches about beta per row.

``new_lengths[r] = destination_bases[r] + n_r``. A request whose tail does not fit (outside
[0, capacity - K]), whose destination base lies outside [0, scored_length - K] (no decision fits above it, and
base + n_r could overflow int32), whose scored_length + tail does not fit int32, or whose window offset lies
outside [0, K) gets lists of -1 (nothing moves) and ``new_lengths[r] = scored_length + max(tail, 0)``, its length before the round (saturated to
[0, 2**31 - 1]).
Padding (rather than ragged offsets) keeps every shape static for CUDA graphs and means a bad tail can never
push a list into another request's.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _triton
from .._checks import check_disjoint, check_int32, check_no_meta_mix, overlap
from .._dispatch import python_op, triton_launcher
from .reference import pack_move_sources_torch

_BLOCK = 512


@triton.jit
def _pack_kernel(kept, kept_stride_r, kept_stride_row, scored_lengths, tail_lengths, destination_bases,
                 sources, new_lengths, rows, K, capacity, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.program_id(1)
    list_rows = tl.num_programs(1)
    m = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    scored = tl.load(scored_lengths + r)
    tail = tl.load(tail_lengths + r)
    base = tl.load(destination_bases + r)
    before = scored.to(tl.int64) + tl.maximum(tail, 0)  # the length before the round
    # the request stays as it is: a tail the lists cannot hold, a base no decision fits above (base + K + tail
    # could overflow), or a length past int32
    refused = (tail < 0) | (tail > capacity - K) | (base < 0) | (base.to(tl.int64) + K > scored) | \
        (before > 2147483647)
    in_kept = m < K
    if row < rows:
        head = tl.load(kept + r.to(tl.int64) * kept_stride_r + row * kept_stride_row + m, mask=in_kept, other=-1)
    else:  # window row: the latest K scored tokens, ascending
        head = scored - K + m
    src = tl.where(in_kept, head, tl.where(m < K + tail, scored + (m - K), -1))
    src = tl.where(refused, -1, src)
    tl.store(sources + (r.to(tl.int64) * list_rows + row) * capacity + m, src, mask=m < capacity)
    if (row == 0) & (tl.program_id(2) == 0):
        length = tl.where(refused, tl.minimum(tl.maximum(before, 0), 2147483647), base.to(tl.int64) + K + tail)
        tl.store(new_lengths + r, length.to(tl.int32))


# built ahead of time (kvops/_triton.py): one variant
_PACK = _triton.Kernel("compaction_pack", _pack_kernel, {
    "kept": "*i32", "kept_stride_r": "i64", "kept_stride_row": "i64", "scored_lengths": "*i32",
    "tail_lengths": "*i32", "destination_bases": "*i32", "sources": "*i32", "new_lengths": "*i32", "rows": "i32",
    "K": "i32", "capacity": "i32"}, variants=[{"BLOCK": _BLOCK}])


def _pack_launch(kept: torch.Tensor, scored_lengths: torch.Tensor, tail_lengths: torch.Tensor,
                 destination_bases: torch.Tensor, sources: torch.Tensor, new_lengths: torch.Tensor,
                 moves: Optional[torch.Tensor], window_offsets: Optional[torch.Tensor] = None) -> None:
    R, rows, K = kept.shape
    capacity = sources.shape[2]
    if moves is not None:  # fill order: every list row and the new lengths in one native launch
        torch.ops.kvops.compaction_fill_lists_(kept, scored_lengths, tail_lengths, destination_bases, sources,
                                               new_lengths, moves, window_offsets)
        return
    launch = triton_launcher(_PACK, kept.device)
    if launch is None:
        pack_move_sources_torch(kept, scored_lengths, tail_lengths, destination_bases, sources, new_lengths)
        return
    grid = (R, sources.shape[1], max(1, triton.cdiv(capacity, _BLOCK)))  # >= 1: new_lengths even when K + max_tail == 0
    launch[grid](kept, kept.stride(0), kept.stride(1), scored_lengths, tail_lengths,
                 destination_bases, sources, new_lengths, rows, K, capacity, BLOCK=_BLOCK)


@torch.library.register_fake("kvops::compaction_fill_lists_")
def _fill_lists_fake(kept, scored_lengths, tail_lengths, destination_bases, sources, new_lengths, moves,
                     window_offsets=None):
    check_no_meta_mix("compaction_fill_lists_", kept, scored_lengths, tail_lengths, destination_bases, sources,
                      new_lengths, moves, *([] if window_offsets is None else [window_offsets]))


_pack_op = python_op("compaction_pack_move_sources_", mutates_args={"sources", "new_lengths", "moves"})(_pack_launch)


def pack_move_sources(kept: torch.Tensor, scored_lengths: torch.Tensor, tail_lengths: torch.Tensor,
                      destination_bases: torch.Tensor, sources: torch.Tensor, new_lengths: torch.Tensor,
                      moves: Optional[torch.Tensor] = None, window_offsets: Optional[torch.Tensor] = None) -> None:
    """Write the move lists of a batch into ``sources`` [R, list_rows, capacity] and ``new_lengths`` [R].

    kept: int32 [R, rows, K]; scored_lengths, tail_lengths, destination_bases: int32 [R].
    list_rows is rows (no window row) or rows + 1; capacity >= K (capacity - K is the tail room).
    moves: int32, the shape of sources. When given, the decision rows' lists are in fill order (module docstring;
    the window row stays in order) and moves receives the indices that move.
    window_offsets: int32 [R], fill order with a window row only: the window row is a ring starting at each
    request's offset (module docstring).
    The outputs (sources, new_lengths, moves) share no memory with each other or with the inputs.
    """
    what = "pack_move_sources"
    check_int32(what, kept=(kept, 3), scored_lengths=(scored_lengths, 1), tail_lengths=(tail_lengths, 1),
                destination_bases=(destination_bases, 1), sources=(sources, 3), new_lengths=(new_lengths, 1),
                **({} if moves is None else {"moves": (moves, 3)}),
                **({} if window_offsets is None else {"window_offsets": (window_offsets, 1)}))
    R, rows, K = kept.shape
    for name, t in (("scored_lengths", scored_lengths), ("tail_lengths", tail_lengths),
                    ("destination_bases", destination_bases), ("new_lengths", new_lengths),
                    ("window_offsets", window_offsets)):
        if t is not None and t.shape[0] != R:
            raise ValueError(f"{what}: {name} has {t.shape[0]} entries, kept has {R} requests")
    if window_offsets is not None and (moves is None or sources.shape[1] != rows + 1):
        raise ValueError(f"{what}: window_offsets needs fill order (moves) and the window row (sources with "
                         f"{rows + 1} list rows), got {'no moves' if moves is None else f'{sources.shape[1]} rows'}")
    if kept.stride(2) != 1 or not sources.is_contiguous():
        raise ValueError(f"{what}: kept needs a contiguous last dim and sources must be contiguous")
    if sources.shape[0] != R or sources.shape[1] not in (rows, rows + 1) or sources.shape[2] < K:
        raise ValueError(f"{what}: sources shape {tuple(sources.shape)} cannot hold the lists of kept "
                         f"{tuple(kept.shape)}: expected [{R}, {rows} or {rows + 1}, >= {K}]")
    if moves is not None and (moves.shape != sources.shape or not moves.is_contiguous()):
        raise ValueError(f"{what}: moves must be contiguous with the shape of sources {tuple(sources.shape)}, got "
                         f"{tuple(moves.shape)}")
    check_disjoint(what, "outputs", [sources, new_lengths] + ([] if moves is None else [moves]))
    if not torch.compiler.is_compiling():  # an output over an input: the kernel would read what it just wrote
        inputs = (("kept", kept), ("scored_lengths", scored_lengths), ("tail_lengths", tail_lengths),
                  ("destination_bases", destination_bases), ("window_offsets", window_offsets))
        for out_name, out in (("sources", sources), ("new_lengths", new_lengths), ("moves", moves)):
            for in_name, t in inputs:
                if out is not None and t is not None and overlap(out, t):
                    raise ValueError(f"{what}: {out_name} shares memory with {in_name}; the outputs must not "
                                     f"alias the inputs")
    _pack_op(kept, scored_lengths, tail_lengths, destination_bases, sources, new_lengths, moves, window_offsets)
