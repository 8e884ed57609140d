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

Methods (``Policy``; by default ``METHODS``): ``full``; ``triattention`` in ``union``, ``per_head`` and
``per_layer_perhead`` modes (a mask per layer reaches each layer's attention through a forward pre-hook);
``recent`` (the last budget tokens), ``sinks`` (4 sink tokens + the last budget - 4), ``random`` (budget random
decode tokens, redrawn each round) and ``oracle`` (the ceiling: what the full cache's next queries attend to most),
each with keep-policy options (``+wW`` newest W kept, ``+sS`` sinks, ``+lA.B`` layers on recency), or
``triattention_<mode>+default``: the mode under kvops' default keep policy for each budget. Then, on the first
``--cache-windows`` windows, real caches in bf16 decode token by token (``evaluate_caches``): ``full_cache``,
``triattention_<mode>_cache`` and ``triattention_<mode>_nvfp4`` (one NVFP4 offload/onboard cycle halfway; each
mode under its default keep policy), with decode tokens/s. Every row reports agreement, loss, perplexity and the KV
each sequence holds. On a random-weight model the numbers show only that the mechanics run (the output says so).

The average hides the few tokens that need far context, so each simulated row also reports two long-range
measures: its loss and agreement on the window's ``long_range_tokens`` (those the full cache predicts and the
recent window of the budget does not: every method judged on the same tokens, the window itself wrong on all of
them), and the retrieval probe (``retrieval_probes``, from the text alone: a name last seen more than budget +
beta tokens back comes again; the share of such names each method completes, paired against the window's share).
"""

from __future__ import annotations

import argparse
import bisect
import builtins
import copy
import csv
import itertools
import keyword
import math
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kvops.calibrate import SENSITIVITY_WINDOWS, calibrate, layer_masks, require_transformers
from kvops.config import layer_split, resolve_keep_policy, split_budget
from kvops.integrations.transformers import TriAttentionCache, cache_keyword, install_layer_masks
from kvops.triattention import TriAttentionSelector, load_calibration

from .common import pyplot

SINKS = 4
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# names a model completes without looking back: the retrieval probe leaves them out
COMMON_NAMES = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls"}


@dataclass(frozen=True)
class Policy:
    """A method: which decode tokens each round keeps, written ``kind[_mode][+wW][+sS][+lA.B][+pP][+fF]``.

    kind: ``full``, ``recent`` (the newest), ``random``, ``triattention`` (kvops' selector; ``_union``,
    ``_per_head`` or ``_per_layer_perhead``) or ``oracle`` (cheating: per (layer, KV head), the keys the next
    beta queries of the full cache attend to most). ``+wW``: the newest W decode tokens always stay; ``+sS``: the
    first S decode tokens always stay; ``+lA.B``: layers A and B keep their newest tokens instead of the method's
    choice; ``+pP``: kvops' scores lean to recent tokens by the recency prior P. W and S count inside the budget. ``sinks`` is ``recent+s4``. ``triattention_<mode>+default`` is what
    kvops does by default in that mode: the keep policy ``kvops.config.resolve_keep_policy`` gives for each
    budget. ``+fF`` splits the same total unevenly (in a cache: ``layer_split=LayerSplit(...)`` by hand): each
    layer on recency keeps its newest F x budget tokens and the other layers share the rest equally, under the
    policy their share gives (``+default`` resolves it for that share). ``+split`` takes the layers on recency
    and their share from the calibration's layer sensitivity (``kvops.config.layer_split``) instead."""

    kind: str
    mode: str = ""
    recent: int = 0
    sinks: int = 0
    recent_layers: tuple[int, ...] = ()
    default: bool = False
    share: float = 1.0
    prior: float = 0.0
    split: bool = False

    @classmethod
    def parse(cls, text: str) -> "Policy":
        if text == "sinks":
            return cls("recent", sinks=SINKS)
        head, *options = text.split("+")
        kind, _, mode = head.partition("_")
        if kind not in ("full", "recent", "random", "triattention", "oracle") or \
                mode not in (("union", "per_head", "per_layer_perhead") if kind == "triattention" else ("",)):
            raise ValueError(f"unknown method {text!r}")
        fields = {}
        for option in options:
            key, value = option[:1], option[1:]
            if option == "default" and kind == "triattention" and \
                    all(o in ("default", "split") or o.startswith("f") for o in options):
                fields["default"] = True
            elif option == "split" and kind != "full" and not any(o.startswith(("f", "l")) for o in options):
                fields["split"] = True
            elif key == "f" and value.replace(".", "", 1).isdigit() and 0 < float(value):
                fields["share"] = float(value)
            elif key == "l":
                fields["recent_layers"] = tuple(int(v) for v in value.split("."))
            elif key == "p" and kind == "triattention" and value.replace(".", "", 1).isdigit():
                fields["prior"] = float(value)
            elif key in "ws" and value.isdigit():
                fields["recent" if key == "w" else "sinks"] = int(value)
            else:
                raise ValueError(f"method {text!r}: unknown option {option!r}")
        return cls(kind, mode, **fields)

    @property
    def name(self) -> str:
        if self == Policy("recent", sinks=SINKS):
            return "sinks"
        name = self.kind + (f"_{self.mode}" if self.mode else "")
        share = f"+f{self.share:g}" if self.share != 1.0 else "+split" if self.split else ""
        if self.default:
            return name + "+default" + share
        name += f"+w{self.recent}" if self.recent else ""
        name += f"+s{self.sinks}" if self.sinks else ""
        name += f"+l{'.'.join(map(str, self.recent_layers))}" if self.recent_layers else ""
        return name + (f"+p{self.prior:g}" if self.prior else "") + share


METHODS = ("full", "triattention_per_head+default", "triattention_per_head+default+split", "triattention_union+default",
           "triattention_per_layer_perhead+default", "triattention_union", "triattention_per_head",
           "triattention_per_layer_perhead", "recent", "sinks", "random", "oracle+l0")
# --quick: fewer windows and calibration tokens, no token-by-token decoding through real caches
QUICK = dict(calibration_tokens=8192, sensitivity_windows=2, windows=2, window=1024, budgets="128,256",
             cache_windows=0)
# --quick's methods unless --methods is given: each mode as a user gets it, against the baselines and the ceiling
QUICK_METHODS = tuple(m for m in METHODS if "_" not in m or m.endswith("+default") or m.startswith("oracle"))


def rounds(n: int, prompt: int, budget: int, beta: int):
    """The times t at which a round runs, before query t: once the decode tokens held exceed the budget and beta
    arrived since the last round (the manager's rule)."""
    t, held, since = prompt, 0, 0
    while t < n:
        if held > budget and since >= beta:
            yield t
            held, since = budget, 0
        held, since, t = held + 1, since + 1, t + 1


def _chunk(model, ids: torch.Tensor, allowed: torch.Tensor, cache) -> torch.Tensor:
    """Logits of the rows ``ids`` (the tokens after those `cache` holds), row i restricted to allowed[l, h, i]
    (bool [1 or L, Hq, q, kv]; one mask per layer reaches each layer's attention through ``layer_masks``)."""
    mask = torch.zeros(allowed[:1].shape, dtype=model.dtype, device=ids.device)
    mask.masked_fill_(~allowed[:1], torch.finfo(model.dtype).min)
    per_layer = {layer: allowed[layer][None] for layer in range(allowed.shape[0])} if allowed.shape[0] > 1 else {}
    with layer_masks(model, per_layer):
        return model(input_ids=ids[None], attention_mask=mask, use_cache=True,
                     **{cache_keyword(model): cache}).logits[0].float()


def full_attention(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full cache's logits [n, vocab] and attention probabilities [L, Hq, n, n] (the oracle's knowledge)."""
    out = model(input_ids=ids[None], output_attentions=True)
    return out.logits[0].float(), torch.stack([a[0] for a in out.attentions])


def simulate(model, ids: torch.Tensor, prompt: int, budget: int, beta: int, policy: Policy, calibration=None,
             attention: torch.Tensor | None = None, seed: int = 0, record: list | None = None) -> torch.Tensor:
    """Logits [n, vocab] of teacher-forced decoding with `policy`'s evictions, exactly: the tokens between two
    rounds go through the model as one chunk over a cache that keeps every key, each query row masked to what
    the evicting cache would hold at its time (the prompt, the kept tokens, the tokens since the round). A key is
    computed once, under the masks of its own time, as in decoding. TriAttention's keep sets come from kvops'
    ``TriAttentionSelector`` on those keys, laid out as the evicting cache holds them. Under a per-layer split
    (``+fF``, ``+split``) each group of layers runs its rounds when it holds more than its own count. `record` (a
    list) gets (t, held) after each round at t: held bool [1 or L, Hkv, t], the positions each (layer, KV head)
    holds."""
    transformers = require_transformers()
    config = model.config
    L, Hq, Hkv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    G, n, device = Hq // Hkv, ids.numel(), ids.device
    held_by_recent = None  # +fF, +split: what each layer on recency keeps; the others' budget is what is left
    split = None
    if policy.split:
        if calibration is None or calibration.layer_sensitivity is None:
            raise ValueError(f"{policy.name}: needs a calibration with a layer sensitivity (kvops calibrate)")
        split = layer_split(calibration.layer_sensitivity, budget)
        if split.local_layers:
            held_by_recent, budget = split.local_budget, split.budget
    elif policy.share != 1.0:
        layers = policy.recent_layers or (resolve_keep_policy("simulate", policy.mode, budget, beta, L).recent_layers
                                          if policy.default else ())
        if not layers or len(layers) == L:
            raise ValueError(f"{policy.name}: a per-layer split needs some layers on recency and some scored")
        _, held_by_recent, budget = split_budget(layers, budget, L, policy.share)
    if policy.default:
        sinks, recent, layers, prior = resolve_keep_policy("simulate", policy.mode, budget, beta, L)
        policy = Policy(policy.kind, policy.mode, recent, sinks, layers, share=policy.share, prior=prior)
    if split is not None and split.local_layers:  # the split's layers on recency, in place of the default's
        policy = replace(policy, recent_layers=split.local_layers)
    if policy.sinks + policy.recent >= budget:
        raise ValueError(f"{policy.name}: sinks + recent must stay below the budget {budget}")
    k = budget - policy.sinks - policy.recent  # what the method chooses each round
    per_layer = policy.kind == "oracle" or policy.mode == "per_layer_perhead" or bool(policy.recent_layers)
    visible = torch.ones(L if per_layer else 1, Hkv, n, dtype=torch.bool, device=device)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    cache = transformers.DynamicCache(config=config)
    gen = torch.Generator().manual_seed(seed)
    selector = None
    if policy.kind == "triattention":
        scored = [layer for layer in range(L) if layer not in policy.recent_layers]
        selector = TriAttentionSelector(calibration.for_layers(scored) if policy.recent_layers else calibration, k,
                                        policy.mode, recency_prior=policy.prior)
    logits, start = [], 0
    # Layers that keep another count (+fF, +split) run their own rounds, when they hold more than theirs: a cache
    # with a length per layer group holds no more than that in them.
    scored_times = set(rounds(n, prompt, budget, beta))
    local_times = set(rounds(n, prompt, held_by_recent, beta)) if held_by_recent is not None else set()
    local_layers = set(policy.recent_layers) if held_by_recent is not None else set()
    for t in [*sorted(scored_times | local_times), n]:
        if start < t:
            allowed = causal[start:t, :t] & visible[:, :, None, :t]
            logits.append(_chunk(model, ids[start:t], allowed.repeat_interleave(G, 1), cache))
        if policy.kind == "full" or t == n:
            start = t
            continue
        held = [[visible[layer, h, prompt:t].nonzero().flatten() + prompt for h in range(Hkv)]
                for layer in range(visible.shape[0])]
        fixed = [[torch.cat((row[:policy.sinks], row[row.numel() - policy.recent:])) for row in rows]
                 for rows in held]
        candidates = [[row[policy.sinks:row.numel() - policy.recent] for row in rows] for rows in held]
        if t not in scored_times:
            chosen = None
        elif policy.kind == "triattention":
            chosen = _triattention(selector, cache, candidates, prompt, policy.recent_layers)
        else:  # not for layers that keep another count: they hold fewer candidates
            chosen = [None if layer in local_layers else
                      [_choose(policy, c, k, layer, h, t, beta, attention, gen, G) for h, c in enumerate(rows)]
                      for layer, rows in enumerate(candidates)]
        for layer in range(visible.shape[0]):
            local = layer in local_layers
            if t not in (local_times if local else scored_times):
                continue
            for h in range(Hkv):
                if local:
                    kept = held[layer][h][-held_by_recent:]
                else:
                    keep = candidates[layer][h][-k:] if layer in policy.recent_layers else chosen[layer][h]
                    kept = torch.cat((fixed[layer][h], keep))
                visible[layer, h, prompt:t] = False
                visible[layer, h, kept] = True
        if record is not None:
            record.append((t, visible[..., :t].clone()))
        start = t
    return torch.cat(logits)


def _choose(policy: Policy, candidates: torch.Tensor, k: int, layer: int, h: int, t: int, beta: int,
            attention: torch.Tensor | None, gen: torch.Generator, group: int) -> torch.Tensor:
    """k of the candidates of (layer, KV head h) by a method that is not kvops' (recent, random, oracle)."""
    if policy.kind == "recent":
        return candidates[-k:]
    if policy.kind == "random":
        return candidates[torch.randperm(candidates.numel(), generator=gen)[:k].sort().values.to(candidates.device)]
    # oracle: the attention the full cache's next beta queries of the KV head's query heads pay each candidate
    weights = attention[layer, h * group:(h + 1) * group, t:t + beta][..., candidates].sum(1).amax(0)
    return candidates[weights.topk(k).indices.sort().values]


def _triattention(selector: TriAttentionSelector, cache, candidates: list, prompt: int,
                  recent_layers: tuple[int, ...]) -> list:
    """kvops' keep sets among the candidates: the scored layers' keys laid out as the evicting cache holds them
    (the prompt, the sinks, then the candidates in order; the protected newest tokens are its tail, unscored)."""
    Hkv = len(candidates[0])
    scored = [layer for layer in range(len(cache.layers)) if layer not in recent_layers]
    pools = []
    for layer in scored:
        keys = cache.layers[layer].keys[0]                        # [Hkv, t, D], post-RoPE
        rows = candidates[min(layer, len(candidates) - 1)]
        count = rows[0].numel()
        pool = torch.zeros(1, 1, Hkv, prompt + count, keys.shape[-1], dtype=torch.bfloat16, device=keys.device)
        for h in range(Hkv):
            pool[0, 0, h, :prompt] = keys[h, :prompt]
            pool[0, 0, h, prompt:] = keys[h, rows[h]]
        pools.append(pool)
    i32 = lambda v: torch.tensor([v], dtype=torch.int32, device=pools[0].device)  # noqa: E731
    n = pools[0].shape[3]
    start = cache.get_seq_length()
    positions = None
    if selector.recency_prior:  # each selector row's candidates' logical positions (the rows as picked below)
        of = [candidates[min(layer, len(candidates) - 1)] for layer in scored]  # rows: 1 or L of them
        per_row = of[0][:1] if selector.mode == "union" else of[0] if selector.mode == "per_head" else \
            [row for rows in of for row in rows]
        positions = torch.zeros(1, len(per_row), n, dtype=torch.int32, device=pools[0].device)
        positions[0, :, :count] = torch.stack(per_row).int()
    picked = (selector.select(pools, i32(0)[None], i32(n), i32(prompt), i32(start).long(), positions=positions)[0]
              .long() - prompt)
    # picked rows: 1 (union), Hkv (per_head) or len(scored) * Hkv (per_layer_perhead, row index(l) * Hkv + g)
    out = []
    for layer, rows in enumerate(candidates):
        if layer in recent_layers:  # it keeps its newest instead (and may hold another count: +fF)
            out.append(None)
        elif picked.shape[0] == 1:
            out.append([rows[h][picked[0]] for h in range(Hkv)])
        elif picked.shape[0] == Hkv:
            out.append([rows[h][picked[h]] for h in range(Hkv)])
        else:
            out.append([rows[h][picked[scored.index(layer) * Hkv + h]] for h in range(Hkv)])
    return out


T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
         12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 20: 2.09, 25: 2.06, 30: 2.04}


def ci95(values: list[float]) -> tuple[float, float]:
    """The mean of per-window values and the half-width of its 95% confidence interval (Student's t)."""
    m = len(values)
    mean = sum(values) / m
    if m < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (m - 1))
    t = T_975[max(d for d in T_975 if d <= m - 1)] if m - 1 <= 30 else 1.96  # (a smaller df: wider, safe)
    return mean, t * sd / math.sqrt(m)


def _bar(progress: bool, total: int, desc: str):
    """A progress bar on stderr with its estimate of what is left (tqdm, which transformers brings), or None."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)


def retrieval_probes(tokenizer, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The retrieval probe of a window, from its text alone: each place where a name used earlier in the window
    comes back (a Python identifier of two or more tokens, not a keyword or builtin), as int64 [m, 3]: the
    positions of the name's second and last tokens (what completing the name takes, given its first) and the
    tokens since the name's previous occurrence ended (its gap). Occurrences inside the prompt count as earlier
    ones but are not probed, and a name whose previous occurrence lies in the prompt is not probed (every cache
    holds the prompt)."""
    pieces = [tokenizer.decode([i]) for i in ids.tolist()]
    starts = list(itertools.accumulate(map(len, pieces), initial=0))  # char offset of each token, then the end
    last: dict[str, int] = {}  # name -> the token its latest occurrence ended in
    probes = []
    for match in NAME.finditer("".join(pieces)):
        name, (a, b) = match.group(), match.span()
        if name in COMMON_NAMES:
            continue
        first = bisect.bisect_right(starts, a) - 1  # the token holding the name's first character
        end = bisect.bisect_right(starts, b) - 2  # the last token wholly inside the name
        if first < end and first >= prompt and last.get(name, -1) >= prompt:
            probes.append((first + 1, end, first - last[name]))
        last[name] = end
    return torch.tensor(probes, dtype=torch.int64).reshape(-1, 3)


def long_range_tokens(full: torch.Tensor, recent: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """The long-range tokens of a window at a budget: bool [n - 1 - first] over the positions predicted from
    query rows first .. n-2, true where the full cache's logits predict the next token and the recent window's
    (at that budget) do not. Chosen from those two runs alone, so every method is judged on the same tokens; the
    recent window is wrong on all of them by construction."""
    target = ids[first + 1:]
    return (full[first:-1].argmax(-1) == target) & (recent[first:-1].argmax(-1) != target)


class Cell(NamedTuple):
    """A method's measures on one window at one budget, as sums over the positions after its first round. A real
    cache's cells (``evaluate_caches``) hold the first three only."""
    loss: float              # loss summed over the positions
    agree: int               # positions whose prediction is the full cache's
    count: int               # positions
    long_loss: float | None = None  # the same two on the long-range tokens, and their count
    long_agree: int | None = None
    long_count: int | None = None
    completed: int | None = None    # retrieval probes completed, and probes
    probes: int | None = None


def _cell(logits: torch.Tensor, full: torch.Tensor, ids: torch.Tensor, first: int, long: torch.Tensor,
          probes: torch.Tensor) -> Cell:
    """A method's ``Cell``: `long` the window's long-range tokens, `probes` the rows of ``retrieval_probes`` it is
    judged on (their tokens after `first`), each completed when every one of its tokens is predicted."""
    span, target = slice(first, ids.numel() - 1), ids[first + 1:]
    loss = torch.nn.functional.cross_entropy(logits[span], target, reduction="none")
    agree = logits[span].argmax(-1) == full[span].argmax(-1)
    wrong = torch.cat(((logits[span].argmax(-1) != target).cumsum(0), target.new_zeros(1)))
    # wrong[i]: wrong predictions of positions first + 1 .. first + 1 + i; a probe's count is a difference
    completed = wrong[probes[:, 1] - first - 1] == wrong[probes[:, 0] - first - 2]
    return Cell(float(loss.sum()), int(agree.sum()), target.numel(), float(loss[long].sum()),
                int(agree[long].sum()), int(long.sum()), int(completed.sum()), probes.shape[0])


def evaluate(model, windows: list[torch.Tensor], calibration, budgets, beta: int, prompt: int,
             methods=METHODS, log=print, progress: bool = False, tokenizer=None) -> list[dict]:
    """One row per (method, budget): loss and next-token agreement with the full cache over the positions after
    each window's first round at that budget (the full cache's row at each budget covers the same positions),
    each the mean over the windows with a 95% confidence interval, and the loss difference from the recent
    window on the same windows (paired), with its interval. Also the most KV tokens a sequence's cache holds.
    The long-range measures: the same loss and agreement on each window's ``long_range_tokens`` at that budget
    (the recent window's run decides them first, also when it is not among `methods`), and with a `tokenizer`
    the retrieval probe (``retrieval_probes`` whose name was last seen more than budget + beta tokens back):
    the share of probes each method completes, and its paired difference from the recent window's share."""
    policies = [Policy.parse(m) if isinstance(m, str) else m for m in methods]
    oracle = any(p.kind == "oracle" for p in policies)
    recent = Policy("recent")
    per = {}  # (method, budget) -> [_cell per window]
    bar = _bar(progress, len(windows) * len(budgets) * len(policies), "simulated caches (window x budget x method)")
    with torch.no_grad():
        for w, ids in enumerate(windows):
            full, attention = full_attention(model, ids) if oracle else (_full_logits(model, ids), None)
            probes = (retrieval_probes(tokenizer, ids, prompt) if tokenizer is not None else
                      torch.zeros(0, 3, dtype=torch.int64)).to(ids.device)
            for budget in budgets:
                first = next(rounds(ids.numel(), prompt, budget, beta), ids.numel())
                window_logits = simulate(model, ids, prompt, budget, beta, recent, seed=w)
                long = long_range_tokens(full, window_logits, ids, first)
                probed = probes[(probes[:, 2] > budget + beta) & (probes[:, 0] > first)]
                for policy in policies:
                    logits = full if policy.kind == "full" else window_logits if policy == recent else simulate(
                        model, ids, prompt, budget, beta, policy, calibration, attention, seed=w)
                    per.setdefault((policy.name, budget), []).append(_cell(logits, full, ids, first, long, probed))
                    if bar is not None:
                        bar.set_postfix_str(f"window {w}, budget {budget}, {policy.name}", refresh=False)
                        bar.update()
            attention = None
    if bar is not None:
        bar.close()
    rows = []
    for budget in budgets:
        base = per.get((recent.name, budget))
        for policy in policies:
            cells = per[(policy.name, budget)]
            held = windows[0].numel() if policy.kind == "full" else prompt + budget + beta
            rows.append(_row(model, policy.name, budget, beta, cells, held, log, base=base))
    return rows


def _token_bytes(model) -> int:
    """K and V bytes of one token across the layers, held in bf16 (what the kvops pools hold)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * torch.bfloat16.itemsize


def masked_logits(model, ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [n, vocab] of one forward pass over `ids`, query row t of layer l and head h restricted to
    allowed[l, h, t] (bool [1 or L, 1 or Hq, n, n])."""
    return _chunk(model, ids, allowed, require_transformers().DynamicCache(config=model.config))


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The full cache's logits [n, vocab] of one window (causal attention over everything)."""
    return masked_logits(model, ids, torch.ones(ids.numel(), ids.numel(), dtype=torch.bool,
                                                device=ids.device).tril()[None, None])


def _paired(cells: list, base: list | None, part, of) -> tuple[float, float, float, float]:
    """The mean over windows of part(cell) / of(cell) with its interval, and its paired difference from `base`'s
    (the recent window's cells on the same windows) with its interval; windows where `of` counts nothing are left
    out, and a value with no window is nan."""
    nan = float("nan")
    pairs = [(part(c) / of(c), part(b) / of(b) if base else nan) for c, b in zip(cells, base or cells) if of(c)]
    if not pairs:
        return nan, nan, nan, nan
    mean, ci = ci95([x for x, _ in pairs])
    delta, delta_ci = ci95([x - b for x, b in pairs]) if base else (nan, nan)
    return mean, ci, delta, delta_ci


def _row(model, method, budget, beta, cells, held, log, base=None, tokens_per_s=None) -> dict:
    """A table row from per-window ``Cell``s; `base`: the recent window's cells on the same windows, for the
    paired differences."""
    loss, loss_ci, delta, delta_ci = _paired(cells, base, lambda c: c.loss, lambda c: c.count)
    agreement, agreement_ci, *_ = _paired(cells, None, lambda c: c.agree, lambda c: c.count)
    row = {"method": method, "budget": budget, "beta": beta, "windows": len(cells), "loss": loss, "loss_ci95": loss_ci,
           "vs_recent": delta, "vs_recent_ci95": delta_ci, "agreement": agreement, "agreement_ci95": agreement_ci,
           "perplexity": math.exp(loss), "positions": sum(c.count for c in cells), "kv_tokens_max": held,
           "kv_mib_bf16": held * _token_bytes(model) / 2**20, "tokens_per_s": tokens_per_s}
    speed = f", {tokens_per_s:.0f} tokens/s" if tokens_per_s else ""
    versus = f", vs recent {delta:+.3f} ± {delta_ci:.3f}" if base and method != "recent" else ""
    long = ""
    if cells[0].long_count is not None:
        row["long_range_tokens"] = sum(c.long_count for c in cells)
        (row["long_range_loss"], row["long_range_loss_ci95"], row["long_range_vs_recent"],
         row["long_range_vs_recent_ci95"]) = _paired(cells, base, lambda c: c.long_loss, lambda c: c.long_count)
        row["long_range_agreement"], row["long_range_agreement_ci95"], *_ = _paired(
            cells, None, lambda c: c.long_agree, lambda c: c.long_count)
        row["probes"] = sum(c.probes for c in cells)
        (row["probe_accuracy"], row["probe_accuracy_ci95"], row["probe_vs_recent"],
         row["probe_vs_recent_ci95"]) = _paired(cells, base, lambda c: c.completed, lambda c: c.probes)
        long = (f"; long-range ({row['long_range_tokens']}): loss {row['long_range_loss']:.3f}, agreement "
                f"{row['long_range_agreement']:.3f} ± {row['long_range_agreement_ci95']:.3f}")
        if row["probes"]:
            long += (f"; probes ({row['probes']}): {row['probe_accuracy']:.3f}"
                     + (f", vs recent {row['probe_vs_recent']:+.3f} ± {row['probe_vs_recent_ci95']:.3f}"
                        if base and method != "recent" else ""))
    log(f"  {method:>36} budget {budget:>5}: loss {loss:.3f} ± {loss_ci:.3f}{versus}, agreement {agreement:.3f}"
        f"{speed}{long}")
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
                    modes=CACHE_MODES, log=print, progress: bool = False, **options) -> list[dict]:
    """The same measures through real caches in bf16, decoding token by token: ``full_cache`` (transformers'
    DynamicCache), ``triattention_<mode>_cache`` (kvops' TriAttentionCache, with `options`: its policy
    keywords; the mode's default keep policy without them), ``triattention_<mode>_nvfp4`` (the same cache with one
    NVFP4 offload/onboard cycle halfway through the window) and, on a calibration with a layer sensitivity,
    ``triattention_<mode>_split`` (the cache with ``layer_split=True``), each against the float32 full cache's
    predictions, with the decode's tokens/s (batch 1)."""
    transformers = require_transformers()
    half = install_layer_masks(copy.deepcopy(model).to(torch.bfloat16))
    with torch.no_grad():
        fulls = [_full_logits(model, ids) for ids in windows]
    kinds = ("cache", "nvfp4", "split") if calibration.layer_sensitivity is not None else ("cache", "nvfp4")
    rows = []
    bar = _bar(progress, len(budgets) * (1 + len(modes) * len(kinds)) * len(windows),
               "real caches decoding (budget x method x window)")
    for budget in budgets:
        methods = [("full_cache", None, "")] + [(f"triattention_{m}_{kind}", m, kind) for m in modes for kind in kinds]
        for method, mode, kind in methods:
            cells, positions, seconds = [], 0, 0.0
            for ids, full in zip(windows, fulls):
                n = ids.numel()
                first = next(rounds(n, prompt, budget, beta), n)
                cache = transformers.DynamicCache(config=half.config) if mode is None else TriAttentionCache(
                    half.config, calibration, budget=budget, beta=beta, mode=mode, layer_split=kind == "split",
                    **options)
                cycle_at = max(first, (prompt + n) // 2) if kind == "nvfp4" else None
                logits, s = _decode(half, cache, ids, prompt, cycle_at)
                seconds, positions = seconds + s, positions + n - 1 - prompt
                span = slice(first - prompt + 1, None)  # logits[i] predicts position prompt + i
                loss = float(torch.nn.functional.cross_entropy(logits[span], ids[first + 1:], reduction="sum"))
                cells.append(Cell(loss, int((logits[span].argmax(-1) == full[first:n - 1].argmax(-1)).sum()),
                                  n - 1 - first))
                if bar is not None:
                    bar.set_postfix_str(f"budget {budget}, {method}", refresh=False)
                    bar.update()
            held = windows[0].numel() if mode is None else prompt + budget + beta
            rows.append(_row(model, method, budget, beta, cells, held, log, tokens_per_s=positions / seconds))
    if bar is not None:
        bar.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local Hugging Face model directory")
    ap.add_argument("--text", required=True, help="UTF-8 text: calibration part first, evaluation windows after")
    ap.add_argument("--calibration", help="a calibration file or shipped name (default: calibrate on the text)")
    ap.add_argument("--calibration-tokens", type=int, default=65536)
    ap.add_argument("--sensitivity-windows", type=int, default=SENSITIVITY_WINDOWS,
                    help="calibration windows the layer sensitivity is measured on, without --calibration "
                         "(default %(default)s)")
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--beta", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of each window (never evicted)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per evaluation window")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--skip-windows", type=int, default=0,
                    help="evaluation windows to pass over first (fresh windows for a result chosen on earlier ones)")
    ap.add_argument("--methods", help=f"comma-separated (default {','.join(METHODS)}; with --quick "
                                      f"{','.join(QUICK_METHODS)})")
    ap.add_argument("--cache-windows", type=int, default=1,
                    help="windows also decoded token by token through real caches in bf16 (full, TriAttention, "
                         "TriAttention after an NVFP4 offload/onboard cycle, TriAttention under its layer split), "
                         "with tokens/s; 0: none")
    ap.add_argument("--cache-modes", default=",".join(CACHE_MODES), help="the eviction modes of those caches")
    ap.add_argument("--quick", action="store_true",
                    help="about 3 minutes on two CPU cores (with --threads 1 beside another job): " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                                      for k, v in QUICK.items()))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="CPU threads (default %(default)s, torch's); 1 beside another CPU job: two jobs' thread "
                         "pools on the same cores slow each other several-fold")
    ap.add_argument("--csv")
    ap.add_argument("--plot")
    a = ap.parse_args(argv)
    if a.skip_windows < 0:
        ap.error(f"--skip-windows: a count of windows >= 0, got {a.skip_windows}")
    if a.threads < 1:
        ap.error(f"--threads: at least 1, got {a.threads}")
    if a.sensitivity_windows < 0:
        ap.error(f"--sensitivity-windows: a count of windows >= 0, got {a.sensitivity_windows}")
    torch.set_num_threads(a.threads)
    if a.quick:
        vars(a).update(QUICK)
    chosen, a.methods = bool(a.methods), a.methods or ",".join(QUICK_METHODS if a.quick else METHODS)
    try:
        methods = [Policy.parse(m) for m in a.methods.split(",")]
    except ValueError as e:
        ap.error(f"--methods: {e} ({Policy.__doc__.split(chr(10))[0]})")
    budgets = [int(b) for b in a.budgets.split(",")]
    cache_modes = a.cache_modes.split(",")
    if not set(cache_modes) <= set(CACHE_MODES):
        ap.error(f"--cache-modes: each one of {','.join(CACHE_MODES)}, got {a.cache_modes}")
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
        calibration = load_calibration(calibrate(model, ids[:split].to(a.device), progress=True,
                                                 sensitivity_windows=a.sensitivity_windows), config)
        evaluation = ids[split:]
    windows = [evaluation[i * a.window:(i + 1) * a.window].to(a.device)
               for i in range(a.skip_windows, a.skip_windows + a.windows)]
    windows = [w for w in windows if w.numel() == a.window]
    if not windows:
        ap.error(f"--text holds fewer than {a.window} evaluation tokens")
    trained = os.path.isfile(os.path.join(a.model, "model.safetensors")) or os.path.isfile(
        os.path.join(a.model, "pytorch_model.bin"))
    print(f"benchmarks.quality: {a.model}, {len(windows)} windows of {a.window} tokens, prompt {a.prompt}, "
          f"beta {a.beta}" + ("" if trained else " (random weights: mechanics only)"))
    if calibration.layer_sensitivity is None and any(m.split for m in methods):
        if chosen:
            ap.error("--methods: +split needs a calibration with a layer sensitivity (kvops calibrate writes one)")
        methods = [m for m in methods if not m.split]  # the default list, on an older calibration file
    if any(m.split for m in methods):
        sensitivity = calibration.layer_sensitivity
        for r, nats in zip(sensitivity.recent, sensitivity.nats.tolist()):
            print(f"  layer sensitivity, newest {r} tokens: " + " ".join(f"{v:+.4f}" for v in nats))
        for budget in budgets:
            print(f"  +split at budget {budget}: {layer_split(sensitivity, budget)}")
    rows = evaluate(model, windows, calibration, budgets, a.beta, a.prompt, methods, progress=True,
                    tokenizer=tokenizer)
    if a.cache_windows > 0:
        rows += evaluate_caches(model, windows[:a.cache_windows], calibration, budgets, a.beta, a.prompt, cache_modes,
                                progress=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if a.plot and (plt := pyplot()) is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = [(r["budget"], r["loss"], r["loss_ci95"]) for r in rows if r["method"] == method]
            budget, loss, ci = zip(*pts)
            ax.errorbar(budget, loss, yerr=[0 if c != c else c for c in ci], marker="o", capsize=3, label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (decode tokens kept)")
        ax.set_ylabel("teacher-forced loss (nats/token)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
