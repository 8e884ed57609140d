"""TriAttention selection on the GPU: the whole round and its pieces.

Rows:
  score       the CuTe DSL scorer: Qwen3-8B geometry (36 layers, 32/8 heads, head_dim 128, bf16, pages of 16),
              32 requests of 16k decode tokens; bytes: K read once; limit: the device copy bandwidth (the
              issue's "HBM bandwidth", ~4.1 TB/s); from a CUDA graph.
  reduce_*    normalize + reduce (Triton) per mode; bytes: raw scores read + rows written.
  round_*     TriAttentionSelector.select (mean phase + score + reduce + top-k (bench_topk.py), budget 2048) from a
              graph;
              bytes: K; baseline: the eager plain-torch implementation of the same math (torch scorer and
              reduce, torch.topk + sort), same inputs.
  mean_phase  the coefficient kernel for 32 requests, Qwen3-8B (F = 64), from a graph.
  score, round_union with dtype float8_e4m3fn  the same on fp8 pools beside bf16 at 32 x 2176 and 8 x 16384.
  round_steady*  the round where serving runs it: R in {1, 8, 32, 128} due requests of prompt 1024 + 2176 decode
              tokens (budget 2048 + beta 128), pages of 32, HND pools with K and V planes, modes union and
              per_layer_perhead, compaction ordered and fill: `_select` (TriAttentionSelector), `_compact` and the
              whole round as the manager runs it (TriAttentionRound), each from a graph, and `_select_eager`
              (the same call without a graph); `_compact` and the round each start from the same pools (restored
              before every call, outside the timed region). Floor: the decode tokens'
              K read once plus, read and written, the bytes fill order must move, at the copy bandwidth.
  round_steady_policy  the whole round (fill) at R=32 under keep-policy options (4 sink tokens, a recent window
              of 64, layer 0 on recency, and all three; a recency prior of 8, which reads and follows every decode
              slot's logical position; then each mode's defaults) against the same round without them, per_head,
              union and per_layer_perhead: 7 repeats of
              40 replays, each repeat timing every configuration of the mode in turn, each replay on the same
              pools (restored before it, outside the timed region); the medians.
  round_steady_split  a layer split's rounds at R=32 (per_head defaults, fill) against the plain round under
              per_head's defaults, same total: all layers but the last 4 keep half a budget (1024) with the window
              round (no selector), the 4 others the rest (10240 each) with the scored round, each group's pools
              holding prompt + its count + beta; the split's cost per beta tokens is both rounds (each group runs
              one every beta tokens in steady state). Repeats as round_steady_policy. Floor: the scored layers' K
              read once, plus what both rounds move, read and written.
  first_round  the whole round (fill, R=1 of the steady shape) in a fresh process with empty Triton, kvops and CUDA
              caches, once per mode, eager (no graph), timed from after `import kvops` and the workload's
              allocation to the round's end; baseline: the same round again in that process (warm). The note gives
              `import kvops` beyond `import torch`, and what Triton's cache held afterwards (nothing: no kernel
              compiled).
  round_steady_tp1  the whole union round (fill) at R=32 with a one-rank NCCL process group (tensor parallelism:
              the all-reduce of the union rows runs, recorded in the graph) against the same round without one.
  (notes) round_kernels  every kernel and copy of one steady round at R=32 (fill, each mode under bare scores and
              per_head under its defaults), from the torch profiler over an eager run: launches, device time and
              its share of the round's kernels; the K the scorer reads and the bytes the move must move, for scale.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch
import triton

from kvops.compaction import compact, decision_rows
from kvops.config import LOCAL_SHARE, resolve_keep_policy, split_budget
from kvops.manager import TriAttentionRound, policy_selector, round_order
from kvops.triattention import Calibration, TriAttentionSelector, mean_phase
from kvops.triattention.reduce import reduce_rows
from kvops.triattention.reference import reduce_torch, score_torch
from kvops.triattention.score import CHUNK, STATS, score

from .common import Row, device_copy_gbps, graphed, time_us

FAMILY = "triattention"


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    copy_gbps = device_copy_gbps()
    iters = 5 if quick else 50
    rows_out: list[Row] = []
    starts = torch.randint(0, 2 ** 24, (32,), device="cuda")
    omega = torch.rand(64, device="cuda")
    phase = torch.empty(32, 2, 64, device="cuda")
    us = time_us(graphed(lambda: mean_phase(starts, omega, phase)), iters=iters)
    rows_out.append(Row.make(FAMILY, "mean_phase", "R=32 F=64", "float32", us, phase.numel() * 4, copy_gbps / 2))
    notes = _round(rows_out, copy_gbps, quick)
    notes += _kv_dtypes(rows_out, copy_gbps, quick)
    notes += _first_round(rows_out, copy_gbps)
    notes += _round_steady(rows_out, copy_gbps, quick)
    notes += _round_tp(rows_out, copy_gbps, quick)
    notes += _round_policy(rows_out, copy_gbps, quick)
    notes += _round_split(rows_out, copy_gbps, quick)
    if not quick:
        notes += _round_kernels()
    return rows_out, notes


def qwen3_workload(R: int, n: int, page_size: int = 16, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """The issue's geometry on the GPU: Qwen3-8B (36 layers, 32/8 heads, head_dim 128) K pools of `dtype` holding R
    requests of n decode tokens each (no prompt) on shuffled pages, synthetic statistics, random round starts."""
    L, Hq, Hkv, D = 36, 32, 8, 128
    F, pages = D // 2, R * n // page_size
    cal = Calibration(torch.randn(L, Hq, F, dtype=torch.complex64), torch.rand(L, Hq, F) + 1,
                      1e6 ** -(torch.arange(F) / F), torch.ones(F), Hkv, D)
    starts = torch.randint(n, 2 ** 20, (R,), device="cuda")
    return SimpleNamespace(
        cal=cal, L=L, Hq=Hq, Hkv=Hkv, D=D, T=page_size, R=R, n=n, starts=starts,
        k_bytes=L * R * n * Hkv * D * dtype.itemsize,
        pools=[torch.randn(pages, 1, Hkv, page_size, D, device="cuda").to(dtype) for _ in range(L)],
        table=torch.randperm(pages, device="cuda", dtype=torch.int32).view(R, n // page_size),
        P=torch.zeros(R, dtype=torch.int32, device="cuda"), N=torch.full((R,), n, dtype=torch.int32, device="cuda"),
        weights=tuple(w.cuda() for w in cal.score_weights()), phase=mean_phase(starts, cal.omega.cuda()),
        shape=f"R={R} N={n} L={L} Hq={Hq} Hkv={Hkv} D={D} page={page_size}")


def _round(rows_out: list[Row], copy_gbps: float, quick: bool) -> list[str]:
    budget = 2048
    w = qwen3_workload(4 if quick else 32, 16384)
    cal, L, Hq, Hkv, R, n, pools, table, P, N = w.cal, w.L, w.Hq, w.Hkv, w.R, w.n, w.pools, w.table, w.P, w.N
    starts, k_bytes, shape, weights, phase = w.starts, w.k_bytes, w.shape, w.weights, w.phase
    us = time_us(graphed(lambda: score(pools, table, N, P, phase, weights, n)), iters=10)
    rows_out.append(Row.make(FAMILY, "score", shape, "bfloat16", us, k_bytes, copy_gbps))
    raw, stats = score(pools, table, N, P, phase, weights, n)
    for mode in ("union", "per_head", "per_layer_perhead"):
        us = time_us(graphed(lambda: reduce_rows(raw, stats, N, P, mode, Hkv)), iters=10)
        out_rows = decision_rows(mode, L, Hkv)
        rows_out.append(Row.make(FAMILY, f"reduce_{mode}", shape, "float32", us, raw.numel() * 4 + R * out_rows * n * 4,
                                 copy_gbps))

    def eager_torch(mode):
        raw = torch.empty(R, L, Hq, n, device="cuda")
        stats = torch.empty(R, L, Hq, triton.cdiv(n, CHUNK), STATS, device="cuda")
        score_torch(pools, table, P, N, phase, *weights, raw, stats)
        rows = torch.empty(R, decision_rows(mode, L, Hkv), n, device="cuda")
        reduce_torch(raw, stats, P, N, rows, mode, Hkv, True)
        return rows.view(-1, n).topk(budget, dim=1).indices.sort(dim=1)

    notes = []
    for mode in ("union", "per_layer_perhead"):
        selector = TriAttentionSelector(cal, budget, mode, max_decode=n)
        us = time_us(graphed(lambda: selector.select(pools, table, N, P, starts)), iters=10)
        base = time_us(lambda: eager_torch(mode), iters=2, warmup=1)
        rows_out.append(Row.make(FAMILY, f"round_{mode}", shape, "bfloat16", us, k_bytes, copy_gbps,
                                 "eager torch", base))
        floor = k_bytes / copy_gbps / 1e3
        notes.append(f"round_{mode}: {us / 1e3:.2f} ms = {us / floor:.2f}x the floor of reading K once at the copy "
                     f"bandwidth ({floor / 1e3:.2f} ms); eager torch {base / 1e3:.1f} ms.")
    return notes


def _kv_dtypes(rows_out: list[Row], copy_gbps: float, quick: bool) -> list[str]:
    """score and the union round (TriAttentionSelector.select) on bf16 and fp8 e4m3 pools at the fp8 issue's shapes:
    the steady state (32 x 2176) and long contexts (8 x 16384)."""
    notes = []
    for R, n in ((4, 2176),) if quick else ((32, 2176), (8, 16384)):
        rounds = {}
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            w = qwen3_workload(R, n, dtype=dtype)
            name = str(dtype).removeprefix("torch.")
            us = time_us(graphed(lambda: score(w.pools, w.table, w.N, w.P, w.phase, w.weights, n)), iters=10)
            rows_out.append(Row.make(FAMILY, "score", w.shape, name, us, w.k_bytes, copy_gbps))
            selector = TriAttentionSelector(w.cal, 2048, "union", max_decode=n)
            us = time_us(graphed(lambda: selector.select(w.pools, w.table, w.N, w.P, w.starts)), iters=10)
            rows_out.append(Row.make(FAMILY, "round_union", w.shape, name, us, w.k_bytes, copy_gbps))
            rounds[name] = (us, w.k_bytes / copy_gbps / 1e3)
            w = None  # freed before the next case
        (bf16, _), (fp8, fp8_floor) = rounds["bfloat16"], rounds["float8_e4m3fn"]
        notes.append(f"round_union R={R} N={n}: float8_e4m3fn {fp8 / 1e3:.2f} ms = {fp8 / bf16:.2f}x the bfloat16 "
                     f"round ({bf16 / 1e3:.2f} ms) and {fp8 / fp8_floor:.2f}x its floor of reading K once.")
    return notes


def steady_workload(R: int, device: str = "cuda", layers: int = 36, prompt: int = 1024, budget: int = 2048,
                    beta: int = 128, page_size: int = 32) -> SimpleNamespace:
    """R due requests as the manager sees them: Qwen3-8B heads (32/8, head_dim 128, bf16), HND pools with K and V
    planes, prompt + budget + beta tokens each on shuffled pages, synthetic statistics."""
    Hq, Hkv, D = 32, 8, 128
    F, n = D // 2, prompt + budget + beta
    per = triton.cdiv(n, page_size)
    cal = Calibration(torch.randn(layers, Hq, F, dtype=torch.complex64), torch.rand(layers, Hq, F) + 1,
                      1e6 ** -(torch.arange(F) / F), torch.ones(F), Hkv, D)
    pools = [torch.randn(R * per, 2, Hkv, page_size, D, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    return SimpleNamespace(cal=cal, L=layers, Hkv=Hkv, D=D, R=R, n=n, prompt=prompt, budget=budget, beta=beta,
                           pools=pools, table=torch.randperm(R * per, dtype=torch.int32).view(R, per),
                           device=torch.device(device))


def steady_round(w: SimpleNamespace, mode: str, order: str, cuda_graphs: bool, process_group=None,
                 sink_tokens: int = 0, recent_window: int = 0, recent_layers: tuple[int, ...] = (),
                 recency_prior: float = 0.0):
    """The manager's device half of a round over the workload, run once (on the GPU: captured for replays), under
    a keep policy as the manager sets it up."""
    selector = policy_selector("steady_round", w.cal, w.budget, mode, w.budget + 2 * w.beta,
                               sink_tokens=sink_tokens, recent_window=recent_window, recent_layers=recent_layers,
                               recency_prior=recency_prior,
                               process_group=process_group)
    cache = SimpleNamespace(device=w.device, views=lambda: w.pools)
    max_tail, positions = w.beta + recent_window, None
    if recency_prior:  # as after an earlier round: its slots' logical positions out of order, the rest in order
        positions = torch.empty(w.R, selector.rows, selector.budget + max_tail, dtype=torch.int32, device=w.device)
        positions.copy_(torch.rand(positions.shape, device=w.device).argsort(-1) + w.prompt + sink_tokens)
    rnd = TriAttentionRound(selector, cache, w.R, w.table.shape[1], max_tail, cuda_graphs,
                            round_order(order, recent_window, w.beta), recent_layers, positions)
    rnd.run(*steady_args(w, rnd, sink_tokens, recent_window))
    return selector, rnd


def steady_args(w: SimpleNamespace, rnd: TriAttentionRound, sink_tokens: int = 0, recent_window: int = 0,
                **_) -> tuple:
    """TriAttentionRound.run's arguments for the workload's round under a keep policy (the seats and stored slots
    of every request, as after an earlier round, when the round tracks slot positions)."""
    R, W = w.R, recent_window
    table = torch.nn.functional.pad(w.table, (0, rnd.width - w.table.shape[1]), value=-1)  # its bound width
    tracked = rnd.slot_positions is not None
    return (table, [w.n - W] * R, [w.prompt + sink_tokens] * R, [W] * R, [w.n] * R,
            list(range(R)) if tracked else [], [rnd.selector.budget + W] * R if tracked else [])


def restorer(pools: list[torch.Tensor]):
    """A function that puts the pools back as they are now (a copy of them is kept). Each timed round or
    compaction starts from the same pools: a round compacts them in place, and one run on what the last left (the
    kept tokens' stale copies still past the new length) moves far fewer tokens than a real round."""
    pristine = [p.clone() for p in pools]

    def restore():
        for p, q in zip(pools, pristine):
            p.copy_(q)
    return restore


def fill_moved_bytes(w: SimpleNamespace, rnd) -> int:
    """Bytes a fill-order round moves (each read once and written once; counted once here), from its moves lists.
    A union row serves every layer and KV head, a per-head row every layer, a per-(layer, head) row one stream;
    each stream is K and V planes of head_dim bf16 values."""
    rows = rnd.params.kept.shape[1]
    moved = int((rnd.params.moves[:w.R, :rows] >= 0).sum())
    return moved * (w.L * w.Hkv // rows) * 2 * w.D * 2


def _round_steady(rows_out: list[Row], copy_gbps: float, quick: bool) -> list[str]:
    notes = []
    for R in ((1, 8) if quick else (1, 8, 32, 128)):
        w = steady_workload(R)
        restore = restorer(w.pools)
        k_bytes = w.L * R * (w.budget + w.beta) * w.Hkv * w.D * 2
        for mode in ("union", "per_layer_perhead"):
            floor_bytes = None
            for order in ("fill", "ordered"):  # fill first: its lists give the floor for both
                restore()
                selector, rnd = steady_round(w, mode, order, cuda_graphs=True)
                if floor_bytes is None:
                    floor_bytes = k_bytes + 2 * fill_moved_bytes(w, rnd)
                pt, lengths = rnd.page_table[:R], rnd.lengths[:, :R]
                select_us = time_us(graphed(lambda: selector.select(w.pools, pt, lengths[0], lengths[1],
                                                                     lengths[3])), iters=10)
                eager_us = time_us(lambda: selector.select(w.pools, pt, lengths[0], lengths[1], lengths[3]), iters=10)
                compact_us = time_us(graphed(lambda: compact(rnd.params, R)), iters=10, before=restore)
                round_us = time_us(rnd.graphs[R].replay, iters=10, before=restore)
                shape = f"R={R} {w.prompt}+{w.budget + w.beta} L={w.L} Hkv={w.Hkv} {mode} {order}"
                for routine, us, nbytes in (("round_steady_select", select_us, k_bytes),
                                            ("round_steady_select_eager", eager_us, k_bytes),
                                            ("round_steady_compact", compact_us, floor_bytes - k_bytes),
                                            ("round_steady", round_us, floor_bytes)):
                    rows_out.append(Row.make(FAMILY, routine, shape, "bfloat16", us, nbytes, copy_gbps))
                floor = floor_bytes / copy_gbps / 1e3
                notes.append(f"round_steady {shape}: {round_us:.0f} us = {round_us / floor:.2f}x its floor "
                             f"({floor:.0f} us); select {select_us:.0f} us ({eager_us / select_us:.2f}x eager), "
                             f"compact {compact_us:.0f} us.")
        w = None
        torch.cuda.empty_cache()
    return notes


_FIRST_ROUND = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import kvops
t2 = time.perf_counter()
from benchmarks.bench_triattention import steady_workload, steady_round
w = steady_workload(1)
torch.cuda.synchronize()
out = {"import_kvops_s": t2 - t1}
for mode in ("per_layer_perhead", "union"):
    for when in ("first", "warm"):
        t = time.perf_counter()
        steady_round(w, mode, "fill", cuda_graphs=False)
        torch.cuda.synchronize()
        out[f"{mode}_{when}_us"] = (time.perf_counter() - t) * 1e6
print(json.dumps(out))
"""


def _first_round(rows_out: list[Row], copy_gbps: float) -> list[str]:
    """The first rounds of a fresh process with empty caches (module docstring: first_round)."""
    with tempfile.TemporaryDirectory() as tmp:
        caches = {name: os.path.join(tmp, name) for name in ("TRITON_CACHE_DIR", "KVOPS_CACHE_DIR", "CUDA_CACHE_PATH")}
        for path in caches.values():
            os.makedirs(path)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **caches, "PYTHONPATH": pythonpath}
        done = subprocess.run([sys.executable, "-c", _FIRST_ROUND], env=env, cwd=root, capture_output=True, text=True,
                              timeout=600)
        if done.returncode:
            return [f"first_round failed: {done.stderr[-2000:]}"]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        compiled = sum(len(files) for _, _, files in os.walk(caches["TRITON_CACHE_DIR"]))
    w = SimpleNamespace(L=36, Hkv=8, D=128, budget=2048, beta=128)
    k_bytes = w.L * (w.budget + w.beta) * w.Hkv * w.D * 2
    for mode in ("per_layer_perhead", "union"):
        rows_out.append(Row.make(FAMILY, "first_round", f"R=1 1024+2176 L=36 Hkv=8 {mode} fill, fresh process",
                                 "bfloat16", out[f"{mode}_first_us"], k_bytes, copy_gbps, "the same round, warm",
                                 out[f"{mode}_warm_us"]))
    return [f"first_round: import kvops {out['import_kvops_s']:.2f} s beyond torch; first per_layer_perhead round "
            f"{out['per_layer_perhead_first_us'] / 1e6:.3f} s, then the first union round "
            f"{out['union_first_us'] / 1e6:.3f} s; Triton's cache afterwards: {compiled} files."]


def _round_tp(rows_out: list[Row], copy_gbps: float, quick: bool) -> list[str]:
    """The union round with a one-rank NCCL group (the path a tensor-parallel rank runs) against no group."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return ["round_steady_tp1: skipped, torch has no NCCL"]
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        R = 8 if quick else 32
        w = steady_workload(R)
        us = {}
        for name, group in (("no group", None), ("group", dist.group.WORLD)):
            _, rnd = steady_round(w, "union", "fill", cuda_graphs=True, process_group=group)
            floor_bytes = w.L * R * (w.budget + w.beta) * w.Hkv * w.D * 2 + 2 * fill_moved_bytes(w, rnd)
            us[name] = time_us(rnd.graphs[R].replay, iters=10)
        shape = f"R={R} {w.prompt}+{w.budget + w.beta} L={w.L} Hkv={w.Hkv} union fill, NCCL world 1"
        rows_out.append(Row.make(FAMILY, "round_steady_tp1", shape, "bfloat16", us["group"], floor_bytes, copy_gbps,
                                 "no group", us["no group"]))
        return [f"round_steady_tp1 R={R}: {us['group']:.0f} us with a one-rank NCCL group, {us['no group']:.0f} us "
                f"without ({us['group'] / us['no group'] - 1:+.1%})."]
    finally:
        if created:
            dist.destroy_process_group()


POLICY_REPEATS, POLICY_ITERS = 7, 40
POLICIES = {"sinks 4": dict(sink_tokens=4), "recent 64": dict(recent_window=64),
            "layer 0 recent": dict(recent_layers=(0,)),
            "all three": dict(sink_tokens=4, recent_window=64, recent_layers=(0,)),
            "recency prior 8": dict(recency_prior=8.0)}


def _round_policy(rows_out: list[Row], copy_gbps: float, quick: bool) -> list[str]:
    """The cost of the keep-policy options: the steady round with each against the plain one, same workload; and
    with each mode's defaults (kvops.config.resolve_keep_policy). The
    configurations of a mode are timed in turn, POLICY_REPEATS times over, so that a drift of the GPU's clocks
    during the run falls on all of them alike; a cell is the median of its repeats."""
    R = 8 if quick else 32
    w = steady_workload(R)
    restore = restorer(w.pools)
    notes = []
    for mode in ("per_head", "union", "per_layer_perhead"):
        defaults = resolve_keep_policy("_round_policy", mode, w.budget, w.beta, w.L)._asdict()
        configs = {"plain": {}, **POLICIES, "defaults": defaults}
        rounds = {}
        for name, options in configs.items():  # each first round (and the floor's lists) from the same pools
            restore()
            rounds[name] = steady_round(w, mode, "fill", cuda_graphs=True, **options)[1]
        floor_bytes = w.L * R * (w.budget + w.beta) * w.Hkv * w.D * 2 + 2 * fill_moved_bytes(w, rounds["plain"])
        times = {name: [] for name in configs}
        for rnd in rounds.values():  # warm replays first: no configuration pays for the clocks ramping up
            for _ in range(50):
                rnd.graphs[R].replay()
        torch.cuda.synchronize()
        for _ in range(POLICY_REPEATS):
            for name, rnd in rounds.items():
                times[name].append(time_us(rnd.graphs[R].replay, iters=POLICY_ITERS, before=restore))
        base = statistics.median(times["plain"])
        for name, options in configs.items():
            if name == "plain":
                continue
            us = statistics.median(times[name])
            ratios = [t / b - 1 for t, b in zip(times[name], times["plain"])]
            order = round_order("fill", options.get("recent_window", 0), w.beta)
            shape = f"R={R} {w.prompt}+{w.budget + w.beta} L={w.L} Hkv={w.Hkv} {mode} {order}, {name}"
            rows_out.append(Row.make(FAMILY, "round_steady_policy", shape, "bfloat16", us, floor_bytes, copy_gbps,
                                     "plain round", base))
            notes.append(f"round_steady_policy R={R} {mode} {name} ({order}): {us:.0f} us against {base:.0f} us "
                         f"plain ({us / base - 1:+.1%}; each repeat {min(ratios):+.1%} to {max(ratios):+.1%}).")
        rounds = None
        torch.cuda.empty_cache()
    return notes


SPLIT_SCORED = 4  # round_steady_split's scored layers


def _round_split(rows_out: list[Row], copy_gbps: float, quick: bool) -> list[str]:
    """A layer split's two rounds against the plain round on the same total (the module's docstring)."""
    R = 8 if quick else 32
    plain = steady_workload(R)
    split = split_budget(tuple(range(plain.L - SPLIT_SCORED)), plain.budget, plain.L, LOCAL_SHARE)
    scored = steady_workload(R, layers=SPLIT_SCORED, budget=split.budget)
    local = steady_workload(R, layers=plain.L - SPLIT_SCORED, budget=split.local_budget)
    restores = [restorer(w.pools) for w in (plain, scored, local)]

    def restore():
        for r in restores:
            r()
    rounds = {name: steady_round(w, "per_head", "fill", cuda_graphs=True, **resolve_keep_policy(
        "_round_split", "per_head", w.budget, w.beta, w.L, recent_layers=layers)._asdict())[1]
        for name, w, layers in (("plain", plain, None), ("scored", scored, ()))}  # the split's: no recent layer
    cache = SimpleNamespace(device=local.device, views=lambda: local.pools)
    rounds["local"] = window = TriAttentionRound(None, cache, R, local.table.shape[1], 0, True, "fill",
                                                 window=split.local_budget)
    table = torch.nn.functional.pad(local.table, (0, window.width - local.table.shape[1]), value=-1)
    window.run(table, [local.n] * R, [local.prompt] * R, [0] * R, [local.n] * R)
    for rnd in rounds.values():  # warm replays first
        for _ in range(50):
            rnd.graphs[R].replay()
    torch.cuda.synchronize()
    times = {name: [] for name in rounds}
    for _ in range(POLICY_REPEATS):
        for name, rnd in rounds.items():
            times[name].append(time_us(rnd.graphs[R].replay, iters=POLICY_ITERS, before=restore))
    base = statistics.median(times["plain"])
    both = [a + b for a, b in zip(times["scored"], times["local"])]
    us = statistics.median(both)
    # the ring moves each request's beta newest tokens into the slots of evicted ones, in every local layer
    local_moved = R * local.L * local.beta * 2 * local.Hkv * local.D * 2
    floor_bytes = (SPLIT_SCORED * R * (scored.budget + scored.beta) * scored.Hkv * scored.D * 2 +
                   2 * fill_moved_bytes(scored, rounds["scored"]) + 2 * local_moved)
    shape = (f"R={R} {plain.prompt}+{plain.budget + plain.beta} L={plain.L} Hkv={plain.Hkv} per_head fill, "
             f"{local.L} layers at {split.local_budget} + {SPLIT_SCORED} at {split.budget}")
    rows_out.append(Row.make(FAMILY, "round_steady_split", shape, "bfloat16", us, floor_bytes, copy_gbps,
                             "plain round", base))
    ratios = [t / b - 1 for t, b in zip(both, times["plain"])]
    return [f"round_steady_split {shape}: {us:.0f} us (scored {statistics.median(times['scored']):.0f} us + local "
            f"{statistics.median(times['local']):.0f} us) against {base:.0f} us plain ({us / base - 1:+.1%}; each "
            f"repeat {min(ratios):+.1%} to {max(ratios):+.1%}); floor {floor_bytes / copy_gbps / 1e3:.0f} us."]


def _round_kernels() -> list[str]:
    """Every kernel and copy of one steady round (R = 32, fill), aggregated by name from the torch profiler over an
    eager run after a warm one (a graph replays the same launches)."""
    from torch.profiler import ProfilerActivity, profile

    R = 32
    w = steady_workload(R)
    notes = [f"round_kernels R={R} {w.prompt}+{w.budget + w.beta} L={w.L} Hkv={w.Hkv} (fill; K of the decode tokens "
             f"{w.L * R * (w.budget + w.beta) * w.Hkv * w.D * 2 / 1e6:.0f} MB):"]
    cases = [(mode, {}) for mode in ("union", "per_head", "per_layer_perhead")]
    cases += [(mode, resolve_keep_policy("_round_kernels", mode, w.budget, w.beta, w.L)._asdict())
              for mode in ("per_head", "per_layer_perhead")]
    for mode, options in cases:
        _, rnd = steady_round(w, mode, "fill", cuda_graphs=False, **options)
        args = steady_args(w, rnd, **options)
        rnd.run(*args)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rnd.run(*args)
            torch.cuda.synchronize()
        kernels = sorted((k for k in prof.key_averages() if k.device_time_total > 0),
                         key=lambda k: -k.device_time_total)  # (the device-side entries: kernels, copies, memsets)
        total = sum(k.device_time_total for k in kernels)
        moved = 2 * fill_moved_bytes(w, rnd)
        notes += ["", f"{mode}{' defaults ' + str(options) if options else ''}: {sum(k.count for k in kernels)} "
                  f"launches and copies, {total:.0f} us of device time; the move must read and write "
                  f"{moved / 1e6:.0f} MB.", "", "| kernel | launches | us | share |", "|---|---|---|---|"]
        notes += [f"| `{k.key[:70]}` | {k.count} | {k.device_time_total:.1f} | {k.device_time_total / total:.1%} |"
                  for k in kernels]
    return notes
