"""End-to-end decode speed of transformers ``generate()`` with kvops' TriAttention cache against dense caches.

    python -m benchmarks.e2e [--batch 32] [--context 16384,32768] [--prompt 1024] [--new-tokens 256]
        [--budget 2048] [--beta 128] [--mode per_head] [--caches default,dense-static,kvops,kvops-static] [--peak]
        [--attention kvops|grouped_sdpa] [--dense-attention kvops|grouped_sdpa] [--json FILE]
    python -m benchmarks.e2e --tiny        (CPU, a tiny random Qwen3: the mechanics only, said so in the output)

The model is Qwen3-8B built from its config with random bf16 weights (speed does not need trained weights) and
the shipped Qwen3-8B calibration. Each request holds `context` tokens before the timed decode: a `prompt` (never
evicted) and `context - prompt` tokens taken as generated, fed `beta` at a time, so the kvops cache runs its rounds
on them as it would have while generating them, and holds at most prompt + budget + beta. The dense caches hold
all of them. Then ``generate()`` decodes `new_tokens` greedy tokens per request, timed; the rounds inside it are
timed apart (CUDA events around each). Before the timed decode each cache decodes the same number of tokens
untimed (see ``_measure``).

Caches (``--caches``):
- ``default``: transformers' ``DynamicCache``, eager, ``sdpa`` attention (the eager baseline);
- ``dense-static``: transformers' ``StaticCache`` at full context, for which ``generate`` compiles the decode
  step (inductor, CUDA graphs): the dense baseline a user who wants speed runs, under ``--dense-attention``
  (default ``kvops``, faster for it on the H200 than ``grouped_sdpa``);
- ``kvops``: ``TriAttentionCache``, eager;
- ``kvops-static``: ``TriAttentionCache(static=True)``, compiled by ``generate`` as ``dense-static``;
- ``kvops-split-static``: the same with per-layer budgets (``layer_split``): all layers but the last
  ``--split-scored`` keep their newest half budget, the others share the rest of the same total
  (``kvops.config.split_budget``; random weights have no sensitivity to measure). It installs
  ``install_layer_masks`` on the model, so list it last.
The kvops caches run ``--attention`` (default ``kvops``: ``KVOPS_ATTENTION``, kvops' decode attention op;
``grouped_sdpa``: ``GROUPED_SDPA``, sdpa with the grouped heads packed, no K/V repeat under a mask).

Each row has a floor: the bytes a decode step must read (the KV the cache holds, on average over the decode, and
the weights but the input embedding) over the device copy bandwidth measured in the same run, and the step's time
over it. ``--peak`` runs each cache at the largest batch that fits the GPU for its context instead (and at
``--batch`` too when it is given), found by allocating it (``_fits``: the cache and a decode step on top), not
from KV bytes alone, and stepped down by 1/8 while the whole benchmark at it runs out of memory (the fill and
the compiled step allocate more); tokens/s there compare peak against peak. ``--context`` takes several contexts
(default 16k and 32k).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from kvops.calibrate import forwards_replaced, require_transformers
from kvops.config import DEFAULT_MODE, LOCAL_SHARE, split_budget
from kvops.integrations.transformers import (GROUPED_SDPA, KVOPS_ATTENTION, TriAttentionCache, cache_keyword,
                                             install_layer_masks, kv_bytes)
from kvops.triattention import load_calibration

from .common import device_copy_gbps

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def _model(fields: dict, device: str):
    transformers = require_transformers()
    config = transformers.Qwen3Config(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


# Tokens (batch x sequence) a forward's MLP takes at once while a cache is filled: the prompt's forward at batch 221
# x 1024 tokens held 17 GiB of MLP intermediates, which set the kvops peak batch instead of its pools.
MLP_TOKENS = 16384


def _bounded_mlps(model, tokens: int = MLP_TOKENS):
    """Each decoder layer's MLP over at most `tokens` tokens at a time, written into one output: the same values
    (an MLP acts on each token alone) with its intermediates bounded. The decode step (one token a row) passes
    through whole; the model is restored on exit, before generate compiles it."""
    mlps = [layer.mlp for layer in model.model.layers]

    def bounded(forward):
        def run(x):
            flat = x.reshape(-1, x.shape[-1])
            if flat.shape[0] <= tokens:
                return forward(x)
            out = torch.empty_like(flat)
            for part, dst in zip(flat.split(tokens), out.split(tokens)):
                dst.copy_(forward(part))
            return out.view(x.shape)
        return run

    return forwards_replaced({mlp: bounded(mlp.forward) for mlp in mlps})


def _fill(model, cache, ids: torch.Tensor, prompt: int, chunk: int) -> None:
    """Run ids through the model into `cache`: the prompt in one forward, then `chunk` tokens per forward, the MLPs
    bounded (_bounded_mlps). Only the last position's logits are computed (all of them would take 20 GB at batch
    32 x 2048 tokens)."""
    key = cache_keyword(model)
    with torch.no_grad(), _bounded_mlps(model):
        model(input_ids=ids[:, :prompt], logits_to_keep=1, **{key: cache})
        for start in range(prompt, ids.shape[1], chunk):
            model(input_ids=ids[:, start:start + chunk], logits_to_keep=1, **{key: cache})


class _RoundTimer:
    """CUDA events (or wall time on the CPU) around each of a TriAttentionCache's rounds."""

    def __init__(self, cache: TriAttentionCache):
        self.events, self.seconds = [], 0.0
        # the scored layers' rounds, and a layer split's local ones
        cache._compress, cache._keep_newest = self._timed(cache, cache._compress), self._timed(cache, cache._keep_newest)

    def _timed(self, cache: TriAttentionCache, run):
        def timed(*args):
            if cache.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = run(*args)
                end.record()
                self.events.append((start, end))
            else:
                t = time.perf_counter()
                out = run(*args)
                self.seconds += time.perf_counter() - t
            return out
        return timed

    def total_seconds(self) -> float:
        if self.events:
            torch.cuda.synchronize()
        return self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1e3


def _decode(model, cache, ids: torch.Tensor, new_tokens: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds for generate() to decode `new_tokens` tokens per row after `ids[:, :-1]` are cached, and the
    sequences."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             **{cache_keyword(model): cache})
    sync()
    return time.perf_counter() - start, seq


def _step(model, cache, batch: int, device: torch.device, steps: int = 8) -> tuple[float, float]:
    """(host, device) milliseconds of one eager decode forward: the time until the Python call returns and the GPU
    time between CUDA events around it. Host >= device means the step is bound by Python's launches."""
    key, token = cache_keyword(model), torch.ones(batch, 1, dtype=torch.long, device=device)
    host, gpu = [], []
    with torch.no_grad():
        for _ in range(steps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            model(input_ids=token, logits_to_keep=1, **{key: cache})
            end.record()
            host.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) / 1e3)
    return sorted(host)[steps // 2] * 1e3, sorted(gpu)[steps // 2] * 1e3


CACHES = ("default", "dense-static", "kvops", "kvops-static", "kvops-split-static")
# --attention: kvops' decode attention, or sdpa with grouped heads packed (no K/V repeat under a static cache's mask)
ATTENTION = {"kvops": KVOPS_ATTENTION, "grouped_sdpa": GROUPED_SDPA}
# generate compiles their decode step (inductor, CUDA graphs)
STATIC = ("dense-static", "kvops-static", "kvops-split-static")


def _new_cache(name: str, model, calibration, context: int, args):
    transformers = require_transformers()
    if name == "default":
        return transformers.DynamicCache(config=model.config)
    if name == "dense-static":  # every token of the context, the warm-up decode and the timed one
        return transformers.StaticCache(config=model.config, max_cache_len=context + 2 * args.new_tokens + 1)
    split = False
    if name == "kvops-split-static":
        L = model.config.num_hidden_layers
        split = split_budget(tuple(range(L - args.split_scored)), args.budget, L, LOCAL_SHARE)
        install_layer_masks(model)
    return TriAttentionCache(model.config, calibration, budget=args.budget, beta=args.beta, mode=args.mode,
                             static=name in STATIC, layer_split=split)


def _held_tokens(name: str, context: int, args) -> float:
    """Tokens a row's decode step must read, on average over the timed decode: the dense caches hold the whole
    context (it grows by new_tokens / 2 on average), a kvops row prompt + budget and, on average, half of beta."""
    if name in ("default", "dense-static"):
        return context + args.new_tokens / 2
    return args.prompt + args.budget + args.beta / 2


def _measure(name: str, model, calibration, ids: torch.Tensor, args, device: torch.device, r: dict) -> None:
    """Fill one cache with the context, decode once untimed, then decode timed. The untimed decode leaves what a
    server that has run a while has: compiled graphs, and per-shape attention plans (cuDNN's SDPA builds one per
    new KV length, about 2 ms per layer on the host); the default cache is cropped back to the context so that
    its timed decode sees the same lengths, and kvops' held lengths cycle every beta steps. A dense static cache
    reads all its slots under a mask whatever it holds, so it simply goes on decoding. Fills `r` as it goes: its
    "phase" names the phase running (what an out-of-memory error interrupted), and on the GPU the allocator's
    high-water mark after each phase is recorded."""
    context = ids.shape[1] - 1
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()

    def phase(what: str) -> None:  # a line on stderr per phase: the fill and the first (compiling) decode are long
        r["phase"] = what
        print(f"e2e: {name}, batch {ids.shape[0]}, context {context}: {what} ({time.perf_counter() - start:.0f} s "
              "in)", file=sys.stderr, flush=True)

    phase("fill")
    cache = _new_cache(name, model, calibration, context, args)
    timer = _RoundTimer(cache) if name.startswith("kvops") else None
    _fill(model, cache, ids[:, :-1], args.prompt, args.beta if timer else 2048)
    if cuda:
        r["peak_gib_fill"] = torch.cuda.max_memory_allocated(device) / 2**30
    if timer:
        r["kv_bytes"] = kv_bytes(cache)
    else:
        r["kv_bytes"] = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    phase("warm-up decode" + (", compiling the step" if name in STATIC else ""))
    r["warmup_decode_s"], seq = _decode(model, cache, ids, args.new_tokens, device)
    if cuda:
        r["peak_gib_warmup"] = torch.cuda.max_memory_allocated(device) / 2**30
    if name == "default":
        cache.crop(-(cache.get_seq_length() - context))  # back to the context
        seq = ids
    rounds, round_s = (cache.num_rounds, timer.total_seconds()) if timer else (0, 0.0)
    phase("timed decode")
    r["decode_s"], _ = _decode(model, cache, seq, args.new_tokens, device)
    r["tokens_per_s"] = ids.shape[0] * args.new_tokens / r["decode_s"]
    if cuda:
        r["peak_gib_decode"] = torch.cuda.max_memory_allocated(device) / 2**30
    if timer:
        r["decode_rounds"], r["decode_round_s"] = cache.num_rounds - rounds, timer.total_seconds() - round_s
        r["capacity_tokens"] = max(p.shape[3] for p in cache.pools)
    if cuda and name not in STATIC:  # a compiled step is timed by the decode alone
        r["step_host_ms"], r["step_gpu_ms"] = _step(model, cache, ids.shape[0], device)
    del r["phase"]


def _fits(name: str, model, calibration, batch: int, context: int, args, device: torch.device, per_token: int
          ) -> bool:
    """Whether `batch` rows fit on the GPU for this cache: a real allocation, not an estimate. A prompt-shaped
    forward allocates the cache (a dense static cache all its slots, kvops its pools), and a decode step runs on
    top (with the rest of the context's bytes held aside for a dynamic cache)."""
    cache = None
    try:
        cache = _new_cache(name, model, calibration, context, args)
        key = cache_keyword(model)
        with torch.no_grad(), _bounded_mlps(model):
            ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), device=device)
            model(input_ids=ids, logits_to_keep=1, **{key: cache})
            # a DynamicCache grows to the whole context: hold the bytes it would add while the step runs
            rest = torch.empty((batch * (context - args.prompt) * per_token) if name == "default" else 0,
                               dtype=torch.uint8, device=device)
            model(input_ids=ids[:, :1], logits_to_keep=1, **{key: cache})
            del rest
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del cache
        _release(device)  # an OOM's traceback holds the probe's tensors in a cycle: collected here


def _peak_batch(name: str, model, calibration, context: int, args, device: torch.device, per_token: int) -> int:
    """The largest batch that fits (_fits), by bisection from an upper bound on KV bytes alone."""
    capacity = context + 2 * args.new_tokens if name in ("default", "dense-static") else \
        args.prompt + args.budget + args.beta + 1
    lo, hi = 0, max(1, torch.cuda.mem_get_info()[0] // (capacity * per_token)) + 1  # lo fits (trivially), hi not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(name, model, calibration, mid, context, args, device, per_token) else (lo, mid)
    return lo


def _with_floor(r: dict, name: str, args, per_token: int, weight_bytes: int, copy_gbps: float | None) -> dict:
    """The step's floor: the bytes it must read (the KV it holds, on average, and the weights) over the copy
    bandwidth measured in this run; and the step's time over it."""
    r["step_ms"] = r["decode_s"] / args.new_tokens * 1e3
    r["step_read_bytes"] = int(r["batch"] * _held_tokens(name, r["context"], args) * per_token + weight_bytes)
    if copy_gbps:
        r["floor_ms"] = r["step_read_bytes"] / copy_gbps / 1e6
        r["step_over_floor"] = r["step_ms"] / r["floor_ms"]
    return r


def run(args) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    fields = TINY if args.tiny else QWEN3_8B
    model = _model(fields, device.type)
    if args.tiny:  # random statistics for the tiny geometry (speed and mechanics only)
        L, Hq, F = fields["num_hidden_layers"], fields["num_attention_heads"], fields["head_dim"] // 2
        calibration = load_calibration({"E_q": torch.randn(L, Hq, F, dtype=torch.complex64),
                                        "E_q_norm": torch.rand(L, Hq, F) + 1}, model.config.to_dict())
    else:
        calibration = load_calibration("qwen3-8b", model.config.to_dict())
    per_token = fields["num_hidden_layers"] * 2 * fields["num_key_value_heads"] * fields["head_dim"] * 2
    # what a decode step reads of the weights: all but the input embedding table (one row per token)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    copy_gbps = device_copy_gbps() if device.type == "cuda" else None
    out = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", tiny=args.tiny,
               batch=args.batch, contexts=args.context, prompt=args.prompt, new_tokens=args.new_tokens,
               budget=args.budget, beta=args.beta, mode=args.mode, peak=args.peak, attention=args.attention,
               dense_attention=args.dense_attention, copy_gbps=copy_gbps, weight_bytes=weight_bytes, rows=[])
    attention = model.config._attn_implementation
    for context in args.context:
        for name in args.caches:
            # the default cache keeps transformers' sdpa (the eager baseline)
            model.config._attn_implementation = attention if name == "default" else \
                ATTENTION[args.dense_attention if name == "dense-static" else args.attention]
            batches = [args.batch] if args.batch else []
            if args.peak:
                batches.append(_peak_batch(name, model, calibration, context, args, device, per_token))
            for batch in dict.fromkeys(batches):
                peak = batch != args.batch
                # a peak batch that _fits admitted can still run out of memory in the fill or the compiled step:
                # then the peak is the largest of a few smaller batches that runs the whole benchmark
                for attempt in range(4 if peak else 1):
                    torch.manual_seed(batch)
                    ids = torch.randint(1, fields["vocab_size"], (batch, context + 1), device=device)
                    r = dict(batch=batch, context=context)
                    try:
                        _measure(name, model, calibration, ids, args, device, r)
                        break
                    except torch.cuda.OutOfMemoryError:
                        r["oom"] = True  # with the phase it ran out in
                        if device.type == "cuda":
                            r["peak_gib_at_oom"] = torch.cuda.max_memory_allocated(device) / 2**30
                    # released outside the handler: while it runs, the exception's traceback holds the failed
                    # attempt's cache
                    print(json.dumps(dict(cache=name, **r)), file=sys.stderr, flush=True)
                    ids = None
                    _release(device)
                    batch = batch * 7 // 8
                r = dict(cache=name, peak=peak, **r)
                if not r.get("oom"):
                    _with_floor(r, name, args, per_token, weight_bytes, copy_gbps)
                out["rows"].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)  # progress: the table goes to stdout
                del ids
                _release(device)
    return out


def _release(device: torch.device) -> None:
    """Free what a measured or failed cache left behind before the next one: the compiled decode steps, whose CUDA
    graphs hold the cache's tensors as static inputs (a failed peak batch would otherwise keep its whole cache for
    the smaller batch tried next), then the allocator's cached blocks."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _table(out: dict) -> list[str]:
    """One line per row: tokens/s, against dense-static at the same context and batch (and at its peak), and the
    step against its floor."""
    rows = [r for r in out["rows"] if not r.get("oom")]
    dense = {(r["context"], r["batch"]): r["tokens_per_s"] for r in rows if r["cache"] == "dense-static"}
    dense_peak = {r["context"]: r["tokens_per_s"] for r in rows if r["cache"] == "dense-static" and r["peak"]}
    lines = [f"{'context':>7} {'cache':18} {'batch':>5} {'tokens/s':>9} {'vs dense-static':>15} {'vs its peak':>11} "
             f"{'step ms':>8} {'floor ms':>8} {'x floor':>7}"]
    for r in out["rows"]:
        if r.get("oom"):
            lines.append(f"{r['context']:>7} {r['cache']:18} {r['batch']:>5}  out of memory in the "
                         f"{r.get('phase', 'benchmark')}")
            continue
        same = dense.get((r["context"], r["batch"]))
        peak = dense_peak.get(r["context"]) if r["peak"] else None
        ratio = lambda base: f"{r['tokens_per_s'] / base:.2f}x" if base else "-"  # noqa: E731
        floor = (f"{r['floor_ms']:8.2f} {r['step_over_floor']:6.2f}x" if "floor_ms" in r else f"{'-':>8} {'-':>7}")
        lines.append(f"{r['context']:>7} {r['cache'] + (' (eager)' if r['cache'] in ('default', 'kvops') else ''):18} "
                     f"{r['batch']:>5} {r['tokens_per_s']:9.1f} {ratio(same):>15} {ratio(peak):>11} "
                     f"{r['step_ms']:8.2f} {floor}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny random Qwen3 (mechanics only)")
    ap.add_argument("--batch", type=int, help="requests per batch (default 32, --tiny 2)")
    ap.add_argument("--context", help="tokens each request holds before the timed decode; comma-separated for "
                                      "several (default 16384,32768)")
    ap.add_argument("--prompt", type=int, help="of each context, the tokens never evicted (default 1024, --tiny 16)")
    ap.add_argument("--new-tokens", type=int, help="decoded tokens per row, timed (default 256, --tiny 12)")
    ap.add_argument("--budget", type=int, help="the kvops caches' budget (default 2048, --tiny 48)")
    ap.add_argument("--beta", type=int, help="tokens between rounds (default 128, --tiny 8)")
    ap.add_argument("--mode", default=DEFAULT_MODE, choices=["union", "per_head", "per_layer_perhead"],
                    help="the kvops caches' eviction mode, under its default keep policy")
    ap.add_argument("--caches", default=",".join(CACHES),
                    help=f"comma-separated, from {CACHES} (the static ones: generate compiles the step)")
    ap.add_argument("--split-scored", type=int,
                    help="kvops-split-static: the layers scored (the last ones; default 4, --tiny 1); the others "
                         "keep half a budget")
    ap.add_argument("--attention", default="kvops", choices=sorted(ATTENTION), help="the kvops caches' attention")
    ap.add_argument("--dense-attention", default="kvops", choices=sorted(ATTENTION),
                    help="dense-static's attention (the faster one on the H200: kvops)")
    ap.add_argument("--peak", action="store_true",
                    help="run each cache at the largest batch that fits (found by allocating it; GPU only), and "
                         "at --batch when given")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    args.caches = args.caches.split(",")
    if not set(args.caches) <= set(CACHES):
        ap.error(f"--caches: choose from {CACHES}")
    defaults = dict(batch=2, context="160", prompt=16, new_tokens=12, budget=48, beta=8, split_scored=1) if \
        args.tiny else dict(batch=32, context="16384,32768", prompt=1024, new_tokens=256, budget=2048, beta=128,
                            split_scored=4)
    if args.batch is not None and args.batch < 1:
        ap.error(f"--batch: at least 1, got {args.batch}")
    if args.peak and args.batch is None:
        defaults["batch"] = 0  # peak rows only
    for name, value in defaults.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    try:
        args.context = [int(c) for c in str(args.context).split(",")]
    except ValueError:
        ap.error(f"--context: comma-separated token counts, got {args.context!r}")
    layers = (TINY if args.tiny else QWEN3_8B)["num_hidden_layers"]
    if not 1 <= args.split_scored < layers:
        ap.error(f"--split-scored: some of the model's {layers} layers, not all, got {args.split_scored}")
    if min(args.context) <= args.prompt:
        ap.error(f"--context: each context must exceed --prompt {args.prompt}")
    if args.peak and args.tiny:
        ap.error("--peak finds the largest batch that fits a GPU; it has no meaning with --tiny")
    if not args.tiny and not torch.cuda.is_available():
        print("benchmarks.e2e needs a CUDA GPU (or --tiny for the CPU mechanics)", file=sys.stderr)
        return 2
    out = run(args)
    if args.tiny:
        print("tiny random model on the CPU: these numbers show the mechanics run, not kvops' speed")
    print(f"decode {args.new_tokens} tokens per row ({out['device']}); floor: held KV + weights "
          f"({out['weight_bytes'] / 2**30:.1f} GiB) read once at the copy bandwidth measured here"
          + (f" ({out['copy_gbps']:.0f} GB/s)" if out["copy_gbps"] else ""))
    print("\n".join(_table(out)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
