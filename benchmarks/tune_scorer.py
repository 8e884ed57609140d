"""Sweep the CuTe scorer's launch knobs (frequencies per lane, tokens in flight, CTA size) at the benchmark
geometry: `python -m benchmarks.tune_scorer`. Each variant is compiled with its knobs as constructor arguments
(`scorer_spec(..., **knobs)`, compiled for this GPU and called through TVM-FFI as the op calls the shipped ones) and
checked against the first one's raw scores: `python -m benchmarks.tune_scorer [--dtype float8_e4m3fn]`."""

from __future__ import annotations

import argparse

import torch

from kvops import _cute
from kvops.triattention.score import KV_DTYPES, score, scorer_args, scorer_spec

from .bench_triattention import qwen3_workload
from .common import device_copy_gbps, graphed, time_us

# Scorer knobs; the first row is the default.
CONFIGS = [dict(freqs_per_lane=8, unroll=4, threads=64), dict(freqs_per_lane=8, unroll=5, threads=64),
           dict(freqs_per_lane=8, unroll=6, threads=64), dict(freqs_per_lane=8, unroll=8, threads=64),
           dict(freqs_per_lane=8, unroll=6, threads=128), dict(freqs_per_lane=8, unroll=2, threads=64)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", choices=[str(d).removeprefix("torch.") for d in KV_DTYPES], default="bfloat16")
    w = qwen3_workload(32, 16384, dtype=getattr(torch, ap.parse_args().dtype))
    pools, table, N, P, phase, weights, n, k_bytes = w.pools, w.table, w.N, w.P, w.phase, w.weights, w.n, w.k_bytes
    copy = device_copy_gbps()
    raw, stats = score(pools, table, N, P, phase, weights, n)  # the buffers (and a check of the arguments)
    first = raw.clone()
    pool = pools[0]
    G, F, T = raw.shape[2] // pool.shape[2], weights[0].shape[-1], pool.shape[3]
    for knobs in CONFIGS:
        fn = scorer_spec(pool.dtype, F, G, T, **knobs).build(_cute.arch(pool.device))
        args = scorer_args(pools, table, P, N, phase, *weights, raw, stats)
        us = time_us(graphed(lambda: fn(*args)), iters=10)
        err = ((raw - first).abs() / first.abs().clamp_min(1)).max().item()
        gbps = k_bytes / us / 1e3
        print(f"{knobs}: {us / 1e3:.2f} ms, {gbps:.0f} GB/s = {100 * gbps / copy:.1f}% of copy {copy:.0f} GB/s; "
              f"max rel diff {err:.1e}", flush=True)
    # the default knobs with each request's pages in order: how much the random page order costs
    ordered = torch.arange(table.numel(), device="cuda", dtype=torch.int32).view(table.shape)
    us = time_us(graphed(lambda: score(pools, ordered, N, P, phase, weights, n)), iters=10)
    print(f"pages in order: {us / 1e3:.2f} ms, {100 * k_bytes / us / 1e3 / copy:.1f}% of copy", flush=True)


if __name__ == "__main__":
    main()
