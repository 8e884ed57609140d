"""Physical compaction on the GPU: compact() against the copy bandwidth and a torch gather/scatter.

Qwen3-8B geometry (8 KV heads, head_dim 128, HND pools), requests of 16k tokens (a 1024-token
prompt, 16368 scored, a 16-token tail), keeping 2048 + 16 per request in union mode, pages in
random order. 128 requests of 36 layers do not fit in 141 GB, so that case runs 8 layers.

Rows (bytes counted: every moved token row read once and written once, all layers, K and V):
  compact        pack + move, eager, vs the device copy bandwidth; baseline: per layer, a torch
                 index_select of the kept rows into a temporary, then index_copy_ back.
  compact_graph  the same round replayed from a CUDA graph (how an engine runs it: no launch overhead).
  pack_graph     the Triton pack alone, replayed from a CUDA graph (its bytes: the move lists written).
The notes give torch.cuda.max_memory_allocated above the resident pools for both.
"""

from __future__ import annotations

import torch

from kvops.compaction import build_compaction_params, compact, decision_rows, pack_move_sources

from .common import Row, device_copy_gbps, graphed, time_us

FAMILY = "compaction"
HEADS, HEAD_DIM, TOKENS, PROMPT, KEEP, TAIL = 8, 128, 16384, 1024, 2048, 16


def _decisions(R, rows, device="cuda"):
    scored = TOKENS - TAIL
    kept = torch.rand(R * rows, scored - PROMPT, device=device).topk(KEEP, dim=1).indices.sort(dim=1).values
    return (kept + PROMPT).int().view(R, rows, KEEP)


def _setup(storage, R, L, T, dtype, rows):
    P = R * TOKENS // T
    per_layer = P * 2 * HEADS * T * HEAD_DIM
    flat = storage[: L * per_layer * dtype.itemsize].view(dtype)
    pools = [flat[i * per_layer:(i + 1) * per_layer].view(P, 2, HEADS, T, HEAD_DIM) for i in range(L)]
    table = torch.randperm(P, device="cuda").int().view(R, TOKENS // T)
    full = lambda v: torch.full((R,), v, dtype=torch.int32, device="cuda")  # noqa: E731
    params = build_compaction_params(pools, table, _decisions(R, rows), full(TOKENS - TAIL), full(TAIL), full(PROMPT),
                                     max_tail=TAIL)
    return pools, params


def _baseline(pools, params):
    """What a user writes without kvops: gather the kept rows of a layer into a temporary, scatter back."""
    P, _, H, T, D = pools[0].shape
    R, _, K = params.kept.shape
    src = torch.cat([params.kept[:, 0].long(), (TOKENS - TAIL + torch.arange(TAIL, device="cuda")).expand(R, -1)], 1)
    dst = PROMPT + torch.arange(K + TAIL, device="cuda").expand(R, -1)
    table = params.page_table.long()

    def rows_of(pos):  # flat row index in [P*2*H*T] of every (request, position, plane, head)
        page, slot = table.gather(1, pos // T), pos % T
        plane_head = torch.arange(2 * H, device="cuda").view(1, 1, -1)
        return ((page[..., None] * 2 * H + plane_head) * T + slot[..., None]).reshape(-1)

    src_rows, dst_rows = rows_of(src), rows_of(dst)

    def run():
        for pool in pools:
            flat = pool.view(torch.uint8).view(-1, D * pool.element_size())  # index_copy_ has no float8
            flat.index_copy_(0, dst_rows, flat.index_select(0, src_rows))
    return run


def _peak_extra(fn) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    copy_gbps = device_copy_gbps()
    iters = 5 if quick else 20
    configs = [(32, 36), (128, 8)] if not quick else [(8, 36)]
    storage = torch.empty(max(R * L for R, L in configs) * TOKENS * 2 * HEADS * HEAD_DIM * 2, dtype=torch.uint8,
                          device="cuda")
    rows: list[Row] = []
    notes = ["Temporary memory (torch.cuda.max_memory_allocated above the resident pools) and move-list size:", "",
             "| case | kvops compact | torch gather/scatter | move lists (allocated once at build) |",
             "|---|---|---|---|"]
    for R, L in configs:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for T in (32, 128):
                for mode in ("union",) + (("per_layer_perhead",) if (R, T, dtype) == (32, 32, torch.bfloat16) else ()):
                    pools, params = _setup(storage, R, L, T, dtype, decision_rows(mode, L, HEADS))
                    shape = f"{R}req x16k {L}x[P,2,8,{T},128] keep {KEEP}+{TAIL} {mode}"
                    moved = 2 * R * L * 2 * HEADS * (KEEP + TAIL) * HEAD_DIM * dtype.itemsize
                    us = time_us(lambda: compact(params), iters=iters)
                    ours_extra = _peak_extra(lambda: compact(params))
                    base_us, base_extra = float("nan"), float("nan")
                    if mode == "union":
                        baseline = _baseline(pools, params)
                        base_us = time_us(baseline, iters=max(3, iters // 4))
                        base_extra = _peak_extra(baseline)
                        baseline = None  # freed before the next case
                    rows.append(Row.make(FAMILY, "compact", shape, dtype, us, moved, copy_gbps,
                                         "torch gather+scatter" if mode == "union" else "", base_us))
                    graph_us = time_us(graphed(lambda: compact(params)), iters=iters)
                    rows.append(Row.make(FAMILY, "compact_graph", shape, dtype, graph_us, moved, copy_gbps))
                    sources, new_lengths = params.sources, params.new_lengths
                    pack_us = time_us(graphed(lambda: pack_move_sources(
                        params.kept, params.scored_lengths, params.tail_lengths, params.destination_bases, sources,
                        new_lengths)), iters=iters)
                    rows.append(Row.make(FAMILY, "pack_graph", shape, "int32", pack_us, sources.numel() * 4,
                                         copy_gbps))
                    notes.append(f"| {shape} {str(dtype)[6:]} | {ours_extra / 2**20:.1f} MiB | "
                                 f"{base_extra / 2**20:.1f} MiB | {sources.numel() * 4 / 2**20:.1f} MiB |")
                    pools = params = None
    storage = None
    torch.cuda.empty_cache()
    return rows, notes
