"""kvops.attention.decode_attention against its float64 reference and torch's sdpa, on paged, ragged, strided and
fp8 caches; the op's fake, compile and CUDA-graph paths; and its argument checks."""

import math

import pytest
import torch

from conftest import DEVICES, opcheck, refused, requires_cuda
from kvops.attention import decode_attention
from kvops.attention.reference import decode_attention as reference


def _case(device, *, R=5, Hq=8, Hkv=2, q=1, D=128, S=16, pages=None, dtype=torch.bfloat16, kv_dtype=None,
          starts=False, holes=False):
    """A shuffled paged cache with ragged lengths (empty and full rows included) and a query of strided layout
    (a transposed [R, q, Hq, D] projection)."""
    max_pages = 5
    pages = pages or R * max_pages + 3
    kv_dtype = kv_dtype or dtype
    k = torch.randn(pages, Hkv, S, D, device=device).to(kv_dtype)
    v = torch.randn(pages, Hkv, S, D, device=device).to(kv_dtype)
    table = torch.randperm(pages, device=device)[:R * max_pages].view(R, max_pages).int()
    if holes:  # ids past the pool and negative ones hold nothing
        table[0, 1], table[-1, 0] = -1, pages + 7
    capacity = max_pages * S
    lengths = torch.randint(1, capacity + 1, (R,), device=device).int()
    lengths[0] = capacity
    if R > 2:
        lengths[1], lengths[2] = 0, capacity + 100  # nothing; past the table (clamped)
    start = torch.randint(0, 9, (R,), device=device).int() if starts else None
    query = torch.randn(R, q, Hq, D, device=device, dtype=dtype).transpose(1, 2)
    return query, k, v, table, lengths, start


def _check(query, k, v, table, lengths, starts, **kw):
    out = decode_attention(query, k, v, table, lengths, starts=starts, **kw)
    want = reference(query, k, v, table, lengths, starts, **{n: kw[n] for n in ("scale", "k_scale", "v_scale")
                                                             if n in kw})
    assert out.shape == want.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Hq,Hkv,q", [(8, 2, 1), (8, 8, 1), (6, 2, 1), (32, 4, 1), (8, 2, 3), (16, 1, 2)])
def test_matches_reference_grouped_heads(device, Hq, Hkv, q):
    _check(*_case(device, Hq=Hq, Hkv=Hkv, q=q))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D,S,dtype", [(64, 16, torch.float16), (128, 7, torch.bfloat16), (256, 32, torch.bfloat16),
                                       (128, 1, torch.float16)])
def test_matches_reference_head_dims_and_page_sizes(device, D, S, dtype):
    _check(*_case(device, D=D, S=S, dtype=dtype, starts=True, holes=True), scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64),
                                     (torch.float16, 256)])
def test_fp8_cache_with_scales(device, dtype, D):
    _check(*_case(device, D=D, dtype=dtype, kv_dtype=torch.float8_e4m3fn, q=2, starts=True), k_scale=0.5,
           v_scale=3.0)


@requires_cuda
@pytest.mark.parametrize("splits", [0, 1, 2, 7, 8, 9, 64])
@pytest.mark.parametrize("D,kv_dtype", [(128, torch.bfloat16), (64, torch.float8_e4m3fn), (256, torch.bfloat16)])
def test_splits_agree(splits, D, kv_dtype):
    """Any split count (the merge kernel combines them) agrees with one split, bf16 and fp8, head_dim 64-256."""
    case = _case("cuda", R=3, Hq=16, Hkv=4, D=D, S=64, kv_dtype=kv_dtype, starts=True)
    out = _check(*case, num_splits=splits)
    torch.testing.assert_close(out, decode_attention(*case[:5], starts=case[5], num_splits=1), atol=1e-2, rtol=1e-2)


@requires_cuda
@pytest.mark.parametrize("R,Hq,Hkv,N", [(1, 32, 8, 3000), (8, 32, 8, 777), (64, 16, 16, 300)])
def test_matches_sdpa_over_held_slots(R, Hq, Hkv, N):
    """A dense [batch, kv_heads, slots, D] cache (one page per row, as transformers holds it) against sdpa over
    each row's held slots [start, length)."""
    D = 128
    k = torch.randn(R, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    query = torch.randn(R, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.randint(N // 2, N + 1, (R,), device="cuda").int()
    starts = torch.randint(0, 20, (R,), device="cuda").int()
    table = torch.arange(R, device="cuda", dtype=torch.int32)[:, None]
    out = decode_attention(query, k, v, table, lengths, starts=starts)
    for r in range(R):
        s, n = int(starts[r]), int(lengths[r])
        want = torch.nn.functional.scaled_dot_product_attention(
            query[r:r + 1], k[r:r + 1, :, s:n], v[r:r + 1, :, s:n], enable_gqa=True)
        torch.testing.assert_close(out[r], want[0].transpose(0, 1), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_keys_propagate_as_in_the_reference(device, value):
    """A held key that is NaN, or +inf under a query it scores +inf with, makes that query head's output NaN for
    the request that holds it, as in sdpa and the reference; other heads and requests, and a row that sees
    nothing (zeros), are unaffected."""
    query, k, v, table, lengths, starts = _case(device, R=3)
    k[table[0, 0], 1, 0, 5] = value  # position 0 of request 0, KV head 1 (query heads 4-7)
    query[0, 4, :, 5] = 1.0  # head 4's score of that key: NaN, or +inf
    out = decode_attention(query, k, v, table, lengths)
    want = reference(query, k, v, table, lengths)
    assert out[0, :, 4].isnan().all() and not out[0, :, :4].isnan().any() and not out[2].isnan().any()
    assert (out[1] == 0).all()  # request 1 holds nothing
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_cache_is_not_written(device):
    query, k, v, table, lengths, starts = _case(device)
    before = k.clone(), v.clone(), table.clone(), lengths.clone()
    decode_attention(query, k, v, table, lengths)
    for a, b in zip(before, (k, v, table, lengths)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    query, k, v, table, lengths, starts = _case(device, R=3, q=2, starts=True)
    opcheck(torch.ops.kvops.attention_decode.default,
            (query, k, v, table, lengths, starts, 1 / math.sqrt(128), 1.0, 1.0, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    query, k, v, table, lengths, starts = _case(device, R=3)

    @torch.compile(fullgraph=True)
    def step(query, lengths):
        return decode_attention(query * 1, k, v, table, lengths + 0, starts=starts)

    torch.testing.assert_close(step(query, lengths), decode_attention(query, k, v, table, lengths, starts=starts))
    # a 3-D query: the fake raises the op's ValueError, eager and compiled alike
    flat = torch.compile(lambda q: decode_attention(q, k, v, table, lengths, starts=starts, scale=0.1),
                         fullgraph=True, backend="aot_eager")
    for call in (lambda q: decode_attention(q, k, v, table, lengths, starts=starts, scale=0.1), flat):
        with refused(ValueError, "query must be 4-D"):
            call(query[:, 0])


@requires_cuda
@pytest.mark.parametrize("splits", [0, 4, 12])  # the rule's, and two counts through the merge kernel
def test_cuda_graph_replays_on_new_lengths_and_data(splits):
    query, k, v, table, lengths, starts = _case("cuda", R=4, Hq=32, Hkv=8, S=32)
    static_q, static_len = query.clone(), lengths.clone()
    decode_attention(static_q, k, v, table, static_len, num_splits=splits)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(static_q, k, v, table, static_len, num_splits=splits)
    for _ in range(3):
        static_q.copy_(torch.randn_like(static_q))
        static_len.copy_(torch.randint(0, 160, (4,), device="cuda").int())
        k.copy_(torch.randn_like(k))
        graph.replay()
        torch.testing.assert_close(out.float(), reference(static_q, k, v, table, static_len).float(), atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,error,words", [
    (lambda q, k, t: dict(query=q.float()), TypeError, "query must be bfloat16"),
    (lambda q, k, t: dict(query=q[:, :, :, :64].contiguous()[..., :48]), ValueError, "head_dim"),
    (lambda q, k, t: dict(query=q[..., ::2]), ValueError, "head_dim"),
    (lambda q, k, t: dict(query=q[..., :0]), ValueError, "head_dim must be 64, 128 or 256, got 0"),  # no 1/sqrt(0)
    (lambda q, k, t: dict(query=q[:, :5]), ValueError, "multiple"),
    (lambda q, k, t: dict(k_cache=k.half()), TypeError, "k_cache must be"),
    (lambda q, k, t: dict(v_cache=k[:, :, :3]), ValueError, "v_cache"),
    (lambda q, k, t: dict(k_cache=k[..., :64]), ValueError, "head_dim"),
    (lambda q, k, t: dict(k_cache=k.repeat_interleave(2, -1)[..., ::2]), ValueError, "contiguous head_dim"),
    (lambda q, k, t: dict(page_table=t.long()), TypeError, "page_table must be int32"),
    (lambda q, k, t: dict(page_table=t[:1]), ValueError, "page_table must be 2-D"),
    (lambda q, k, t: dict(lengths=t[:, 0].long()), TypeError, "lengths must be int32"),
    (lambda q, k, t: dict(lengths=t[:, :2].reshape(-1)), ValueError, "lengths must be contiguous"),
    (lambda q, k, t: dict(starts=t[:1, 0]), ValueError, "starts must be"),
    (lambda q, k, t: dict(scale=float("nan")), ValueError, "scale must be finite"),
    (lambda q, k, t: dict(k_scale=-1.0), ValueError, "k_scale"),
    (lambda q, k, t: dict(scale="1"), TypeError, "scale must be a float"),
    (lambda q, k, t: dict(num_splits=257), ValueError, "num_splits"),
    (lambda q, k, t: dict(page_table=t.to("meta")), ValueError, "meta"),
])
def test_bad_arguments(device, change, error, words):
    query, k, v, table, lengths, _ = _case(device, R=2)
    args = {**dict(query=query, k_cache=k, v_cache=v, page_table=table, lengths=lengths), **change(query, k, table)}
    with pytest.raises(error, match=words):
        decode_attention(**args)


@requires_cuda
def test_bad_device():
    query, k, v, table, lengths, _ = _case("cuda", R=2)
    with pytest.raises(ValueError, match="lengths is on cpu"):
        decode_attention(query, k, v, table, lengths.cpu())
