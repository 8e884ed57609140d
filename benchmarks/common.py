"""Timing, limits and the one CSV format shared by every family's benchmark."""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, fields

import torch

COLUMNS = ["family", "routine", "shape", "dtype", "median_us", "gbps", "limit_gbps", "pct_of_limit", "baseline",
           "baseline_us", "speedup"]


@dataclass
class Row:
    family: str
    routine: str
    shape: str
    dtype: str
    median_us: float
    gbps: float            # bytes moved per second (what the routine's note says is counted)
    limit_gbps: float      # the measured limit for that traffic, same run
    pct_of_limit: float
    baseline: str
    baseline_us: float
    speedup: float         # baseline_us / median_us (for offload/onboard: hot bytes/s over the baseline's)

    @classmethod
    def make(cls, family, routine, shape, dtype, us, nbytes, limit_gbps, baseline="", baseline_us=float("nan"),
             speedup=None):
        gbps = nbytes / us / 1e3
        if speedup is None:
            speedup = baseline_us / us if baseline_us == baseline_us else float("nan")
        return cls(family, routine, shape, str(dtype).replace("torch.", ""), us, gbps, limit_gbps,
                   100.0 * gbps / limit_gbps if limit_gbps else float("nan"), baseline, baseline_us, speedup)


_FLUSH: list[torch.Tensor] = []


def flush_l2() -> None:
    """Evict the GPU's L2 (50 MB on the H200) by writing 256 MB, so a timed call reads its inputs from memory."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    _FLUSH[0].zero_()


def graphed(fn):
    """fn captured in a CUDA graph (after one eager call, which compiles Triton and CuTe kernels): its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_us(fn, iters: int = 20, warmup: int = 3, flush: bool = True, before=None) -> float:
    """Median microseconds of fn() on the current stream, by CUDA events after warm-up. With `flush` (the default)
    L2 is evicted before each timed call, outside the timed region: inputs come from memory, as they do in use
    unless a row says otherwise (flush=False, for inputs that real use has just written). `before`, when given,
    runs before each call (warm-up ones too), outside the timed region: e.g. restoring what fn() changes in place."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if flush:
            flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def device_copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3


def print_table(rows: list[Row]) -> None:
    hdr = ["routine", "shape", "dtype", "us", "GB/s", "limit", "%lim", "baseline", "base us", "x"]
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join([r.routine, r.shape, r.dtype, f"{r.median_us:.1f}", f"{r.gbps:.1f}", f"{r.limit_gbps:.1f}",
                          f"{r.pct_of_limit:.1f}", r.baseline, f"{r.baseline_us:.1f}", f"{r.speedup:.2f}"]))


def markdown_table(rows: list[Row]) -> str:
    out = ["| routine | shape | dtype | median µs | GB/s | limit GB/s | % of limit | baseline | baseline µs | speedup |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.routine} | {r.shape} | {r.dtype} | {r.median_us:.1f} | {r.gbps:.1f} | {r.limit_gbps:.1f} | "
                   f"{r.pct_of_limit:.1f} | {r.baseline} | {r.baseline_us:.1f} | {r.speedup:.2f} |")
    return "\n".join(out)


def write_csv(rows: list[Row], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[f.name for f in fields(Row)])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib; skipped", file=sys.stderr)
        return None
    return plt
