"""kvops.topk on the GPU.

Rows:
  topk        kvops.topk from a CUDA graph (the class it picks from the shape: kvops/topk/ops.py), vs torch.topk +
              sort of the indices (what a user would write for ascending keep sets), same inputs; bytes: the
              scores read once; limit: the read half of the copy bandwidth. Long rows are a select over whole
              16k-128k contexts; rows of 2176 keys are the steady-state round's (budget 2048 + beta 128): one per
              request (union) or 288 per request (per_layer_perhead, Qwen3-8B) at 1, 4, 8 and 32 requests.
  topk_eager  the same call without a graph (includes Python and DLPack argument overhead).
  topk_native  rows of at most 4096 keys: kvops::topk_short_rows_ (one warp per row) called directly, from a CUDA
              graph, also at fewer rows than SMs, where kvops.topk takes the CuTe class.
  topk_long_native, topk_cute  up to two rows per SM: kvops::topk_long_rows_ (several CTAs a row) and the CuTe
              class (one CTA a row) called directly, from a CUDA graph: the measurements behind the rule between
              them (kvops/topk/ops.py).
  torch_topk_unsorted  fewer rows than SMs, longer than 4096 keys (issue 27's shapes among them):
              torch.topk(sorted=False) alone, against torch.topk + sort.
"""

from __future__ import annotations

import torch

from kvops.topk import SHORT_ROW, cute_rows, long_rows_native, short_rows_native, topk

from .common import Row, device_copy_gbps, graphed, time_us

FAMILY = "topk"


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    copy_gbps = device_copy_gbps()
    iters = 5 if quick else 50
    rows_out: list[Row] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(64, 32768, 2048), (9216, 2176, 2048)] if quick else [
        (rows, N, k) for k in (2048, 8192) for N in (16384, 32768, 131072) for rows in (32, 64, 256)] + [
        (rows, 2176, 2048) for rows in (1, 8, 32, 132, 288, 1152, 2304, 9216)] + [
        (8, 262144, 2048)]
    for rows, N, k in shapes:
        scores = torch.randn(rows, N, device="cuda")
        lengths = torch.full((rows,), N, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
        base_us = time_us(graphed(lambda: scores.topk(k, dim=1).indices.sort(dim=1)), iters=iters)
        ours = time_us(graphed(lambda: topk(scores, lengths, k, out)), iters=iters)
        eager = time_us(lambda: topk(scores, lengths, k, out), iters=iters)
        shape = f"rows={rows} N={N} k={k}"
        timed = [("topk", ours), ("topk_eager", eager)]
        if N <= SHORT_ROW:
            timed.append(("topk_native", time_us(graphed(lambda: short_rows_native(scores, lengths, None, k, out)),
                                                 iters=iters)))
        if rows <= 2 * sms:
            timed.append(("topk_long_native", time_us(graphed(lambda: long_rows_native(scores, lengths, None, k, out)),
                                                      iters=iters)))
            timed.append(("topk_cute", time_us(graphed(lambda: cute_rows(scores, lengths, None, k, out)),
                                               iters=iters)))
        if N > SHORT_ROW and rows < sms:
            timed.append(("torch_topk_unsorted", time_us(graphed(lambda: scores.topk(k, dim=1, sorted=False)),
                                                         iters=iters)))
        for routine, us in timed:
            rows_out.append(Row.make(FAMILY, routine, shape, "float32", us, scores.numel() * 4, copy_gbps / 2,
                                     "torch.topk+sort", base_us))
    notes = ["limit for topk: the read half of the copy bandwidth (the scores are read at least once).",
             "Every row is timed with L2 flushed before each call. In a round the top-k's scores were just written by "
             "the reduce, so rows that fit in L2 (50 MB) are L2-resident in real use and run faster than shown."]
    return rows_out, notes
