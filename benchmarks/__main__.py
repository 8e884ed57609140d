"""Run every family's benchmark on the GPU: python -m benchmarks [--quick] [--csv out.csv] [--plot out.png] [--md out.md]"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch

import kvops  # noqa: F401

from . import (bench_attention, bench_compaction, bench_nvfp4, bench_topk, bench_triattention, bench_vllm,
               bench_vllm_round)
from .common import markdown_table, print_table, pyplot, write_csv

FAMILIES = {"attention": bench_attention, "nvfp4": bench_nvfp4, "compaction": bench_compaction, "topk": bench_topk,
            "triattention": bench_triattention, "vllm_tier": bench_vllm, "vllm_round": bench_vllm_round}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller problems, fewer iterations")
    ap.add_argument("--csv", help="write all rows to this CSV file")
    ap.add_argument("--md", help="write markdown tables (for benchmarks/RESULTS.md) to this file")
    ap.add_argument("--plot", help="write a bar chart of %% of limit to this PNG (needs matplotlib)")
    ap.add_argument("--only", choices=sorted(FAMILIES), action="append", help="run only these families")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    try:
        commit = os.environ.get("KVOPS_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    header = (f"GPU: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs), "
              f"torch {torch.__version__}, date {datetime.date.today()}, commit {commit or '?'}")
    print(header)
    all_rows, md = [], [header, ""]
    for name in args.only or FAMILIES:
        rows, notes = FAMILIES[name].run(quick=args.quick)  # notes: markdown lines shown under the table
        print(f"\n== {name} ==")
        print_table(rows)
        print("\n".join(notes))
        all_rows += rows
        md += [f"### {name}", "", markdown_table(rows), "", *notes, ""]
    if args.csv:
        write_csv(all_rows, args.csv)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(md) + "\n")
    if args.plot and (plt := pyplot()) is not None:
        fig, ax = plt.subplots(figsize=(10, 0.3 * len(all_rows) + 1))
        labels = [f"{r.family}:{r.routine} {r.dtype} {r.shape[:24]}" for r in all_rows]
        ax.barh(labels, [r.pct_of_limit for r in all_rows])
        ax.axvline(90, color="k", ls="--")
        ax.set_xlabel("% of measured limit")
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
