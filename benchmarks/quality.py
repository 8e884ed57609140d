"""Quality of KV eviction on a real model: next-token agreement with the full cache and loss, teacher-forced.

    python -m benchmarks.quality --model DIR --text FILE [--budgets 64,128,256] [--beta 16] [--window 1024]
        [--windows 4] [--cache-windows 1] [--csv out.csv] [--plot out.png]

Each method is simulated exactly with one attention mask per query row: in decoding with eviction, the token at
position t attends to what the cache holds at t (the prompt, the kept tokens, the tokens since the last round),
and its own keys and values come from that same restricted context, so a forward pass whose row t is masked to
that set computes what decoding with that cache computes, token for token. TriAttention's keep sets come from
kvops' ``TriAttentionSelector`` on the keys the model computed under the masks of the rows before each round
(one prefix forward per round), with the calibration measured by ``kvops calibrate`` on the text's first tokens
(a separate part from the evaluation windows) unless ``--calibration`` names one. Rounds follow the manager: every
``beta`` tokens once the decode tokens exceed ``budget``.

Methods: ``full``; ``triattention`` in ``union``, ``per_head`` and ``per_layer_perhead`` modes (a mask per layer
reaches each layer's attention through a forward pre-hook); ``recent`` (the last budget tokens), ``sinks`` (4 sink
tokens + the last budget - 4) and ``random`` (budget random decode tokens, redrawn each round). Then, on the first
``--cache-windows`` windows, real caches in bf16 decode token by token (``evaluate_caches``): ``full_cache``,
``triattention_<mode>_cache`` and ``triattention_<mode>_nvfp4`` (one NVFP4 offload/onboard cycle halfway), with
decode tokens/s. Every row reports agreement, loss, perplexity and the KV each sequence holds. On a random-weight
model the numbers show only that the mechanics run (the output says so).
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import sys
import time

import torch

from kvops.calibrate import calibrate, require_transformers
from kvops.integrations.transformers import TriAttentionCache, cache_keyword
from kvops.triattention import TriAttentionSelector, load_calibration

from .common import pyplot

SINKS = 4
METHODS = ("full", "triattention_union", "triattention_per_head", "triattention_per_layer_perhead", "recent", "sinks",
           "random")


def _forward(model, ids: torch.Tensor, allowed: torch.Tensor, want_keys: bool):
    """Logits [n, vocab] (and the per-layer keys [Hkv, n, D] as cached, post-RoPE) with query row t of layer l and
    head h restricted to allowed[l, h, t, :] (a bool [1 or L, 1 or Hq, n, n] mask; one per layer goes to each
    layer's attention through a forward pre-hook, since a transformers forward takes one mask for all layers)."""
    transformers = require_transformers()
    mask = torch.zeros(allowed.shape, dtype=model.dtype, device=ids.device)
    mask.masked_fill_(~allowed, torch.finfo(model.dtype).min)
    cache = transformers.DynamicCache(config=model.config) if want_keys else None
    hooks = []
    if mask.shape[0] > 1:
        attentions = {m.layer_idx: m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")}

        def per_layer(layer):
            def hook(module, args, kwargs):
                return args, {**kwargs, "attention_mask": mask[layer][None]}
            return hook
        hooks = [attentions[layer].register_forward_pre_hook(per_layer(layer), with_kwargs=True)
                 for layer in range(mask.shape[0])]
    try:
        out = model(input_ids=ids[None], attention_mask=mask[:1], use_cache=want_keys,
                    **{cache_keyword(model): cache})
    finally:
        for hook in hooks:
            hook.remove()
    keys = [layer.keys[0] for layer in cache.layers] if want_keys else None
    return out.logits[0].float(), keys


class Simulation:
    """Keep sets of one evaluation window, round by round, as a bool mask [1 or L, 1 or Hq, n, n]."""

    def __init__(self, model, ids: torch.Tensor, prompt: int, budget: int, beta: int):
        self.model, self.ids, self.prompt, self.budget, self.beta = model, ids, prompt, budget, beta
        config = model.config
        self.L, self.Hq, self.Hkv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
        self.n = ids.numel()
        self.causal = torch.ones(self.n, self.n, dtype=torch.bool, device=ids.device).tril()

    def rounds(self):
        """The times t at which a round runs, before query t: once the decode tokens held exceed the budget and
        beta arrived since the last round."""
        t, held, since = self.prompt, 0, 0
        while t < self.n:
            if held > self.budget and since >= self.beta:
                yield t
                held, since = self.budget, 0
            held, since, t = held + 1, since + 1, t + 1

    def run(self, method: str, selector: TriAttentionSelector | None = None, seed: int = 0) -> torch.Tensor:
        layers = self.L if method == "triattention_per_layer_perhead" else 1
        heads = self.Hq if method in ("triattention_per_head", "triattention_per_layer_perhead") else 1
        allowed = self.causal.expand(layers, heads, -1, -1).clone()
        if method == "full":
            return allowed
        gen = torch.Generator().manual_seed(seed)
        device = self.ids.device
        kept = [[torch.arange(self.prompt, self.prompt, device=device)] * heads] * layers  # decode tokens kept
        last = self.prompt
        for t in self.rounds():
            new = torch.arange(last, t, device=device)
            held = [[torch.cat([k, new]) for k in row] for row in kept]
            if method.startswith("triattention"):
                kept = self._select(allowed, t, held, selector)
            elif method in ("recent", "sinks"):
                keep = self.budget - (SINKS if method == "sinks" else 0)
                kept = [[h[-keep:] for h in row] for row in held]
            else:  # random
                kept = [[h[torch.randperm(h.numel(), generator=gen)[:self.budget].sort().values.to(device)]
                         for h in row] for row in held]
            visible = torch.zeros(layers, heads, self.n, dtype=torch.bool, device=device)
            visible[..., :self.prompt] = True
            if method == "sinks":
                visible[..., self.prompt:self.prompt + SINKS] = True
            for layer in range(layers):
                for h in range(heads):
                    visible[layer, h, kept[layer][h]] = True
            visible[..., t:] = True                                          # tokens from this round on
            allowed[:, :, t:, :] = self.causal[t:] & visible[:, :, None, :]  # rows to the end; later rounds narrow
            last = t
        return allowed

    def _select(self, allowed: torch.Tensor, t: int, held: list, selector) -> list:
        """kvops' keep sets at round t, from the keys the model computed under the rows before t: held[l][h] are
        the decode tokens (layer l, query head h) holds, all of one count; a KV head's query heads share its set."""
        _, keys = _forward(self.model, self.ids[:t], allowed[:, :, :t, :t], want_keys=True)
        G = self.Hq // self.Hkv
        n = self.prompt + held[0][0].numel()
        prompt = torch.arange(self.prompt, device=self.ids.device)
        pools = []  # physical pools [page 0, plane, kv head, slot, dim]: the prompt, then the held tokens in order
        for layer, k in enumerate(keys):
            row = held[min(layer, len(held) - 1)]
            pool = torch.zeros(1, 2, self.Hkv, n, k.shape[-1], dtype=torch.bfloat16, device=k.device)
            for g in range(self.Hkv):
                pool[0, 0, g] = k[g, torch.cat([prompt, row[min(g * G, len(row) - 1)]])]
            pools.append(pool)
        i32 = lambda v: torch.tensor([v], dtype=torch.int32, device=self.ids.device)  # noqa: E731
        picked = selector.select(pools, i32(0)[None], i32(n), i32(self.prompt), i32(t).long())[0].long() - self.prompt
        # picked rows: 1 (union), Hkv (per_head) or L * Hkv (per_layer_perhead, row l * Hkv + g)
        rows = picked.shape[0]
        return [[held[layer][h][picked[0 if rows == 1 else (layer * self.Hkv if rows > self.Hkv else 0) + h // G]]
                 for h in range(len(held[layer]))] for layer in range(len(held))]


def _token_bytes(model) -> int:
    """K and V bytes of one token across the layers, held in bf16 (what the kvops pools hold)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * torch.bfloat16.itemsize


def _full_logits(model, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each window's logits under the full cache (causal attention over everything): the reference of every row."""
    fulls = []
    with torch.no_grad():
        for ids in windows:
            causal = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool, device=ids.device).tril()
            fulls.append(_forward(model, ids, causal[None, None], want_keys=False)[0])
    return fulls


def evaluate(model, windows: list[torch.Tensor], calibration, budgets, beta: int, prompt: int,
             methods=METHODS, log=print) -> list[dict]:
    """One row per (method, budget): next-token agreement with the full cache and mean loss over the positions
    after each window's first round at that budget (the full cache's row at each budget covers the same positions),
    and the most KV tokens (and MiB in bf16) a sequence's cache holds."""
    rows, fulls = [], _full_logits(model, windows)
    for budget in budgets:
        for method in methods:
            selector = None
            if method.startswith("triattention"):
                selector = TriAttentionSelector(calibration, budget, method.split("_", 1)[1])
            agree = loss = count = 0
            held = 0
            for w, (ids, full) in enumerate(zip(windows, fulls)):
                sim = Simulation(model, ids, prompt, budget, beta)
                first = next(sim.rounds(), sim.n)
                with torch.no_grad():
                    logits, _ = _forward(model, ids, sim.run(method, selector, seed=w), want_keys=False)
                span = slice(first, sim.n - 1)
                agree += int((logits[span].argmax(-1) == full[span].argmax(-1)).sum())
                loss += float(torch.nn.functional.cross_entropy(logits[span], ids[first + 1:], reduction="sum"))
                count += sim.n - 1 - first
                held = sim.n if method == "full" else prompt + budget + beta
            rows.append(_row(model, method, budget, beta, agree, loss, count, held, log))
    return rows


def _row(model, method, budget, beta, agree, loss, count, held, log, tokens_per_s=None) -> dict:
    row = {"method": method, "budget": budget, "beta": beta, "agreement": agree / max(count, 1),
           "loss": loss / max(count, 1), "perplexity": math.exp(loss / max(count, 1)), "positions": count,
           "kv_tokens_max": held, "kv_mib_bf16": held * _token_bytes(model) / 2**20, "tokens_per_s": tokens_per_s}
    speed = f", {tokens_per_s:.0f} tokens/s" if tokens_per_s else ""
    log(f"  {method:>30} budget {budget:>5}: agreement {row['agreement']:.3f}, loss {row['loss']:.3f} over "
        f"{count} positions{speed}")
    return row


CACHE_MODES = ("union", "per_head", "per_layer_perhead")


def _decode(model, cache, ids: torch.Tensor, prompt: int, cycle_at: int | None = None):
    """Teacher-forced decoding through a real cache, as generate() runs it: the prompt in one forward, then one
    token per forward. Returns the logits predicting positions prompt .. n-1 and the decode's seconds; at query
    `cycle_at` the cache's row first goes to the NVFP4 host tier and back (``offload``, ``onboard``)."""
    key, n = cache_keyword(model), ids.numel()
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.no_grad():
        logits = [model(input_ids=ids[None, :prompt], logits_to_keep=1, **{key: cache}).logits[0, -1]]
        sync()
        start = time.perf_counter()
        for t in range(prompt, n - 1):
            if t == cycle_at:
                cache.offload(0)
                cache.onboard(0)
            logits.append(model(input_ids=ids[None, t:t + 1], logits_to_keep=1, **{key: cache}).logits[0, -1])
        sync()
    return torch.stack(logits).float(), time.perf_counter() - start


def evaluate_caches(model, windows: list[torch.Tensor], calibration, budgets, beta: int, prompt: int,
                    modes=CACHE_MODES, log=print) -> list[dict]:
    """The same measures through real caches in bf16, decoding token by token: ``full_cache`` (transformers'
    DynamicCache), ``triattention_<mode>_cache`` (kvops' TriAttentionCache) and ``triattention_<mode>_nvfp4`` (the
    same cache with one NVFP4 offload/onboard cycle halfway through the window), each against the float32 full
    cache's predictions, with the decode's tokens/s (batch 1)."""
    transformers = require_transformers()
    half = copy.deepcopy(model).to(torch.bfloat16)
    rows, fulls = [], _full_logits(model, windows)
    for budget in budgets:
        methods = [("full_cache", None, False)] + [(f"triattention_{m}_{kind}", m, kind == "nvfp4")
                                                    for m in modes for kind in ("cache", "nvfp4")]
        for method, mode, cycle in methods:
            agree = loss = count = positions = 0
            seconds = 0.0
            for ids, full in zip(windows, fulls):
                sim = Simulation(model, ids, prompt, budget, beta)
                first = next(sim.rounds(), sim.n)
                cache = transformers.DynamicCache(config=half.config) if mode is None else TriAttentionCache(
                    half.config, calibration, budget=budget, beta=beta, mode=mode)
                logits, s = _decode(half, cache, ids, prompt, max(first, (prompt + sim.n) // 2) if cycle else None)
                seconds, positions = seconds + s, positions + sim.n - 1 - prompt
                span = slice(first - prompt + 1, None)  # logits[i] predicts position prompt + i
                agree += int((logits[span].argmax(-1) == full[first:sim.n - 1].argmax(-1)).sum())
                loss += float(torch.nn.functional.cross_entropy(logits[span], ids[first + 1:], reduction="sum"))
                count += sim.n - 1 - first
            held = sim.n if mode is None else prompt + budget + beta
            rows.append(_row(model, method, budget, beta, agree, loss, count, held, log, positions / seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local Hugging Face model directory")
    ap.add_argument("--text", required=True, help="UTF-8 text: calibration part first, evaluation windows after")
    ap.add_argument("--calibration", help="a calibration file or shipped name (default: calibrate on the text)")
    ap.add_argument("--calibration-tokens", type=int, default=65536)
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--beta", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of each window (never evicted)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per evaluation window")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--cache-windows", type=int, default=1,
                    help="windows also decoded token by token through real caches in bf16 (full, TriAttention, "
                         "TriAttention after an NVFP4 offload/onboard cycle), with tokens/s; 0: none")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--csv")
    ap.add_argument("--plot")
    a = ap.parse_args(argv)
    methods = a.methods.split(",")
    if set(methods) - set(METHODS):
        ap.error(f"--methods: unknown {sorted(set(methods) - set(METHODS))}; choose from {METHODS}")
    budgets = [int(b) for b in a.budgets.split(",")]
    transformers = require_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True, dtype=torch.float32,
                                                              attn_implementation="eager").to(a.device).eval()
    with open(a.text, encoding="utf-8") as f:
        ids = torch.tensor(tokenizer(f.read())["input_ids"], dtype=torch.int64)
    config = model.config.to_dict()
    if a.calibration:
        calibration = load_calibration(a.calibration, config)
        evaluation = ids
    else:
        split = min(a.calibration_tokens, ids.numel() // 2)
        calibration = load_calibration(calibrate(model, ids[:split].to(a.device)), config)
        evaluation = ids[split:]
    windows = [evaluation[i * a.window:(i + 1) * a.window].to(a.device) for i in range(a.windows)]
    windows = [w for w in windows if w.numel() == a.window]
    if not windows:
        ap.error(f"--text holds fewer than {a.window} evaluation tokens")
    trained = os.path.isfile(os.path.join(a.model, "model.safetensors")) or os.path.isfile(
        os.path.join(a.model, "pytorch_model.bin"))
    print(f"benchmarks.quality: {a.model}, {len(windows)} windows of {a.window} tokens, prompt {a.prompt}, "
          f"beta {a.beta}" + ("" if trained else " (random weights: mechanics only)"))
    rows = evaluate(model, windows, calibration, budgets, a.beta, a.prompt, methods)
    if a.cache_windows > 0:
        rows += evaluate_caches(model, windows[:a.cache_windows], calibration, budgets, a.beta, a.prompt)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if a.plot and (plt := pyplot()) is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = [(r["budget"], r["loss"]) for r in rows if r["method"] == method]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (decode tokens kept)")
        ax.set_ylabel("teacher-forced loss (nats/token)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
