"""In-place KV compaction across every layer: the two-phase API an engine calls each round.

``build_compaction_params`` binds the buffers once (pools, page table, decision rows, lengths) and
allocates the move lists; ``compact(params, request_count)`` then packs the decisions the caller
wrote into the bound rows and moves the kept tokens, two launches with fixed shapes, so a captured
CUDA graph replays correctly with new decisions and new lengths. See docs/compaction.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from .._checks import check_bool, check_choice, check_device, check_disjoint, check_int, check_int32, check_no_meta_mix
from .pack import _pack_op
from .rows import MODES, decision_row, decision_rows  # noqa: F401  (re-exported: the decision layouts)


def compact_layers_(pools: Sequence[torch.Tensor], page_table: torch.Tensor, sources: torch.Tensor,
                    new_lengths: torch.Tensor, destination_bases: torch.Tensor, layer_row_base: Sequence[int],
                    head_row_stride: Sequence[int], moves: torch.Tensor | None = None) -> None:
    """For every layer l, plane and head h of request r: position destination_bases[r] + m receives
    source m of list row ``layer_row_base[l] + head_row_stride[l] * h``, m < new_lengths[r] - base. With `moves`
    (the shape of sources) only the indices m listed in the row's moves (ascending, -1 after the last) are
    walked; the others must already be in place. The pools are moved in place: no two of their elements may
    share memory."""
    what = "compact_layers_"
    if not isinstance(pools, (list, tuple)):
        raise TypeError(f"{what}: pools must be a list of per-layer tensors, got {type(pools).__name__}")
    device = check_device(what, pools=list(pools))
    _check_pools(what, pools)
    for name, values in (("layer_row_base", layer_row_base), ("head_row_stride", head_row_stride)):
        if not isinstance(values, (list, tuple)) or len(values) != len(pools) or \
                not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{what}: {name} needs one int per layer ({len(pools)}), got {values!r}")
    check_int32(what, device, page_table=(page_table, 2), sources=(sources, 3), new_lengths=(new_lengths, 1),
                destination_bases=(destination_bases, 1), **({} if moves is None else {"moves": (moves, 3)}))
    # the indices too: a move that wrote over its page table or lists would steer the later moves
    check_disjoint(what, "pools", list(pools), [("page_table", page_table), ("sources", sources),
                                                ("new_lengths", new_lengths), ("destination_bases", destination_bases)]
                   + ([] if moves is None else [("moves", moves)]))
    torch.ops.kvops.compaction_compact_layers_(list(pools), page_table, sources, new_lengths, destination_bases,
                                               list(layer_row_base), list(head_row_stride), moves)


def _check_pools(what: str, pools: Sequence[torch.Tensor]) -> None:
    """What the op's own checks leave to Python: no empty head, token or dim dim in a 5-D pool (nothing to move:
    a page of no tokens would hold no position). The op refuses pools whose elements share memory."""
    for i, p in enumerate(pools):
        if p.dim() == 5:
            for k, name in ((2, "head"), (3, "token"), (4, "dim")):
                if p.shape[k] == 0:
                    raise ValueError(f"{what}: pools[{i}] (shape {tuple(p.shape)}): dim {k} ({name}) is empty; "
                                     f"heads, tokens per page and head_dim need at least one element")


@torch.library.register_fake("kvops::compaction_compact_layers_")
def _compact_layers_fake(pools, page_table, sources, new_lengths, destination_bases, layer_row_base,
                         head_row_stride, moves=None):
    what = "compaction_compact_layers_"
    check_no_meta_mix(what, pools, page_table, sources, new_lengths, destination_bases,
                      *([] if moves is None else [moves]))
    # the op's aliasing checks, at the trace: what a compiled call's functionalization may hide from the op
    check_disjoint(what, "pools", list(pools), [("page_table", page_table), ("sources", sources),
                                                ("new_lengths", new_lengths), ("destination_bases", destination_bases)]
                   + ([] if moves is None else [("moves", moves)]))


@dataclass
class CompactionParams:
    """Buffers bound by build_compaction_params. The caller writes kept[:R], scored_lengths[:R],
    tail_lengths[:R] and destination_bases[:R] (and the page table) before each compact()."""

    pools: list[torch.Tensor]
    page_table: torch.Tensor         # int32 [R_max, max_pages]
    kept: torch.Tensor               # int32 [R_max, rows, K]
    scored_lengths: torch.Tensor     # int32 [R_max]
    tail_lengths: torch.Tensor       # int32 [R_max]
    destination_bases: torch.Tensor  # int32 [R_max]
    sources: torch.Tensor            # int32 [R_max, list_rows, K + max_tail], written by the pack
    moves: torch.Tensor | None       # fill order: the list indices that move, like sources; written by the pack
    new_lengths: torch.Tensor        # int32 [R_max], written by the pack
    layer_row_base: tuple[int, ...]
    head_row_stride: tuple[int, ...]
    max_tail: int
    window_offsets: torch.Tensor | None = None  # int32 [R_max]: the window layers' ring offsets, written by the caller

    @property
    def order(self) -> str:
        """"fill" when the params hold a moves list, else "ordered" (ORDERS)."""
        return "ordered" if self.moves is None else "fill"


ORDERS = ("ordered", "fill")  # how kept tokens land below the new length (kvops/compaction/pack.py)
def _layer_windows(what: str, layer_windows, layers: int) -> list[int]:
    """One non-negative int per layer (0 = full attention), or None for all 0."""
    windows = [0] * layers if layer_windows is None else layer_windows
    if not isinstance(windows, (list, tuple)) or len(windows) != layers or \
            not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in windows):
        raise ValueError(f"{what}: layer_windows needs one non-negative int per layer ({layers}), got "
                         f"{layer_windows!r}")
    return list(windows)


def stream_rows(rows: int, layers: int, heads: int, layer_windows: Sequence[int] | None = None
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layer_row_base, head_row_stride) for a decision with `rows` rows per request (``decision_row``): layer l,
    head h reads list row ``layer_row_base[l] + head_row_stride[l] * h``. Window layers read the extra window row
    (index `rows`) for every head. layer_windows: one non-negative int per layer (0 = full attention), or None."""
    what = "stream_rows"
    for name, value in (("rows", rows), ("layers", layers), ("heads", heads)):
        check_int(what, name, value, 1)
    windows = _layer_windows(what, layer_windows, layers)
    base = [decision_row(rows, layers, heads, layer, 0) for layer in range(layers)]
    stride = decision_row(rows, layers, heads, 0, 1) - base[0] if heads > 1 else 0
    return (tuple(rows if w > 0 else b for b, w in zip(base, windows)),
            tuple(0 if w > 0 else stride for w in windows))


def build_compaction_params(pools: Sequence[torch.Tensor], page_table: torch.Tensor, kept: torch.Tensor,
                            scored_lengths: torch.Tensor, tail_lengths: torch.Tensor,
                            destination_bases: torch.Tensor, *, max_tail: int,
                            layer_windows: Sequence[int] | None = None, order: str = "ordered",
                            window_offsets: torch.Tensor | None = None) -> CompactionParams:
    """Bind the buffers of a compaction and allocate its move lists (the only allocation).

    Parameters
    ----------
    pools : list of torch.Tensor
        Per-layer 5-D views ``[page, plane (K=0, V=1), head, token, dim]``, bf16, fp16 or fp8, one geometry for
        every layer, no two sharing memory and none holding an element twice (an ``expand``), since they are
        moved in place (HND as is, NHD ``.transpose(2, 3)``, vLLM ``[2, P, T, H, D]`` ``.permute(1, 0, 3, 2, 4)``).
    page_table : torch.Tensor
        int32 ``[R_max, max_pages]``, shared by the layers.
    kept : torch.Tensor
        int32 ``[R_max, rows, K]``: the decision the caller writes each round; rows is 1, H or L*H
        (``decision_rows``).
    scored_lengths, tail_lengths, destination_bases : torch.Tensor
        int32 ``[R_max]`` each, written by the caller each round.
    max_tail : int
        The largest tail_lengths entry compact() acts on (a larger one leaves its request as it is).
    layer_windows : list of int, optional
        Per-layer sliding window (0 = full attention); a window layer keeps its latest K scored tokens instead of
        the decision, so its whole window (<= K) survives and every layer ends at the same length.
    order : str
        ``"ordered"``: the kept tokens and the tail end in their old order (every token behind the first evicted
        one moves down). ``"fill"``: only the kept tokens at or past the new length move, each into an evicted
        slot below it (at most K + tail - (kept tokens already below the new length) moves per row), so the
        order of the kept tokens changes; full attention does not care, since keys carry their RoPE phase.
        Window layers compact in order unless `window_offsets` is given. ``params.sources`` holds the permutation
        either way.
    window_offsets : torch.Tensor, optional
        int32 ``[R_max]``, written by the caller each round, fill order with window layers only: the window layers
        keep their tokens as rings, so a round moves only the evicted slots and the tail (kvops/compaction/pack.py
        states the layout). Each request's ring starts at ``destination_base + window_offsets[r]``, in [0, K); it
        is 0 while the window is in order (before a request's first round), and a round of e evicted tokens
        (``scored_length - destination_base - K``) turns it into ``(offset + e) % K``, which the caller writes
        before the next round.

    Returns
    -------
    CompactionParams
        The bound buffers and move lists, for ``compact``.
    """
    what = "build_compaction_params"
    if not isinstance(pools, (list, tuple)) or not pools:
        raise TypeError(f"{what}: pools must be a non-empty list of per-layer tensors, got {type(pools).__name__}")
    pools = list(pools)
    device = check_device(what, pools=pools)
    if not all(p.dim() == 5 for p in pools):
        raise ValueError(f"{what}: pools must be 5-D [page, plane, head, token, dim] views, got shapes "
                         f"{sorted({tuple(p.shape) for p in pools})[:4]}")
    _check_pools(what, pools)
    check_int32(what, device, page_table=(page_table, 2), kept=(kept, 3), scored_lengths=(scored_lengths, 1),
                tail_lengths=(tail_lengths, 1), destination_bases=(destination_bases, 1),
                **({} if window_offsets is None else {"window_offsets": (window_offsets, 1)}))
    if kept.stride(2) != 1 and kept.shape[2] > 1:
        raise ValueError(f"{what}: kept needs a contiguous last dim (the pack reads its rows), got strides "
                         f"{kept.stride()}")
    check_int(what, "max_tail", max_tail, 0, 2**31 - 1 - kept.shape[2])  # a list index fits int32
    check_choice(what, "order", order, ORDERS)
    # the indices too: a move that wrote over its page table or decisions would steer the later moves
    check_disjoint(what, "pools", pools, [("page_table", page_table), ("kept", kept), ("scored_lengths", scored_lengths),
                                          ("tail_lengths", tail_lengths), ("destination_bases", destination_bases)]
                   + ([] if window_offsets is None else [("window_offsets", window_offsets)]))
    L, H = len(pools), pools[0].shape[2]
    R, rows, K = kept.shape
    for name, t in (("page_table", page_table), ("scored_lengths", scored_lengths), ("tail_lengths", tail_lengths),
                    ("destination_bases", destination_bases), ("window_offsets", window_offsets)):
        if t is not None and t.shape[0] != R:
            raise ValueError(f"{what}: {name} has {t.shape[0]} rows, kept has {R} requests")
    windows = _layer_windows(what, layer_windows, L)
    if window_offsets is not None and (order != "fill" or not any(windows)):
        raise ValueError(f"{what}: window_offsets makes the window layers rings in fill order; it needs "
                         f'order="fill" and a window layer, got order={order!r}, layer_windows={layer_windows!r}')
    if any(w > K for w in windows):
        raise ValueError(f"{what}: layer_windows {max(windows)} exceeds the kept count K={K}; a window layer keeps "
                         f"its latest K tokens, so a larger window would lose tokens it attends to")
    row_base, row_stride = stream_rows(rows, L, H, windows)
    list_rows = rows + (1 if any(windows) else 0)
    params = CompactionParams(
        pools, page_table, kept, scored_lengths, tail_lengths, destination_bases,
        sources=torch.full((R, list_rows, K + max_tail), -1, dtype=torch.int32, device=device),
        moves=(torch.full((R, list_rows, K + max_tail), -1, dtype=torch.int32, device=device) if order == "fill"
               else None),
        new_lengths=torch.zeros(R, dtype=torch.int32, device=device),
        layer_row_base=row_base, head_row_stride=row_stride, max_tail=max_tail, window_offsets=window_offsets)
    # A dry run with no requests: the op checks the pools (geometry, dtype, strides, alignment) now, once.
    compact_layers_(pools, page_table[:0], params.sources[:0], params.new_lengths[:0], destination_bases[:0],
                    row_base, row_stride)
    return params


def compact(params: CompactionParams, request_count: int | None = None, *, validate: bool = False) -> torch.Tensor:
    """Pack and move the first `request_count` requests of the bound buffers, in place, on the current stream.

    Parameters
    ----------
    params : CompactionParams
        From ``build_compaction_params``, with this round's decisions, lengths and page table written.
    request_count : int, optional
        How many leading rows of the bound buffers to act on (default: all of them).
    validate : bool
        Check the contract first (also with ``KVOPS_DEBUG=1``); syncs and raises ValueError naming the request,
        before anything moves, on a non-ascending or overtaking decision, a bad tail, or an unusable or shared page.

    Returns
    -------
    torch.Tensor
        int32 ``[request_count]``, a view of the bound ``new_lengths``: destination base + K + tail. Contents past
        the new length are unspecified, and the caller releases those pages.

    Notes
    -----
    A request whose tail lies outside [0, max_tail], whose destination base lies outside [0, scored - K] (no decision
    fits above it; base + K + tail could overflow int32), whose scored + tail does not fit int32 or whose window
    offset lies outside [0, K) is left as it is:
    nothing of it moves and its new length is scored + max(tail, 0) (its length before the call, saturated to
    [0, 2**31 - 1]), so no token is dropped without the caller seeing it in the returned length. Without validation
    the kernels trust the rest: a decision that is not ascending or that overtakes (kept[m] < base + m) moves the
    wrong bytes, and a page-table entry shared by two requests (or two columns) is overwritten by one move while
    another reads it. Entries outside the pool are skipped.
    """
    if not isinstance(params, CompactionParams):
        raise TypeError(f"compact: params must be a CompactionParams (build_compaction_params), got "
                        f"{type(params).__name__}")
    R = params.kept.shape[0] if request_count is None else \
        check_int("compact", "request_count", request_count, 0, params.kept.shape[0])
    check_bool("compact", "validate", validate)
    if validate or os.environ.get("KVOPS_DEBUG") == "1":
        check_decisions(params, R)
    moves = None if params.moves is None else params.moves[:R]
    offsets = None if params.window_offsets is None else params.window_offsets[:R]
    # the bound buffers were checked by build_compaction_params: straight to the ops
    _pack_op(params.kept[:R], params.scored_lengths[:R], params.tail_lengths[:R],
             params.destination_bases[:R], params.sources[:R], params.new_lengths[:R], moves, offsets)
    torch.ops.kvops.compaction_compact_layers_(params.pools, params.page_table[:R], params.sources[:R],
                                               params.new_lengths[:R], params.destination_bases[:R],
                                               list(params.layer_row_base), list(params.head_row_stride), moves)
    return params.new_lengths[:R]


def check_decisions(params: CompactionParams, request_count: int) -> None:
    """The contract of compact() for the first `request_count` bound requests, checked on the device and raised on
    the host (one sync per check)."""
    what = "check_decisions"
    if not isinstance(params, CompactionParams):
        raise TypeError(f"{what}: params must be a CompactionParams (build_compaction_params), got "
                        f"{type(params).__name__}")
    R = check_int(what, "request_count", request_count, 0, params.kept.shape[0])
    kept = params.kept[:R].long()
    scored, tail = params.scored_lengths[:R].long(), params.tail_lengths[:R].long()
    base, table = params.destination_bases[:R].long(), params.page_table[:R].long()
    K, T, P = kept.shape[2], params.pools[0].shape[3], params.pools[0].shape[0]
    m = torch.arange(K, device=kept.device)
    end = scored + tail  # the cache length before the round

    def fail(bad: torch.Tensor, message: str) -> None:
        if bool(bad.any()):
            r = int(bad.reshape(R, -1).any(1).nonzero()[0])
            raise ValueError(f"compact: request {r}: {message} (destination base {int(base[r])}, scored length "
                             f"{int(scored[r])}, tail {int(tail[r])})")

    fail((tail < 0) | (tail > params.max_tail), f"tail length outside [0, max_tail={params.max_tail}]")
    fail((base < 0) | (scored - K < base), f"fewer than K={K} scored tokens above the destination base")
    fail(end > table.shape[1] * T, f"cache length exceeds the page table ({table.shape[1]} pages of {T})")
    if params.window_offsets is not None:
        offsets = params.window_offsets[:R]
        fail((offsets < 0) | (offsets >= max(K, 1)), f"window offset outside [0, K={K})")
    fail((kept[..., 1:] <= kept[..., :-1]).any(-1), "kept positions are not strictly ascending")
    fail(((kept < base[:, None, None] + m) | (kept >= scored[:, None, None])).any(-1),
         "a kept position is below destination_base + its ordinal (it would be overtaken) or not a scored token")
    cols = torch.arange(table.shape[1], device=kept.device)
    held = cols * T < end[:, None]                     # every page a request holds, below its base too
    fail(held & ((table < 0) | (table >= P)), f"a page-table entry of the request is outside [0, {P})")
    pages = table[held]
    if pages.numel() != pages.unique().numel():
        # A page held twice (within a request or across requests, above or below a base) would be overwritten
        # by one move while another request still reads it.
        raise ValueError("compact: a page appears twice among the batch's page-table entries (requests must not "
                         "share pages: compaction rewrites them in place)")
