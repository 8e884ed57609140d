"""End-to-end decode speed of transformers ``generate()`` with kvops' TriAttention cache against the default cache.

    python -m benchmarks.e2e [--batch 32] [--context 16384] [--prompt 1024] [--new-tokens 256] [--budget 2048]
        [--beta 128] [--mode union] [--caches default,kvops,kvops-static] [--json FILE]
    python -m benchmarks.e2e --tiny        (CPU, a tiny random Qwen3: the mechanics only, said so in the output)

The model is Qwen3-8B built from its config with random bf16 weights (speed does not need trained weights) and
the shipped Qwen3-8B calibration. Each request holds `context` tokens before the timed decode: a `prompt` (never
evicted) and `context - prompt` tokens taken as generated, fed `beta` at a time, so the kvops cache runs its rounds
on them as it would have while generating them, and holds at most prompt + budget + beta. The default cache
(``DynamicCache``) holds all of them. Then ``generate()`` decodes `new_tokens` greedy tokens per request, timed; the
rounds inside it are timed apart (CUDA events around each). Caches (``--caches``): ``default`` and ``kvops`` run
eagerly (``sdpa`` attention); ``kvops-static`` is the kvops cache with static shapes, for which ``generate`` compiles
the decode step by itself (inductor, CUDA graphs), under ``GROUPED_SDPA`` attention. Before the timed decode each
cache decodes the same number of tokens untimed (see ``_measure``). Memory: the KV bytes each holds, and
from them, with the free memory after loading the model, the largest batch each could hold at `--max-context`
(an estimate from KV bytes alone; activations are not counted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvops.calibrate import require_transformers
from kvops.integrations.transformers import GROUPED_SDPA, TriAttentionCache, cache_keyword, kv_bytes
from kvops.triattention import load_calibration

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


def _fill(model, cache, ids: torch.Tensor, prompt: int, chunk: int) -> None:
    """Run ids through the model into `cache`: the prompt in one forward, then `chunk` tokens per forward. Only the
    last position's logits are computed (all of them would take 20 GB at batch 32 x 2048 tokens)."""
    key = cache_keyword(model)
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], logits_to_keep=1, **{key: cache})
        for start in range(prompt, ids.shape[1], chunk):
            model(input_ids=ids[:, start:start + chunk], logits_to_keep=1, **{key: cache})


class _RoundTimer:
    """CUDA events (or wall time on the CPU) around each of a TriAttentionCache's rounds."""

    def __init__(self, cache: TriAttentionCache):
        self.events, self.seconds, compress = [], 0.0, cache._compress

        def timed(held):
            if cache.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                held = compress(held)
                end.record()
                self.events.append((start, end))
            else:
                t = time.perf_counter()
                held = compress(held)
                self.seconds += time.perf_counter() - t
            return held

        cache._compress = timed

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


CACHES = ("default", "kvops", "kvops-static")


def _measure(name: str, model, calibration, ids: torch.Tensor, args, device: torch.device) -> dict:
    """Fill one cache with the context, decode once untimed, then decode timed. The untimed decode leaves what a
    server that has run a while has: compiled graphs, and per-shape attention plans (cuDNN's SDPA builds one per
    new KV length, about 2 ms per layer on the host); the default cache is cropped back to the context so that
    its timed decode sees the same lengths, and kvops' held lengths cycle every beta steps."""
    transformers = require_transformers()
    if name == "default":
        cache = transformers.DynamicCache(config=model.config)
    else:
        cache = TriAttentionCache(model.config, calibration, budget=args.budget, beta=args.beta, mode=args.mode,
                                  static=name == "kvops-static")
    timer = _RoundTimer(cache) if name != "default" else None
    _fill(model, cache, ids[:, :-1], args.prompt, 2048 if name == "default" else args.beta)
    r = dict(kv_bytes=kv_bytes(cache) if timer else sum(t.numel() * t.element_size() for layer in cache.layers
                                                          for t in (layer.keys, layer.values)))
    r["warmup_decode_s"], seq = _decode(model, cache, ids, args.new_tokens, device)
    if name == "default":
        cache.crop(-(cache.get_seq_length() - args.context))  # back to the context
        seq = ids
    rounds, round_s = (len(cache.rounds), timer.total_seconds()) if timer else (0, 0.0)
    r["decode_s"], _ = _decode(model, cache, seq, args.new_tokens, device)
    r["tokens_per_s"] = args.batch * args.new_tokens / r["decode_s"]
    if timer:
        r["decode_rounds"], r["decode_round_s"] = len(cache.rounds) - rounds, timer.total_seconds() - round_s
        r["capacity_tokens"] = cache.pools[0].shape[3]
    if device.type == "cuda" and name != "kvops-static":  # a compiled step is timed by the decode alone
        r["step_host_ms"], r["step_gpu_ms"] = _step(model, cache, args.batch, device)
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
    free_bytes = torch.cuda.mem_get_info()[0] if device.type == "cuda" else None
    ids = torch.randint(1, fields["vocab_size"], (args.batch, args.context + 1), device=device)
    per_token = fields["num_hidden_layers"] * 2 * fields["num_key_value_heads"] * fields["head_dim"] * 2
    out = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", tiny=args.tiny,
               batch=args.batch, context=args.context, prompt=args.prompt, new_tokens=args.new_tokens,
               budget=args.budget, beta=args.beta, mode=args.mode)
    attention = model.config._attn_implementation
    for name in args.caches:
        # a static cache's decode runs under a mask: grouped_sdpa reads its K/V without repeating them
        model.config._attn_implementation = GROUPED_SDPA if name == "kvops-static" else attention
        out[name] = _measure(name, model, calibration, ids, args, device)
        print(f"{name}: {json.dumps(out[name])}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if free_bytes is not None:  # the largest batch whose KV fits the memory left after the model (estimate)
        out["max_batch_default"] = free_bytes // (args.max_context * per_token)
        out["max_batch_kvops"] = free_bytes // ((args.prompt + args.budget + args.beta + 1) * per_token)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny random Qwen3 (mechanics only)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--context", type=int, help="tokens each request holds before the timed decode")
    ap.add_argument("--prompt", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--budget", type=int)
    ap.add_argument("--beta", type=int)
    ap.add_argument("--mode", default="union", choices=["union", "per_head", "per_layer_perhead"])
    ap.add_argument("--caches", default=",".join(CACHES),
                    help=f"comma-separated, from {CACHES} (kvops-static: static shapes, generate compiles the step)")
    ap.add_argument("--max-context", type=int, default=32768, help="context for the largest-batch estimate")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    args.caches = args.caches.split(",")
    if not set(args.caches) <= set(CACHES):
        ap.error(f"--caches: choose from {CACHES}")
    defaults = dict(batch=2, context=160, prompt=16, new_tokens=12, budget=48, beta=8) if args.tiny else \
        dict(batch=32, context=16384, prompt=1024, new_tokens=256, budget=2048, beta=128)
    for name, value in defaults.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    if not args.tiny and not torch.cuda.is_available():
        print("benchmarks.e2e needs a CUDA GPU (or --tiny for the CPU mechanics)", file=sys.stderr)
        return 2
    out = run(args)
    if args.tiny:
        print("tiny random model on the CPU: these numbers show the mechanics run, not kvops' speed")
    base = out.get("default", {}).get("tokens_per_s")
    print(f"decode {args.batch} x {args.new_tokens} tokens after {args.context} ({out['device']}), tokens/s:")
    for name in args.caches:
        r = out[name]
        line = f"  {name:13s} {r['tokens_per_s']:9.1f}"
        if base:
            line += f" = {r['tokens_per_s'] / base:.2f}x default"
        if "decode_rounds" in r:
            line += f"; {r['decode_rounds']} rounds took {r['decode_round_s'] * 1e3:.1f} ms of " \
                    f"{r['decode_s'] * 1e3:.0f}"
        if "step_gpu_ms" in r:
            line += f"; one eager step: host {r['step_host_ms']:.1f} ms, GPU {r['step_gpu_ms']:.1f} ms"
        print(line + f"; KV held {r['kv_bytes'] / 2**20:.1f} MiB")
    if "max_batch_default" in out:
        print(f"largest batch at {args.max_context} tokens, from KV bytes alone: default {out['max_batch_default']}, "
              f"kvops {out['max_batch_kvops']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
