"""TriAttention raw scores from the paged K pools (``kvops::triattention_score_``; GPU: the CuTe DSL kernel in
score_cute.py, built ahead of time (kvops/_cute.py); CPU: batched torch).

It reads every decode token's key once and writes, for each (request, layer, query head), the raw scores
``raw[R, L, Hq, n]`` and per-CHUNK-token partial statistics ``stats[R, L, Hq, ceil(n / CHUNK), 3]`` = (mean, M2,
count) of the chunk's finite scores, which reduce.py merges. A token whose page-table entry is missing (-1,
outside the pool, or a column past the table) is absent: its raw score is NaN and its key is never read.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton

from .. import _cute
from .._checks import INT32_MAX, check_device, check_float32, check_int, check_int32, check_nonnegative
from .._dispatch import python_op

CHUNK = 1024  # decode tokens per statistics partial (and per scorer CTA)
STATS = 3     # per partial: mean, M2 and count of the chunk's finite scores
# The KV dtypes the scorer reads, each with the name of its cutlass type (the CuTe scorer's element type; fp8 keys
# widen to fp32 in registers).
KV_DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float8_e4m3fn: "Float8E4M3FN",
             torch.float8_e5m2: "Float8E5M2"}


def lane_split(num_freqs: int, group: int, freqs_per_lane: int | None = None) -> tuple[int, int]:
    """The CuTe scorer's (frequencies per lane, lanes per token): by default 8 frequencies (one 16-byte bf16 load per rotary half)
    for G <= 4; 4 for larger groups, whose G accumulators per token leave fewer registers for a lane's keys."""
    fpl = freqs_per_lane or (8 if group <= 4 else 4)
    return fpl, num_freqs // fpl


def check_scorer_class(what: str, num_freqs: int, group: int) -> int:
    """The CuTe scorer's shape rule for F frequencies and GQA group G: F a multiple of lane_split's frequencies per
    lane, F / that a power of two <= 32 (a token's lanes, within one warp). Returns the frequencies per lane."""
    fpl, lanes = lane_split(num_freqs, group)
    if num_freqs % fpl or lanes < 1 or lanes & (lanes - 1) or lanes > 32:
        raise ValueError(f"{what}: the GPU scorer needs F a multiple of {fpl} with F/{fpl} a power of two "
                         f"<= 32, got F={num_freqs}")
    return fpl


@functools.cache  # one Spec per shape class: the eager call path looks it up, it does not build one
def scorer_spec(dtype: torch.dtype, num_freqs: int, group: int, page_size: int, **knobs) -> _cute.Spec:
    """The scorer's shape class as an ahead-of-time spec (kvops/_cute.py). knobs: Scorer's launch knobs (threads,
    unroll, freqs_per_lane; the defaults when none are given), for the sweep in benchmarks/tune_scorer.py."""
    def build(target: str):
        import cutlass
        from cutlass import Float32, Int32, Int64

        from .score_cute import Scorer

        f32, i32 = (lambda n: _cute.fake(Float32, n, 4)), (lambda n: _cute.fake(Int32, n, 4))  # noqa: E731
        args = [_cute.fake(Int64, 1, 8), i32(2), i32(1), i32(1), *(f32(3) for _ in range(4)), f32(4), f32(5),
                Int64(0), Int64(0), Int64(0), Int32(1)]
        scorer = Scorer(getattr(cutlass, KV_DTYPES[dtype]), num_freqs, group, page_size, CHUNK, **knobs)
        return _cute.ffi_compile(scorer, args, target)

    tuned = "".join(f"_{k}{v}" for k, v in sorted(knobs.items()))
    return _cute.Spec(f"score_{str(dtype).removeprefix('torch.')}_f{num_freqs}_g{group}_t{page_size}{tuned}", build)


def _score_cuda(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats):
    pool = k_pools[0]
    G, F, T = raw.shape[2] // pool.shape[2], q_real.shape[-1], pool.shape[3]
    addresses = pool_addresses(k_pools)  # they exist only here, at run time, not while tracing
    if any(a % 16 for a in addresses):
        raise ValueError(f"triattention score: the GPU scorer needs 16-byte aligned k_pools, got base addresses "
                         f"{[hex(a) for a in addresses if a % 16][:4]}")
    if raw.shape[0] and raw.shape[3]:
        fn = _cute.ffi_function(scorer_spec(pool.dtype, F, G, T), _cute.arch(pool.device))
        fn(*scorer_args(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw,
                        stats, addresses))


def scorer_args(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw,
                stats, addresses: tuple[int, ...] | None = None) -> tuple:
    """The CuTe scorer's TVM-FFI arguments for the op's arguments, in the order scorer_spec compiles them: the
    layers' base addresses (`addresses`: pool_addresses(k_pools), when the caller has them), the tensors, then
    the pools' page, head and token strides and page count."""
    pool = k_pools[0]
    return (layer_addresses(k_pools, addresses), page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag,
            q_extra, raw, stats, pool.stride(0), pool.stride(2), pool.stride(3), pool.shape[0])


@python_op("triattention_score_", mutates_args={"raw", "stats"}, cuda=_score_cuda)
def _score_op(k_pools: list[torch.Tensor], page_table: torch.Tensor,
              prompt_lengths: torch.Tensor, cache_lengths: torch.Tensor, phase: torch.Tensor, q_real: torch.Tensor,
              q_imag: torch.Tensor, q_extra: torch.Tensor, raw: torch.Tensor, stats: torch.Tensor) -> None:
    from .reference import score_torch  # here: the reference imports this module's CHUNK and STATS

    score_torch(k_pools, page_table, prompt_lengths, cache_lengths, phase, q_real, q_imag, q_extra, raw, stats)


def check_pools(what: str, k_pools: Sequence[torch.Tensor], num_layers: int, num_query_heads: int,
                num_freqs: int) -> int:
    """The layout the scorer reads: per-layer 5-D [page, plane, kv_head, token, dim] views of one dtype, shape
    and strides, dims contiguous, kv_head dividing the query heads; on the GPU also strides in whole lane loads.
    Returns the KV head count."""
    if not isinstance(k_pools, (list, tuple)) or len(k_pools) != num_layers:
        raise ValueError(f"{what}: k_pools must be a list of {num_layers} per-layer pools, got "
                         f"{len(k_pools) if isinstance(k_pools, (list, tuple)) else type(k_pools).__name__}")
    first = k_pools[0]
    if not isinstance(first, torch.Tensor):
        check_device(what, k_pools=k_pools)  # names it (the others: pool_addresses)
    if first.device.type == "meta":
        raise ValueError(f"{what}: k_pools[0] is a meta tensor; kvops ops need real data on one device")
    if first.dim() != 5:
        raise ValueError(f"{what}: k_pools must be 5-D [page, plane, kv_head, token, dim] views, got "
                         f"{tuple(getattr(first, 'shape', ()))}")
    if 0 in first.shape[:4]:  # nothing to read a key from (zero pages too: every page-table entry would be absent)
        raise ValueError(f"{what}: k_pools need at least one page, plane (K), KV head and token per page, got "
                         f"shape {tuple(first.shape)}")
    num_kv_heads = first.shape[2]
    if num_query_heads % num_kv_heads:
        raise ValueError(f"{what}: k_pools' kv_head count {num_kv_heads} must divide the calibration's "
                         f"{num_query_heads} query heads")
    group = num_query_heads // num_kv_heads
    if first.dtype not in KV_DTYPES:
        raise ValueError(f"{what}: k_pools must be one of {[str(d).removeprefix('torch.') for d in KV_DTYPES]}, "
                         f"got {first.dtype}")
    if first.shape[4] < 2 * num_freqs or first.stride(4) != 1:
        raise ValueError(f"{what}: k_pools need head_dim >= {2 * num_freqs} (the rotary dims) with unit dim "
                         f"stride, got {tuple(first.shape)} strides {first.stride()}")
    if torch.compiler.is_compiling():  # fake tensors: no addresses; the layout alone
        layout = (first.shape, first.stride(), first.dtype, first.device)
        for layer, pool in enumerate(k_pools):
            if (pool.shape, pool.stride(), pool.dtype, pool.device) != layout:
                raise ValueError(f"{what}: k_pools[{layer}] differs from k_pools[0] in shape, strides, dtype or "
                                 f"device")
    else:
        pool_addresses(k_pools, what)
    if first.is_cuda:
        fpl = check_scorer_class(what, num_freqs, group)
        if any(first.stride(d) % fpl for d in (0, 2, 3)):
            raise ValueError(f"{what}: the GPU scorer needs page, head and token strides that are multiples of "
                             f"{fpl} elements, got strides {first.stride()}")
    return num_kv_heads


def pool_addresses(k_pools: Sequence[torch.Tensor], what: str = "triattention score") -> tuple[int, ...]:
    """The pools' base addresses, once every pool is checked to have k_pools[0]'s shape, strides, dtype and device
    (ValueError naming the first that differs): one native call, where a Python loop over the layers would cost more
    than the rest of a round's host work."""
    try:
        return tuple(torch.ops.kvops._same_layout_addresses(k_pools, "k_pools"))
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    except (TypeError, RuntimeError):  # something in the list is not a tensor: name it
        check_device(what, k_pools=k_pools)
        raise


_addresses: dict[tuple, torch.Tensor] = {}


def layer_addresses(k_pools: Sequence[torch.Tensor], addresses: tuple[int, ...] | None = None) -> torch.Tensor:
    """int64 [L] device tensor of the pools' base addresses (`addresses`, when the caller has them), made once per
    set of pools (a host-to-device copy, so never inside a CUDA-graph capture: warm up with the pools first)."""
    device = k_pools[0].device
    key = (device, *(addresses or pool_addresses(k_pools)))
    if key not in _addresses:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("triattention scorer: new pools during a CUDA-graph capture; score once with these "
                               "pools before capturing (warm-up)")
        if len(_addresses) >= 64:
            _addresses.clear()
        _addresses[key] = torch.tensor(key[1:], dtype=torch.int64).to(device)
    return _addresses[key]


def score(k_pools: Sequence[torch.Tensor], page_table: torch.Tensor, cache_lengths: torch.Tensor,
          prompt_lengths: torch.Tensor, phase: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          max_decode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw float32 [R, L, Hq, max_decode], stats float32 [R, L, Hq, ceil(max_decode / CHUNK), STATS]).

    k_pools: per-layer [page, plane, kv_head, token, dim] views (plane 0 is K); page_table int32 [R, pages];
    cache_lengths, prompt_lengths int32 [R] (prompts >= 0, checked when on the host); phase float32 [R, 2, F]
    (mean_phase); weights: Calibration.score_weights() on the pools' device; max_decode in [0, 2**31 - 1]. Only
    the first N - P columns of raw are written (NaN for a token whose page is missing from the page table).
    """
    what = "triattention score"
    if not isinstance(weights, (list, tuple)) or not all(isinstance(w, torch.Tensor) for w in weights):
        kinds = [type(w).__name__ for w in weights] if isinstance(weights, (list, tuple)) else type(weights).__name__
        raise TypeError(f"{what}: weights must be a tuple of 3 tensors (Calibration.score_weights()), got {kinds}")
    if len(weights) != 3:
        raise ValueError(f"{what}: weights must be the 3 tensors (qr, qi, e) of Calibration.score_weights(), got "
                         f"{len(weights)}")
    if weights[0].dim() != 3 or 0 in weights[0].shape:
        raise ValueError(f"{what}: weights[0] must be [layers, query heads, frequencies], each >= 1, got shape "
                         f"{tuple(weights[0].shape)}")
    L, Hq, F = weights[0].shape
    device = check_round_inputs(what, k_pools, page_table, cache_lengths, prompt_lengths, L, Hq, F)
    check_float32(what, device, phase=(phase, (page_table.shape[0], 2, F)),
                  **{f"weights[{i}]": (w, (L, Hq, F)) for i, w in enumerate(weights)})
    check_int(what, "max_decode", max_decode, 0, INT32_MAX)
    return score_unchecked(k_pools, page_table, cache_lengths, prompt_lengths, phase, weights, max_decode)


def check_round_inputs(what: str, k_pools: Sequence[torch.Tensor], page_table: torch.Tensor,
                       cache_lengths: torch.Tensor, prompt_lengths: torch.Tensor, num_layers: int,
                       num_query_heads: int, num_freqs: int) -> torch.device:
    """The pools (check_pools), an int32 [R, pages] contiguous page table and int32 [R] lengths on their device,
    host prompt lengths >= 0 (a negative one would read keys before the cache's start; device ones are trusted
    unless the caller validates); returns the device."""
    check_pools(what, k_pools, num_layers, num_query_heads, num_freqs)
    device = check_int32(what, k_pools[0].device, page_table=(page_table, 2), cache_lengths=(cache_lengths, 1),
                         prompt_lengths=(prompt_lengths, 1))
    R = page_table.shape[0]
    for name, t in (("cache_lengths", cache_lengths), ("prompt_lengths", prompt_lengths)):
        if t.shape[0] != R:
            raise ValueError(f"{what}: {name} must be int32 [{R}] (one per page-table row), got {tuple(t.shape)}")
    if not page_table.is_contiguous():
        raise ValueError(f"{what}: page_table must be contiguous")
    check_nonnegative(what, "prompt_lengths", prompt_lengths)
    return device


def score_unchecked(k_pools, page_table, cache_lengths, prompt_lengths, phase, weights, max_decode):
    """score() on arguments its checks have passed (the selector checks once per round)."""
    R, (L, Hq, _) = page_table.shape[0], weights[0].shape
    raw = torch.empty((R, L, Hq, max_decode), dtype=torch.float32, device=page_table.device)
    stats = torch.empty((R, L, Hq, triton.cdiv(max_decode, CHUNK), STATS), dtype=torch.float32,
                        device=page_table.device)
    _score_op(list(k_pools), page_table, prompt_lengths, cache_lengths, phase, *weights, raw, stats)
    return raw, stats
