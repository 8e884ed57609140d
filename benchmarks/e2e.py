"""End-to-end decode speed of transformers ``generate()`` with kvops' TriAttention cache against the default cache.

    python -m benchmarks.e2e [--batch 32] [--context 16384] [--prompt 1024] [--new-tokens 256] [--budget 2048]
        [--beta 128] [--mode union] [--json FILE]
    python -m benchmarks.e2e --tiny        (CPU, a tiny random Qwen3: the mechanics only, said so in the output)

The model is Qwen3-8B built from its config with random bf16 weights (speed does not need trained weights) and
the shipped Qwen3-8B calibration. Each request holds `context` tokens before the timed decode: a `prompt` (never
evicted) and `context - prompt` tokens taken as generated, fed `beta` at a time, so the kvops cache runs its rounds
on them as it would have while generating them, and holds at most prompt + budget + beta. The default cache
(``DynamicCache``) holds all of them. Then ``generate()`` decodes `new_tokens` greedy tokens per request, timed; the
rounds inside it are timed apart (CUDA events around each). Both run eagerly: the kvops cache does not yet give
transformers the static shapes ``torch.compile`` of the decode step needs. Memory: the KV bytes each holds, and
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
from kvops.integrations.transformers import TriAttentionCache, cache_keyword, kv_bytes
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

        def timed():
            if cache.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                compress()
                end.record()
                self.events.append((start, end))
            else:
                t = time.perf_counter()
                compress()
                self.seconds += time.perf_counter() - t

        cache._compress = timed

    def total_seconds(self) -> float:
        if self.events:
            torch.cuda.synchronize()
        return self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1e3


def _decode(model, cache, ids: torch.Tensor, new_tokens: int, device: torch.device) -> float:
    """Seconds for generate() to decode `new_tokens` tokens per row after `ids[:, :-1]` are cached."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       **{cache_keyword(model): cache})
    sync()
    return time.perf_counter() - start


def run(args) -> dict:
    transformers = require_transformers()
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

    default = transformers.DynamicCache(config=model.config)
    _fill(model, default, ids[:, :-1], args.prompt, 2048)
    out["default_kv_bytes"] = sum(t.numel() * t.element_size() for layer in default.layers
                                  for t in (layer.keys, layer.values))
    out["default_decode_s"] = _decode(model, default, ids, args.new_tokens, device)
    del default
    if device.type == "cuda":
        torch.cuda.empty_cache()

    cache = TriAttentionCache(model.config, calibration, budget=args.budget, beta=args.beta, mode=args.mode)
    timer = _RoundTimer(cache)
    _fill(model, cache, ids[:, :-1], args.prompt, args.beta)
    fill_rounds, fill_round_s = len(cache.rounds), timer.total_seconds()
    out["kvops_kv_bytes"] = kv_bytes(cache)
    out["kvops_decode_s"] = _decode(model, cache, ids, args.new_tokens, device)
    out["kvops_decode_rounds"] = len(cache.rounds) - fill_rounds
    out["kvops_decode_round_s"] = timer.total_seconds() - fill_round_s
    out["kvops_capacity_tokens"] = cache.pools[0].shape[3]

    tokens = args.batch * args.new_tokens
    out["default_tokens_per_s"] = tokens / out["default_decode_s"]
    out["kvops_tokens_per_s"] = tokens / out["kvops_decode_s"]
    out["speedup"] = out["kvops_tokens_per_s"] / out["default_tokens_per_s"]
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
    ap.add_argument("--max-context", type=int, default=32768, help="context for the largest-batch estimate")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
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
    print(f"decode {args.batch} x {args.new_tokens} tokens after {args.context} ({out['device']}): default cache "
          f"{out['default_tokens_per_s']:.1f} tok/s, kvops TriAttention {out['kvops_tokens_per_s']:.1f} tok/s = "
          f"{out['speedup']:.2f}x; {out['kvops_decode_rounds']} rounds in the decode took "
          f"{out['kvops_decode_round_s'] * 1e3:.1f} ms of {out['kvops_decode_s'] * 1e3:.0f} ms")
    print(f"KV held: default {out['default_kv_bytes'] / 2**20:.2f} MiB, kvops {out['kvops_kv_bytes'] / 2**20:.2f} MiB "
          f"({out['kvops_capacity_tokens']} slots per row)")
    if "max_batch_default" in out:
        print(f"largest batch at {args.max_context} tokens, from KV bytes alone: default {out['max_batch_default']}, "
              f"kvops {out['max_batch_kvops']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
