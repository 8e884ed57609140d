"""Tensor parallelism: the KV heads of every layer split over the ranks of a ``torch.distributed`` process group.

Each rank holds its own pools (its KV heads, all layers), its own ``PagedKVCache`` or engine cache, and its own
selector and manager; page tables and lengths are the same on every rank. What a round needs across ranks
(docs/triattention.md, "Tensor parallelism"):

- ``per_head`` and ``per_layer_perhead`` rows are per KV head: each rank scores, selects and compacts its own
  heads, and nothing is communicated;
- the ``union`` row is a max over every (layer, head): each rank reduces its heads, then one
  ``all_reduce(MAX)`` of the float32 ``[R, n]`` rows gives every rank the model's row, the top-k (deterministic)
  the same keep set, and each rank compacts its heads with it;
- the cold-page codec is per rank, on its own pools: nothing to communicate.

Collectives run on the group's backend: NCCL on the current stream (capturable in a CUDA graph once its
communicator exists), gloo on CPU tensors (CUDA ones are staged through the host, so not capturable).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._checks import check_int


def check_group(what: str, group) -> "dist.ProcessGroup | None":
    """`group` as given: None (one rank, nothing communicated) or a process group of an initialized
    ``torch.distributed`` that this process belongs to."""
    if group is None:
        return None
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what}: process_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError(f"{what}: process_group given but torch.distributed is not initialized")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{what}: this process is not a member of process_group")
    return group


def capturable(group) -> bool:
    """Whether the group's collectives can be recorded in a CUDA graph (NCCL; gloo stages through the host)."""
    return group is None or dist.get_backend(group) == "nccl"


def rank_kv_heads(what: str, group, num_kv_heads: int, kv_heads=None) -> range:
    """The model's KV heads this rank holds.

    `kv_heads`, when given, is a non-empty ``range`` of step 1 inside ``[0, num_kv_heads)``. Otherwise the split
    vLLM and SGLang use: with at least as many heads as ranks (their count a multiple of the world size), rank r
    holds the r-th contiguous block of ``num_kv_heads / world``; with fewer, each head is replicated on
    ``world / num_kv_heads`` consecutive ranks and rank r holds head ``r // (world / num_kv_heads)``. Without a
    group, every head."""
    check_int(what, "num_kv_heads", num_kv_heads, 1)
    if kv_heads is not None:
        if not isinstance(kv_heads, range):
            raise TypeError(f"{what}: kv_heads must be a range of the model's KV heads, got "
                            f"{type(kv_heads).__name__} {kv_heads!r}")
        if kv_heads.step != 1 or len(kv_heads) == 0 or kv_heads.start < 0 or kv_heads.stop > num_kv_heads:
            raise ValueError(f"{what}: kv_heads must be a non-empty range of step 1 inside [0, {num_kv_heads}) "
                             f"(the model's KV heads), got {kv_heads!r}")
        if group is None and len(kv_heads) != num_kv_heads:
            raise ValueError(f"{what}: kv_heads={kv_heads!r} is a part of the model's {num_kv_heads} KV heads; "
                             f"pass the process_group that holds the others")
        return kv_heads
    if group is None:
        return range(num_kv_heads)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"{what}: {num_kv_heads} KV heads do not split evenly over {world} ranks; pass "
                             f"kv_heads (this rank's range)")
        per = num_kv_heads // world
        return range(rank * per, (rank + 1) * per)
    if world % num_kv_heads:
        raise ValueError(f"{what}: {world} ranks do not replicate {num_kv_heads} KV heads evenly; pass kv_heads "
                         f"(this rank's range)")
    head = rank // (world // num_kv_heads)
    return range(head, head + 1)


SAME = "tensor parallelism needs the same settings, page tables and lengths on every rank"


def _reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def check_same_on_ranks(what: str, group, device: torch.device, **tensors: torch.Tensor) -> None:
    """Raise ValueError on every rank, naming the first argument, when the integer `tensors` differ in shape or
    value between the ranks of `group`. Two small all-reduces (each a host sync): every rank must call it with
    the same names. `device`: where the collective runs (a CUDA device for NCCL)."""
    if group is None:
        return
    for name, t in tensors.items():  # compared as int64: a float would be truncated first
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.is_meta:
            raise TypeError(f"{what}: {name} must be an integer tensor with values, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}{' on meta' if getattr(t, 'is_meta', 0) else ''}")
    names = list(tensors)
    shapes = torch.zeros(len(names), 5, dtype=torch.int64)
    for i, t in enumerate(tensors.values()):
        check_int(what, f"the dimensions of {names[i]}", t.dim(), 0, 4)
        shapes[i, 0] = t.dim()
        shapes[i, 1:1 + t.dim()] = torch.tensor(t.shape)
    # max(x) and max(-x) = -min(x) in one collective: equal on every rank iff max == min
    spread = _reduce_max(torch.cat((shapes, -shapes)).to(device), group).cpu().view(2, len(names), 5)
    for i, name in enumerate(names):
        if not torch.equal(spread[0, i], -spread[1, i]):
            raise ValueError(f"{what}: {name} differs in shape between the ranks of the process group ({SAME})")
    flat = torch.cat([t.reshape(-1).to(device, torch.int64) for t in tensors.values()])
    spread = _reduce_max(torch.cat((flat, -flat)), group).cpu().view(2, -1)
    differs = spread[0] != -spread[1]
    start = 0
    for name, t in tensors.items():
        if bool(differs[start:start + t.numel()].any()):
            raise ValueError(f"{what}: {name} differs between the ranks of the process group ({SAME})")
        start += t.numel()


def check_heads_covered(what: str, group, device: torch.device, kv_heads: range, num_kv_heads: int) -> None:
    """Raise ValueError on every rank when some KV head of the model is held by no rank of `group` (the union
    row would miss it). One all-reduce (a host sync); every rank must call it."""
    held = torch.zeros(num_kv_heads, dtype=torch.int64)
    held[kv_heads.start:kv_heads.stop] = 1
    held = _reduce_max(held.to(device), group).cpu()
    if not bool(held.all()):
        raise ValueError(f"{what}: KV heads {held.eq(0).nonzero().flatten().tolist()} are held by no rank of the "
                         f"process group; the ranks' kv_heads must cover the model's {num_kv_heads}")


def all_reduce_union_rows_(rows: torch.Tensor, count: torch.Tensor, group) -> torch.Tensor:
    """The model's union rows from each rank's: rows float32 ``[R, 1, n]`` (the max over the rank's (layer, head)
    planes; -inf past a request's `count` decode tokens and where a plane it reduces has a non-finite score),
    in place. A poisoned column must stay poisoned whatever other ranks hold, so it travels as +inf (no finite
    score is +inf) and comes back as -inf. On the current stream, no host sync."""
    what = "all_reduce_union_rows_"
    if not isinstance(group, dist.ProcessGroup):  # (check_group's membership calls are left to the selector)
        raise TypeError(f"{what}: group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.float32 or rows.dim() != 3 or rows.shape[1] != 1:
        raise ValueError(f"{what}: rows must be float32 [R, 1, n], got {getattr(rows, 'dtype', type(rows).__name__)} "
                         f"{tuple(getattr(rows, 'shape', ()))}")
    if not isinstance(count, torch.Tensor) or count.dtype not in (torch.int32, torch.int64) or \
            tuple(count.shape) != rows.shape[:1] or count.device != rows.device:
        raise ValueError(f"{what}: count must be int32 or int64 [{rows.shape[0]}] on {rows.device}, got "
                         f"{getattr(count, 'dtype', type(count).__name__)} {tuple(getattr(count, 'shape', ()))}")
    n = rows.shape[-1]
    live = torch.arange(n, device=rows.device) < count[:, None, None]
    rows.masked_fill_(live & (rows == -float("inf")), float("inf"))
    _reduce_max(rows, group)
    return rows.masked_fill_(rows == float("inf"), -float("inf"))
