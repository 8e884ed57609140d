"""Decode attention on the GPU: kvops.attention.decode_attention against the copy bandwidth and torch's sdpa.

Qwen3-8B geometry (32 query heads on 8 KV heads, head_dim 128), one query token per request, every request holding
`tokens` positions. The cache is the transformers layout kvops' cache uses (a pool ``[batch, plane, kv_head, slot,
head_dim]``, one page per request, ``capacity`` slots of which `tokens` are held), or vLLM-style pages of 16 tokens
in random order (``paged``). All calls replay from CUDA graphs with L2 flushed (a decode step's layers do not
fit L2).

``decode_layers`` rows time a step's attention as a step runs it: one call per layer over that layer's own pools,
36 back to back in one graph, per layer (no flush needed: the layers' pools are many times L2).

Bytes counted: the K and V each request holds, read once. Baselines, on the same data, the faster is named:
  sdpa_masked  what GROUPED_SDPA does in a static cache: sdpa over every slot under a boolean mask, the grouped
               heads packed as query rows (no K/V repeat);
  sdpa_exact   sdpa with enable_gqa over exactly the held slots (possible here only because every request holds
               as many; cuDNN / flash kernels).
"""

from __future__ import annotations

import torch

from kvops.attention import decode_attention

from .common import Row, device_copy_gbps, graphed, time_us

FAMILY = "attention"
HQ, HKV, D = 32, 8, 128
PAGE = 16
LAYERS = 36  # decode_layers: a step's layers, each over its own pools (Qwen3-8B's count)


def _case(batch: int, tokens: int, capacity: int, paged: bool, kv_dtype: torch.dtype):
    query = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    if paged:
        per = capacity // PAGE
        pool = torch.randn(batch * per, 2, HKV, PAGE, D, device="cuda").to(kv_dtype)
        table = torch.randperm(batch * per, device="cuda").int().view(batch, per)
    else:
        pool = torch.randn(batch, 2, HKV, capacity, D, device="cuda").to(kv_dtype)
        table = torch.arange(batch, device="cuda", dtype=torch.int32)[:, None]
    lengths = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    return query, pool, table, lengths


def _baselines(query, pool, tokens):
    """The sdpa calls a user of a dense [batch, kv_head, slot, dim] cache would make (not for paged pools)."""
    B, capacity = query.shape[0], pool.shape[3]
    k, v = pool[:, 0], pool[:, 1]
    mask = (torch.arange(capacity, device="cuda") < tokens).view(1, 1, 1, capacity).expand(B, 1, 1, capacity)
    packed = query.view(B, HKV, HQ // HKV, D)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {"sdpa_masked": lambda: sdpa(packed, k, v, attn_mask=mask),
            "sdpa_exact": lambda: sdpa(query, k[:, :, :tokens], v[:, :, :tokens], enable_gqa=True)}


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    copy_gbps = device_copy_gbps()
    iters = 10 if quick else 30
    # (batch, held tokens, capacity, paged, KV dtype): kvops' static cache at budget 2048 (prompt 1024 + 2048 +
    # beta/2 held of 3201 slots), a dense cache at 16k, an engine's paged cache
    cases = [(1, 3136, 3201, False, torch.bfloat16), (8, 3136, 3201, False, torch.bfloat16),
             (32, 3136, 3201, False, torch.bfloat16), (128, 3136, 3201, False, torch.bfloat16),
             (8, 16384, 16640, False, torch.bfloat16), (32, 16384, 16640, False, torch.bfloat16),
             (32, 16384, 16384, True, torch.bfloat16), (32, 3136, 3200, False, torch.float8_e4m3fn)]
    if quick:
        cases = [c for c in cases if c[0] in (8, 32) and c[1] == 3136] + [cases[6]]
    rows, notes = [], []
    for batch, tokens, capacity, paged, kv_dtype in cases:
        query, pool, table, lengths = _case(batch, tokens, capacity, paged, kv_dtype)
        nbytes = batch * 2 * HKV * tokens * D * pool.element_size()
        fn = graphed(lambda: decode_attention(query, pool[:, 0], pool[:, 1], table, lengths))
        us = time_us(fn, iters)
        baseline, baseline_us = "", float("nan")
        if not paged and kv_dtype != torch.float8_e4m3fn:
            timed = {name: time_us(graphed(call), iters) for name, call in _baselines(query, pool, tokens).items()}
            baseline = min(timed, key=timed.get)
            baseline_us = timed[baseline]
            notes.append(f"- b{batch} x {tokens}: " + ", ".join(f"{n} {t:.1f} us" for n, t in timed.items()))
        layout = f"paged{PAGE}" if paged else "pool"
        rows.append(Row.make(FAMILY, "decode", f"b{batch} x {tokens} of {capacity} {layout}", kv_dtype, us, nbytes,
                             copy_gbps, baseline, baseline_us))
        query = pool = table = lengths = None  # freed before the next case
        torch.cuda.empty_cache()
    # a decode step's attention: one call per layer, each over its own pools, back to back in one graph (no flush:
    # 36 layers' pools are far larger than L2, so each layer reads from memory, with no flush's dirty lines ahead)
    for batch in (1, 8) if quick else (1, 8, 32):
        tokens, capacity = 3136, 3201
        layers = [_case(batch, tokens, capacity, False, torch.bfloat16) for _ in range(LAYERS)]
        nbytes = batch * 2 * HKV * tokens * D * 2
        calls = {"kvops": [lambda c=c: decode_attention(c[0], c[1][:, 0], c[1][:, 1], c[2], c[3]) for c in layers],
                 "sdpa_exact": [_baselines(c[0], c[1], tokens)["sdpa_exact"] for c in layers]}
        timed = {name: time_us(graphed(lambda fns=fns: [fn() for fn in fns]), iters, flush=False) / LAYERS
                 for name, fns in calls.items()}
        rows.append(Row.make(FAMILY, "decode_layers", f"b{batch} x {tokens} of {capacity}, {LAYERS} layers",
                             torch.bfloat16, timed["kvops"], nbytes, copy_gbps, "sdpa_exact", timed["sdpa_exact"]))
        layers = None
        torch.cuda.empty_cache()
    # transformers' KVOPS_ATTENTION under decode masks with left padding (row 0) and a hole (row 1): one-token
    # pages whose table it builds from the mask on the device, against the op over one page per row (the range
    # a mask without holes maps to)
    from kvops.integrations.transformers import kvops_attention

    module = torch.nn.Module()
    module.num_key_value_groups = HQ // HKV
    for batch, tokens, capacity in ((8, 3136, 3201), (32, 3136, 3201), (8, 16384, 16640)):
        query, pool, table, lengths = _case(batch, tokens, capacity, False, torch.bfloat16)
        mask = (torch.arange(capacity, device="cuda") < tokens).expand(batch, capacity).clone()
        mask[0, :128] = False
        mask[1, 1024:1152] = False
        mask = mask.view(batch, 1, 1, capacity)
        k, v = pool[:, 0], pool[:, 1]
        us = time_us(graphed(lambda: kvops_attention(module, query, k, v, mask)), iters)
        ranged = time_us(graphed(lambda: decode_attention(query, k, v, table, lengths)), iters)
        nbytes = int(mask.sum()) * 2 * HKV * D * 2
        rows.append(Row.make(FAMILY, "decode_masked", f"b{batch} x {tokens} of {capacity}, holes", torch.bfloat16,
                             us, nbytes, copy_gbps, "one page per row", ranged))
        query = pool = table = lengths = mask = k = v = None
        torch.cuda.empty_cache()
    notes.insert(0, f"Qwen3-8B heads (32 on 8, head_dim 128), one query token; copy bandwidth {copy_gbps:.0f} GB/s; "
                    "bytes: the held K and V. Baselines (graphed, same data):")
    return rows, notes
