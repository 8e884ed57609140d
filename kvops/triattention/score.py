"""TriAttention scoring ops: raw scores from the paged K pools, then the normalize-and-reduce into row scores.

``kvops::triattention_score_`` (GPU: the CuTe DSL kernel in score_cute.py; CPU: batched torch) reads every
decode token's key once and writes, for each (request, layer, query head), the raw scores ``raw[R, L, Hq, n]``
and per-CHUNK-token partial statistics ``stats[R, L, Hq, ceil(n / CHUNK), 3]`` = (mean, M2, count) of the
chunk's finite scores. A token whose page-table entry is missing (-1, outside the pool, or a column past the
table) is absent: its raw score is NaN and its key is never read. ``kvops::triattention_reduce_`` (Triton;
torch on the CPU) merges the partials into each (r, l, h)'s mean and population std, normalizes, and reduces to
the mode's rows; a token with a non-finite score (a NaN or Inf key, or absent) in any (layer, head) its row
reduces over gets -inf there, so it ranks below every other token and no statistic sees it. The union row needs
every head's statistics, which exist only once the whole pass is done, so it is produced here and not inside
the scorer (that would need a grid-wide barrier). Column j is cache position P + j; columns at or past N - P
are -inf in the rows.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from . import _cute
from .._checks import check_device, check_float32, check_int, check_int32
from .._triton import triton_launcher
from ..compaction.compact import MODES, decision_rows

CHUNK = 1024  # decode tokens per statistics partial (and per scorer CTA)
STATS = 3     # per partial: mean, M2 and count of the chunk's finite scores
KV_DTYPES = (torch.bfloat16, torch.float16)      # what the CuTe scorer reads (KV_TYPES in score_cute.py)
POOL_DTYPES = KV_DTYPES + (torch.float8_e4m3fn,)  # fp8 pools: the torch path, on either device


# ---- scorer -------------------------------------------------------------------------------------------------

def _score_torch(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats):
    R, L, Hq, n = raw.shape
    Hkv, T = k_pools[0].shape[2], k_pools[0].shape[3]
    G, F = Hq // Hkv, q_real.shape[-1]
    j = torch.arange(n, device=raw.device)
    count = (cache_lengths - prompt_lengths).clamp(0, n)
    valid = j[None, :] < count[:, None]                                             # [R, n]
    pos = prompt_lengths.long()[:, None] + j[None, :]
    cols = pos // T
    pages = page_table.long().gather(1, cols.clamp(0, page_table.shape[1] - 1))
    present = (cols < page_table.shape[1]) & (pages >= 0) & (pages < k_pools[0].shape[0])  # else absent: NaN
    pages = torch.where(present, pages, 0)
    slots = pos % T
    C, S = phase[:, 0, None, :], phase[:, 1, None, :]                               # [R, 1, F]
    for layer in range(L):
        keys = k_pools[layer][pages, 0, :, slots].float()                          # [R, n, Hkv, D]
        kr, ki = keys[..., :F], keys[..., F:2 * F]
        qr, qi = q_real[layer][None], q_imag[layer][None]                          # [1, Hq, F]
        a = (qr * C - qi * S).view(R, Hkv, G, F)
        b = (qr * S + qi * C).view(R, Hkv, G, F)
        s = (torch.einsum("rngf,rgif->rgin", kr, a) + torch.einsum("rngf,rgif->rgin", ki, b)
             + torch.einsum("rngf,gif->rgin", torch.sqrt(kr * kr + ki * ki), q_extra[layer].view(Hkv, G, F)))
        s = torch.where(present[:, None], s.reshape(R, Hq, n), float("nan"))
        raw[:, layer] = torch.where(valid[:, None], s, raw[:, layer])  # like the kernel
    # partials over the finite scores; chunks with no decode token keep whatever they held (the kernel does not
    # write them)
    nc = stats.shape[3]
    width = (count[:, None] - torch.arange(nc, device=raw.device)[None] * CHUNK).clamp(0, CHUNK)  # [R, nc]
    padded = torch.nn.functional.pad(raw, (0, nc * CHUNK - n)).view(R, L, Hq, nc, CHUNK)
    live = (torch.arange(CHUNK, device=raw.device) < width[:, None, None, :, None]) & torch.isfinite(padded)
    cnt = live.sum(-1).float()
    mean = torch.where(live, padded, 0).sum(-1) / cnt.clamp(min=1)
    m2 = torch.where(live, (padded - mean[..., None]) ** 2, 0).sum(-1)
    written = (width > 0)[:, None, None, :, None]
    stats.copy_(torch.where(written, torch.stack([mean, m2, cnt], -1), stats))


@torch.library.custom_op("kvops::triattention_score_", mutates_args={"raw", "stats"})
def _score_op(k_pools: list[torch.Tensor], page_table: torch.Tensor,
              prompt_lengths: torch.Tensor, cache_lengths: torch.Tensor, phase: torch.Tensor, q_real: torch.Tensor,
              q_imag: torch.Tensor, q_extra: torch.Tensor, raw: torch.Tensor, stats: torch.Tensor) -> None:
    _score_torch(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats)


def compile_scorer(dtype: torch.dtype, num_freqs: int, group: int, page_size: int, device: torch.device | None):
    """Compile the CuTe scorer for one shape class (device None: compile only, for CI without a GPU)."""
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from .score_cute import Scorer

    on = device or torch.device("cpu")
    i32 = lambda *s: torch.zeros(s, dtype=torch.int32, device=on)  # noqa: E731
    f32 = lambda *s: torch.zeros(s, dtype=torch.float32, device=on)  # noqa: E731
    dummies = (torch.zeros(1, dtype=torch.int64, device=on), i32(2, 2), i32(2), i32(2), f32(2, 2, num_freqs),
               *(f32(1, group, num_freqs) for _ in range(3)), f32(2, 1, group, 4), f32(2, 1, group, 1, STATS))
    scorer = Scorer(KV_DTYPES.index(dtype), num_freqs, group, page_size)
    return cute.compile(scorer, *_cute.dynamic(*dummies), Int64(0), Int64(0), Int64(0), Int32(1),
                        _cute.stream(device))


@_score_op.register_kernel("cuda")
def _score_cuda(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats):
    from cutlass import Int32, Int64

    pool = k_pools[0]
    if pool.dtype not in KV_DTYPES:  # no CuTe kernel for fp8 pools yet: the same math in torch (capturable)
        _score_torch(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats)
        return
    G, F, T = raw.shape[2] // pool.shape[2], q_real.shape[-1], pool.shape[3]
    if any(p.data_ptr() % 16 for p in k_pools):  # addresses exist only here, at run time, not while tracing
        raise ValueError(f"triattention score: the GPU scorer needs 16-byte aligned k_pools, got base addresses "
                         f"{[hex(p.data_ptr()) for p in k_pools if p.data_ptr() % 16][:4]}")
    layer_k = layer_addresses(k_pools)
    key = ("score", _cute.device_index(pool.device), pool.dtype, F, G, T)
    fn = _cute.compiled("kvops triattention scorer", key, lambda: compile_scorer(pool.dtype, F, G, T, pool.device))
    if raw.shape[0] and raw.shape[3]:
        fn(*_cute.dynamic(layer_k, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw,
                          stats), Int64(pool.stride(0)), Int64(pool.stride(2)), Int64(pool.stride(3)),
           Int32(pool.shape[0]), _cute.stream(pool.device))


@_score_op.register_fake
def _score_fake(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats):
    return None


def check_pools(what: str, k_pools: Sequence[torch.Tensor], num_layers: int, num_query_heads: int,
                num_freqs: int) -> int:
    """The layout the scorer reads: per-layer 5-D [page, plane, kv_head, token, dim] views of one dtype, shape
    and strides, dims contiguous, kv_head dividing the query heads; on the GPU also strides in whole lane loads.
    Returns the KV head count."""
    if not isinstance(k_pools, (list, tuple)) or len(k_pools) != num_layers:
        raise ValueError(f"{what}: k_pools must be a list of {num_layers} per-layer pools, got "
                         f"{len(k_pools) if isinstance(k_pools, (list, tuple)) else type(k_pools).__name__}")
    check_device(what, k_pools=k_pools)
    first = k_pools[0]
    if first.dim() != 5:
        raise ValueError(f"{what}: k_pools must be 5-D [page, plane, kv_head, token, dim] views, got "
                         f"{tuple(getattr(first, 'shape', ()))}")
    num_kv_heads = first.shape[2]
    if num_query_heads % num_kv_heads:
        raise ValueError(f"{what}: k_pools' kv_head count {num_kv_heads} must divide the calibration's "
                         f"{num_query_heads} query heads")
    group = num_query_heads // num_kv_heads
    if first.dtype not in POOL_DTYPES:
        raise ValueError(f"{what}: k_pools must be bfloat16, float16 or float8_e4m3fn, got {first.dtype}")
    if first.shape[4] < 2 * num_freqs or first.stride(4) != 1:
        raise ValueError(f"{what}: k_pools need head_dim >= {2 * num_freqs} (the rotary dims) with unit dim "
                         f"stride, got {tuple(first.shape)} strides {first.stride()}")
    for layer, pool in enumerate(k_pools):
        if (pool.shape, pool.stride(), pool.dtype, pool.device) != (first.shape, first.stride(), first.dtype,
                                                                    first.device):
            raise ValueError(f"{what}: k_pools[{layer}] differs from k_pools[0] in shape, strides, dtype or device")
    if first.is_cuda and first.dtype in KV_DTYPES:
        from .score_cute import lane_split

        fpl, lanes = lane_split(num_freqs, group)
        if num_freqs % fpl or lanes & (lanes - 1) or lanes > 32:
            raise ValueError(f"{what}: the GPU scorer needs F a multiple of {fpl} with F/{fpl} a power of two "
                             f"<= 32, got F={num_freqs}")
        if any(first.stride(d) % fpl for d in (0, 2, 3)):
            raise ValueError(f"{what}: the GPU scorer needs page, head and token strides that are multiples of "
                             f"{fpl} elements, got strides {first.stride()}")
    return num_kv_heads


_addresses: dict[tuple, torch.Tensor] = {}


def layer_addresses(k_pools: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [L] device tensor of the pools' base addresses, made once per set of pools (a host-to-device copy,
    so never inside a CUDA-graph capture: warm up with the pools first)."""
    device = k_pools[0].device
    key = (device, *(p.data_ptr() for p in k_pools))
    if key not in _addresses:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("triattention scorer: new pools during a CUDA-graph capture; score once with these "
                               "pools before capturing (warm-up)")
        if len(_addresses) >= 64:
            _addresses.clear()
        _addresses[key] = torch.tensor([p.data_ptr() for p in k_pools], dtype=torch.int64).to(device)
    return _addresses[key]


def score(k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
          prompt_lengths: torch.Tensor, phase: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          max_decode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw float32 [R, L, Hq, max_decode], stats float32 [R, L, Hq, ceil(max_decode / CHUNK), STATS]).

    k_pools: per-layer [page, plane, kv_head, token, dim] views (plane 0 is K); page_table int32 [R, pages];
    cache_lengths, prompt_lengths int32 [R]; phase float32 [R, 2, F] (mean_phase); weights: Calibration.
    score_weights() on the pools' device. Only the first N - P columns of raw are written (NaN for a token whose
    page is missing from the page table).
    """
    what = "triattention score"
    q_real, q_imag, q_extra = weights
    L, Hq, F = q_real.shape
    check_pools(what, k_pools, L, Hq, F)
    device = check_int32(what, k_pools[0].device, page_table=(page_table, 2), cache_lengths=(cache_lengths, 1),
                         prompt_lengths=(prompt_lengths, 1))
    R = page_table.shape[0]
    for name, t in (("cache_lengths", cache_lengths), ("prompt_lengths", prompt_lengths)):
        if t.shape[0] != R:
            raise ValueError(f"{what}: {name} must be int32 [{R}] (one per page-table row), got {tuple(t.shape)}")
    if not page_table.is_contiguous():
        raise ValueError(f"{what}: page_table must be contiguous")
    check_float32(what, device, phase=(phase, (R, 2, F)),
                  **{f"weights[{i}]": (w, (L, Hq, F)) for i, w in enumerate(weights)})
    check_int(what, "max_decode", max_decode)
    raw = torch.empty((R, L, Hq, max_decode), dtype=torch.float32, device=device)
    stats = torch.empty((R, L, Hq, triton.cdiv(max_decode, CHUNK), STATS), dtype=torch.float32, device=device)
    _score_op(list(k_pools), page_table, prompt_lengths, cache_lengths, phase, q_real,
              q_imag, q_extra, raw, stats)
    return raw, stats


# ---- normalize and reduce -----------------------------------------------------------------------------------

def _reduce_torch(raw, stats, prompt_lengths, cache_lengths, rows, mode, num_kv_heads, normalize):
    R, L, Hq, n = raw.shape
    count = (cache_lengths - prompt_lengths).clamp(0, n)
    valid = torch.arange(n, device=raw.device)[None, :] < count[:, None]             # [R, n]
    s = torch.where(valid[:, None, None], raw, 0)
    finite = torch.isfinite(s)
    s = torch.where(finite, s, 0)
    if normalize:
        nc = stats.shape[3]
        written = (count[:, None] > torch.arange(nc, device=raw.device)[None] * CHUNK)[:, None, None, :]
        m, m2, cnt = (torch.where(written, stats[..., i], 0) for i in range(STATS))  # [R, L, Hq, nc]
        total = cnt.sum(-1).clamp(min=1)
        mean = (m * cnt).sum(-1) / total
        var = (m2 + cnt * (m - mean[..., None]) ** 2).sum(-1) / total
        s = (s - mean[..., None]) / var.sqrt().clamp_min(1e-6)[..., None]
    G = Hq // num_kv_heads
    grouped = s.view(R, L, num_kv_heads, G, n).amax(3)                                 # [R, L, Hkv, n]
    poisoned = ~finite.view(R, L, num_kv_heads, G, n).all(3)                          # [R, L, Hkv, n]
    if mode == "union":
        out, poisoned = grouped.amax((1, 2))[:, None], poisoned.any(2).any(1)[:, None]
    elif mode == "per_head":
        out, poisoned = grouped.mean(1), poisoned.any(1)
    else:
        out, poisoned = grouped.reshape(R, -1, n), poisoned.reshape(R, -1, n)
    rows.copy_(torch.where(valid[:, None] & ~poisoned, out, -float("inf")))


@triton.jit
def _moments_kernel(stats, prompt_lengths, cache_lengths, moments, n, NC, planes, CHUNK: tl.constexpr,
                    STATS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """moments[r, plane] = (mean, max(std, 1e-6)) of the finite scores of (r, layer, head), merged from the
    scorer's chunk partials (Chan et al.): once per plane, not once per column block of the reduce."""
    r = tl.program_id(0)
    plane = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    count = tl.minimum(tl.maximum(tl.load(cache_lengths + r) - tl.load(prompt_lengths + r), 0), n)
    c = tl.arange(0, BLOCK_C)
    live = (plane < planes)[:, None] & ((c < NC) & (c * CHUNK < count))[None, :]  # partials the scorer wrote
    part = stats + ((r.to(tl.int64) * planes + plane)[:, None] * NC + c[None, :]) * STATS    # [BLOCK_P, BLOCK_C]
    m = tl.load(part, mask=live, other=0.0)
    m2 = tl.load(part + 1, mask=live, other=0.0)
    w = tl.load(part + 2, mask=live, other=0.0)  # the partial's finite scores
    total = tl.maximum(tl.sum(w, 1), 1.0)
    mean = tl.sum(m * w, 1) / total
    var = tl.sum(m2 + w * (m - mean[:, None]) * (m - mean[:, None]), 1) / total
    out = moments + (r.to(tl.int64) * planes + plane) * 2
    tl.store(out, mean, mask=plane < planes)
    tl.store(out + 1, tl.maximum(tl.sqrt(var), 1e-6), mask=plane < planes)


@triton.jit
def _reduce_kernel(raw, moments, prompt_lengths, cache_lengths, rows, n, ROWS, L: tl.constexpr, Hq: tl.constexpr,
                   G: tl.constexpr, GP: tl.constexpr, MODE: tl.constexpr, NORMALIZE: tl.constexpr,
                   BLOCK_J: tl.constexpr):
    r = tl.program_id(0)
    row = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    count = tl.minimum(tl.maximum(tl.load(cache_lengths + r) - tl.load(prompt_lengths + r), 0), n)
    valid = j < count
    dh = tl.arange(0, GP)  # a KV head's G query heads (padded to a power of two), loaded as one tile
    live_h = dh < G
    # The (layer, group) blocks this row reduces. Trip counts are constexprs (Triton 3.6's interpreter cannot
    # range() over an int argument).
    if MODE == 2:    # per_layer_perhead: row = layer * Hkv + g
        l_lo = row // (Hq // G)
        h_lo = (row % (Hq // G)) * G
    else:            # union: every (layer, group); per_head: every layer, the group of KV head `row`
        l_lo = 0
        h_lo = 0 if MODE == 0 else row * G
    acc = tl.full([BLOCK_J], 0.0 if MODE == 1 else -float("inf"), tl.float32)
    for dl in range(0, 1 if MODE == 2 else L):
        for dg in range(0, Hq // G if MODE == 0 else 1):
            plane = (r.to(tl.int64) * L + l_lo + dl) * Hq + h_lo + dg * G + dh                  # [GP]
            s = tl.load(raw + plane[:, None] * n + j[None, :], mask=live_h[:, None] & valid[None, :], other=0.0)
            # A non-finite score (NaN too) becomes +inf: it survives the max over heads, the max or sum over
            # layers, and the normalization, so +inf at the end marks the column poisoned (one compare, no
            # reduction of its own). The statistics count only finite scores.
            s = tl.where(tl.abs(s) < float("inf"), s, float("inf"))
            if NORMALIZE:  # (r, layer, h)'s mean and std, merged once by _moments_kernel
                mean = tl.load(moments + plane * 2, mask=live_h, other=0.0)
                std = tl.load(moments + plane * 2 + 1, mask=live_h, other=1.0)
                s = (s - mean[:, None]) / std[:, None]
            best = tl.max(tl.where(live_h[:, None], s, -float("inf")), 0)  # max over the group's heads
            if MODE == 1:
                acc += best
            else:
                acc = tl.maximum(acc, best)
    if MODE == 1:
        acc = acc / L
    out = tl.where(valid & (acc < float("inf")), acc, -float("inf"))
    tl.store(rows + (r.to(tl.int64) * ROWS + row) * n + j, out, mask=j < n)


@triton_op("kvops::triattention_reduce_", mutates_args={"rows"})
def _reduce_op(raw: torch.Tensor, stats: torch.Tensor, prompt_lengths: torch.Tensor, cache_lengths: torch.Tensor,
               rows: torch.Tensor, mode: str, num_kv_heads: int, normalize: bool) -> None:
    launch = triton_launcher(_reduce_kernel, raw.device)
    if launch is None:
        _reduce_torch(raw, stats, prompt_lengths, cache_lengths, rows, mode, num_kv_heads, normalize)
        return
    R, L, Hq, n = raw.shape
    moments = raw.new_empty(R, L * Hq, 2) if normalize else raw  # (unread without normalization)
    if normalize:
        block_p = 32
        triton_launcher(_moments_kernel, raw.device)[(R, triton.cdiv(L * Hq, block_p))](
            stats, prompt_lengths, cache_lengths, moments, n, stats.shape[3], L * Hq, CHUNK=CHUNK, STATS=STATS,
            BLOCK_P=block_p, BLOCK_C=max(triton.next_power_of_2(stats.shape[3]), 2))
    # A union program loops over every (layer, group): narrower blocks give it more programs to overlap those
    # loops (docs/triattention.md, "Speed").
    block_j = 512 if mode == "union" else 1024
    launch[(R, rows.shape[1], triton.cdiv(n, block_j))](
        raw, moments, prompt_lengths, cache_lengths, rows, n, rows.shape[1], L=L, Hq=Hq,
        G=Hq // num_kv_heads, GP=triton.next_power_of_2(Hq // num_kv_heads),
        MODE=MODES.index(mode), NORMALIZE=normalize, BLOCK_J=block_j)


def reduce_rows(raw: torch.Tensor, stats: torch.Tensor, cache_lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                mode: str, num_kv_heads: int, normalize: bool = True) -> torch.Tensor:
    """Row scores float32 [R, rows, n] from score()'s outputs: z = (s - mean) / max(std, 1e-6) per (r, l, h)
    over the finite scores when normalizing, then union = max over (l, h); per_head = mean over l of max over the
    group's heads; per_layer_perhead = max over the group's heads, row l * Hkv + g. Columns past N - P, and
    columns with a non-finite score in any (l, h) the row reduces over, are -inf."""
    what = "triattention reduce"
    if mode not in MODES:
        raise ValueError(f"{what}: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(raw, torch.Tensor) or raw.dim() != 4:
        raise ValueError(f"{what}: raw must be a 4-D [R, L, Hq, n] tensor (score()'s first output)")
    R, L, Hq, n = raw.shape
    if check_int(what, "num_kv_heads", num_kv_heads, 1) and Hq % num_kv_heads:
        raise ValueError(f"{what}: num_kv_heads must divide the {Hq} query heads, got {num_kv_heads}")
    check_float32(what, raw.device, raw=(raw, (R, L, Hq, n)),
                  stats=(stats, (R, L, Hq, triton.cdiv(n, CHUNK), STATS)))
    check_int32(what, raw.device, cache_lengths=(cache_lengths, 1), prompt_lengths=(prompt_lengths, 1))
    if cache_lengths.shape[0] != R or prompt_lengths.shape[0] != R:
        raise ValueError(f"{what}: cache_lengths and prompt_lengths must have {R} entries (one per request)")
    rows = torch.empty((R, decision_rows(mode, L, num_kv_heads), n), dtype=torch.float32, device=raw.device)
    if R and n:
        _reduce_op(raw, stats, prompt_lengths, cache_lengths, rows, mode, num_kv_heads, normalize)
    return rows
