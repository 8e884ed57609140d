"""Sweep the CuTe scorer's launch knobs (frequencies per lane, tokens in flight, CTA size) at the benchmark
geometry: `python -m benchmarks.tune_scorer`. Each variant is checked against the first one's raw scores."""

from __future__ import annotations

import torch

import kvops.triattention.score as score_mod
import kvops.triattention.score_cute as score_cute
from kvops.triattention import _cute
from kvops.triattention.score import score

from .bench_triattention import _graphed, qwen3_workload
from .common import device_copy_gbps, time_us

# (frequencies per lane, tokens per lane group and stage, CTA threads, chunk)
CONFIGS = [(8, 4, 64, 1024), (8, 5, 64, 1024), (8, 6, 64, 1024), (8, 8, 64, 1024), (8, 6, 64, 2048),
           (8, 6, 128, 1024), (8, 2, 64, 1024)]


def main() -> None:
    w = qwen3_workload(32, 16384)
    pools, table, N, P, phase, weights, n, k_bytes = w.pools, w.table, w.N, w.P, w.phase, w.weights, w.n, w.k_bytes
    copy = device_copy_gbps()
    first = None
    for fpl, unroll, threads, chunk in CONFIGS:
        score_cute.FREQS_PER_LANE, score_cute.UNROLL, score_cute.THREADS = fpl, unroll, threads
        score_cute.CHUNK = score_mod.CHUNK = chunk
        _cute._compiled.clear()
        raw, _ = score(pools, table, N, P, phase, weights, n)
        err = 0.0 if first is None else ((raw - first).abs() / first.abs().clamp_min(1)).max().item()
        first = raw if first is None else first
        del raw
        us = time_us(_graphed(lambda: score(pools, table, N, P, phase, weights, n)), iters=10)
        gbps = k_bytes / us / 1e3
        print(f"fpl={fpl} unroll={unroll} threads={threads} chunk={chunk}: {us / 1e3:.2f} ms, {gbps:.0f} GB/s = "
              f"{100 * gbps / copy:.1f}% of copy {copy:.0f} GB/s; max rel diff {err:.1e}", flush=True)
    # the same, last knobs, with each request's pages in order: how much the random page order costs
    ordered = torch.arange(table.numel(), device="cuda", dtype=torch.int32).view(table.shape)
    us = time_us(_graphed(lambda: score(pools, ordered, N, P, phase, weights, n)), iters=10)
    print(f"pages in order: {us / 1e3:.2f} ms, {100 * k_bytes / us / 1e3 / copy:.1f}% of copy", flush=True)


if __name__ == "__main__":
    main()
