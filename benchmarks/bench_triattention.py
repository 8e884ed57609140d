"""TriAttention selection pieces on the GPU (the scorer is not written yet).

Rows:
  topk        kvops.topk (CuTe DSL radix select) from a CUDA graph, vs torch.topk + sort of the indices (what a
              user would write for ascending keep sets), same inputs; bytes: the scores read once.
  topk_eager  the same call without a graph (includes Python and DLPack argument overhead).
  mean_phase  the coefficient kernel for 32 requests, Qwen3-8B (F = 64), from a graph.
"""

from __future__ import annotations

import torch

from kvops.triattention import mean_phase
from kvops.triattention.topk import topk

from .common import Row, device_copy_gbps, time_us

FAMILY = "triattention"


def _graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    copy_gbps = device_copy_gbps()
    iters = 5 if quick else 50
    rows_out: list[Row] = []
    shapes = [(64, 32768, 2048)] if quick else [
        (rows, N, k) for k in (2048, 8192) for N in (16384, 32768, 131072) for rows in (32, 64, 256)]
    for rows, N, k in shapes:
        scores = torch.randn(rows, N, device="cuda")
        lengths = torch.full((rows,), N, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
        base_us = time_us(_graphed(lambda: scores.topk(k, dim=1).indices.sort(dim=1)), iters=iters)
        ours = time_us(_graphed(lambda: topk(scores, lengths, k, out)), iters=iters)
        eager = time_us(lambda: topk(scores, lengths, k, out), iters=iters)
        shape = f"rows={rows} N={N} k={k}"
        rows_out.append(Row.make(FAMILY, "topk", shape, "float32", ours, scores.numel() * 4, copy_gbps / 2,
                                 "torch.topk+sort", base_us))
        rows_out.append(Row.make(FAMILY, "topk_eager", shape, "float32", eager, scores.numel() * 4, copy_gbps / 2,
                                 "torch.topk+sort", base_us))
    starts = torch.randint(0, 2 ** 24, (32,), device="cuda")
    omega = torch.rand(64, device="cuda")
    phase = torch.empty(32, 2, 64, device="cuda")
    us = time_us(_graphed(lambda: mean_phase(starts, omega, phase)), iters=iters)
    rows_out.append(Row.make(FAMILY, "mean_phase", "R=32 F=64", "float32", us, phase.numel() * 4, copy_gbps / 2))
    notes = ["limit for topk: the read half of the copy bandwidth (the scores are read at least once)."]
    return rows_out, notes
