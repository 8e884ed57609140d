"""kvops.topk against the reference (value order, lowest index on ties, NaN last, ascending output)."""

import os

import pytest
import torch

from conftest import DEVICES, opcheck, poison_, refused, requires_cuda
from kvops.topk import sort_keys, topk, topk_reference


def _tie_heavy(rows, N, device):
    s = torch.randint(-4, 5, (rows, N)).float() * 0.5
    s[torch.rand(rows, N) < 0.04] = float("nan")
    s[torch.rand(rows, N) < 0.04] = -float("inf")
    s[torch.rand(rows, N) < 0.04] = float("inf")
    s[torch.rand(rows, N) < 0.04] = -0.0
    return s.to(device)


def _shifted(indices, offsets):
    """Indices plus their row's offset, -1 padding kept (what topk returns with offsets)."""
    return indices if offsets is None else torch.where(indices >= 0, indices + offsets.cpu().view(-1, 1), indices)


def _special_bits() -> torch.Tensor:
    """int32 fp32 patterns: zeros of both signs, infinities, NaNs of every sign and several payloads, the smallest
    and largest normals and subnormals, then random patterns (every exponent)."""
    special = [0, -2**31, 0x7F800000, -0x00800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, -1, -0x00400000,
               -0x007FFFFF, 1, -2**31 + 1, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, -0x00800001, 0x3F800000, -0x40800000]
    return torch.cat([torch.tensor(special, dtype=torch.int32),
                      torch.randint(-2**31, 2**31, (4096 - len(special),), dtype=torch.int64).to(torch.int32)])


def test_the_key_rule():
    """reference.sort_keys, the one key every class ranks by: unsigned 32-bit, larger for a larger float, NaN lowest
    (0) whatever its sign and payload, -0.0 equal to +0.0; its order is topk_reference's."""
    bits = _special_bits()
    scores = bits.view(torch.float32)
    keys = sort_keys(scores)
    assert keys.dtype == torch.int64 and int(keys.min()) >= 0 and int(keys.max()) < 2**32
    assert (keys[torch.isnan(scores)] == 0).all() and (keys[~torch.isnan(scores)] > 0).all()
    assert sort_keys(torch.tensor([-0.0, 0.0])).unique().numel() == 1
    finite = ~torch.isnan(scores)
    order = scores[finite].double().argsort()
    assert (keys[finite][order].diff() >= 0).all()  # monotone in the value
    assert (keys[finite][order].diff() > 0).sum() == scores[finite].double().unique().numel() - 1  # and strict
    n = torch.tensor([bits.numel()])
    for k in (1, 17, 1000, bits.numel()):
        assert torch.equal(topk(scores[None], n.int(), k), topk_reference(scores[None], n, k))


@pytest.mark.parametrize("device", DEVICES)
def test_the_key_rule_in_every_class(device):
    """Random fp32 bit patterns (NaNs of many payloads, subnormals, both zeros) through the native class
    (csrc/topk/topk.h's ukey) and kvops.topk (on the GPU: the CuTe class for these few long rows, radix_cute.py's
    _ukey) against the reference."""
    from kvops.topk import short_rows_native

    bits = _special_bits()
    scores = torch.stack([bits, bits.flip(0), bits.roll(7), torch.randint(-3, 3, (4096,), dtype=torch.int32)])
    scores = scores.view(torch.float32).to(device)
    lengths = torch.tensor([4096, 4000, 17, 4096], dtype=torch.int32, device=device)
    for k in (1, 300, 2048):
        want = topk_reference(scores.cpu(), lengths.cpu(), k)
        out = torch.empty(4, k, dtype=torch.int32, device=device)
        short_rows_native(scores, lengths, None, k, out)
        assert torch.equal(out.cpu(), want), k
        assert torch.equal(topk(scores, lengths, k).cpu(), want), k


@requires_cuda
def test_the_key_rule_in_cute():
    """radix_cute._ukey, the CuTe copy of the key rule, in a one-line kernel, against reference.sort_keys."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    from kvops.topk.radix_cute import _ukey

    @cute.kernel
    def kernel(mBits: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 256 + tidx
        if i < mBits.shape[0]:
            mOut[i] = _ukey(mBits[i])

    @cute.jit
    def launch(mBits: cute.Tensor, mOut: cute.Tensor):
        kernel(mBits, mOut).launch(grid=[(mBits.shape[0] + 255) // 256, 1, 1], block=[256, 1, 1])

    bits = _special_bits().cuda()
    out = torch.empty_like(bits)
    cute.compile(launch, from_dlpack(bits), from_dlpack(out))(from_dlpack(bits), from_dlpack(out))
    torch.cuda.synchronize()
    assert cutlass is not None and torch.equal(out.cpu().long() & 0xFFFFFFFF, sort_keys(bits.cpu().view(torch.float32)))


def test_kvops_topk_is_the_op_and_the_package_imports():
    """kvops.topk is the function; the package's modules import by name."""
    import sys

    import kvops
    import kvops.topk.reference  # noqa: F401
    from kvops.topk import ops, reference

    assert kvops.topk is ops.topk is sys.modules["kvops.topk"].topk and callable(kvops.topk)
    assert reference.topk_reference is topk_reference and reference is sys.modules["kvops.topk.reference"]


def test_reference_written_out():
    scores = torch.randn(4, 100)
    lengths = torch.tensor([100, 50, 3, 0])
    got = topk_reference(scores, lengths, 10)
    for row in range(2):
        n = int(lengths[row])
        assert torch.equal(got[row].long(), scores[row, :n].topk(10).indices.sort().values)
    assert got[2].tolist() == [0, 1, 2] + [-1] * 7 and got[3].tolist() == [-1] * 10
    ties = torch.tensor([[1.0, 2.0, 2.0, float("nan"), 2.0, -float("inf"), 2.0]])
    assert topk_reference(ties, torch.tensor([7]), 3).tolist() == [[1, 2, 4]]
    assert topk_reference(ties, torch.tensor([7]), 7).tolist() == [[0, 1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N,k", [(1, 1), (7, 3), (300, 64), (1000, 1000), (2500, 700), (513, 2000), (4096, 300),
                                 (4097, 300), (6000, 5000)])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_matches_reference_tie_heavy(device, N, k, with_offsets):
    rows = 6
    scores = _tie_heavy(rows, N, device)
    lengths = torch.randint(0, N + 1, (rows,), dtype=torch.int32)
    lengths[0], lengths[1] = 0, min(1, N)
    lengths = lengths.to(device)
    offsets = torch.randint(0, 5000, (rows,), dtype=torch.int32, device=device) if with_offsets else None
    out = poison_(torch.empty(rows, k, dtype=torch.int32, device=device))
    topk(scores, lengths, k, out, offsets)
    assert torch.equal(out.cpu(), _shifted(topk_reference(scores.cpu(), lengths.cpu(), k), offsets))


@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_topk_on_distinct_values(device):
    rows, N, k = 4, 40_000, 2048
    scores = torch.randn(rows, N, device=device)
    lengths = torch.tensor([N, N - 1, 30_000, 2049], dtype=torch.int32, device=device)
    got = topk(scores, lengths, k)
    for r in range(rows):
        n = int(lengths[r])
        assert torch.equal(got[r].long(), scores[r, :n].topk(k).indices.sort().values)


@requires_cuda
@pytest.mark.parametrize("N,k", [(2176, 2048), (2176, 128), (4096, 2048), (3000, 3000)])
@pytest.mark.parametrize("rows", [8, 140, 300, 1152])
@pytest.mark.parametrize("path", ["topk", "native"])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_short_rows_cuda(N, k, rows, path, with_offsets):
    """Rows of budget + beta keys at serving shapes, through kvops.topk (the CuTe class for fewer rows than SMs,
    the native class from one row per SM) and through the native class directly, whose CTAs hold one, two or four
    rows as the rows per SM grow. The tie-heavy tests above (a few rows) take the CuTe class at the same widths."""
    from kvops.topk import short_rows_native

    scores = torch.randn(rows, N, device="cuda")
    scores[::3] = scores[::3].round()  # ties
    scores[1::7] = _tie_heavy(len(range(1, rows, 7)), N, "cuda")
    scores[2::11] = torch.randn(len(range(2, rows, 11)), N, device="cuda") * 1e-3 + 5  # one top digit
    lengths = torch.randint(0, N + 1, (rows,), dtype=torch.int32, device="cuda")
    lengths[::2] = N
    offsets = torch.randint(0, 1 << 20, (rows,), dtype=torch.int32, device="cuda") if with_offsets else None
    out = poison_(torch.empty(rows, k, dtype=torch.int32, device="cuda"))
    if path == "native":
        short_rows_native(scores, lengths, offsets, k, out)
    else:
        topk(scores, lengths, k, out, offsets)
    assert torch.equal(out.cpu(), _shifted(topk(scores.cpu(), lengths.cpu(), k), offsets))


@requires_cuda
@pytest.mark.parametrize("N,k", [(16_384, 2048), (32_768, 2048), (131_072, 8192), (262_144, 8192)])
@pytest.mark.parametrize("offset", [0, 1])
def test_large_rows_cuda(N, k, offset, cute_call):
    """Rows staged in shared memory (N <= 32k) or swept from global memory; per-thread candidate lists that fit
    or overflow (three distinct values); 16-byte or (offset: rows 4 bytes off alignment) 4-byte staging copies."""
    scores = torch.randn(4, N + offset, device="cuda")[:, offset:]
    scores[1] = scores[1].round()  # many ties
    scores[2] = torch.randint(0, 3, (N,), device="cuda").float()  # the top digit's bin overflows every list
    lengths = torch.tensor([N, N // 2 + 3, N - 1, k - 5], dtype=torch.int32, device="cuda")
    got = topk(scores, lengths, k).cpu()
    cpu = topk(scores.cpu(), lengths.cpu(), k)
    assert torch.equal(got, cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    scores, lengths = _tie_heavy(3, 200, device), torch.tensor([200, 50, 0], dtype=torch.int32, device=device)
    offsets = torch.tensor([7, 0, 3], dtype=torch.int32, device=device)
    out = torch.empty(3, 16, dtype=torch.int32, device=device)
    for o in (None, offsets):
        opcheck(torch.ops.kvops.topk_.default, (scores, lengths, o, 16, out))
    compiled = torch.compile(lambda s, n, o: topk(s, n, 16, offsets=o) + 1, fullgraph=True,
                             backend="aot_eager" if device == "cpu" else "inductor")
    assert torch.equal(compiled(scores, lengths, offsets), topk(scores, lengths, 16, offsets=offsets) + 1)
    into = torch.compile(lambda s, n, o: topk(s, n, 16, out=o), fullgraph=True,
                         backend="aot_eager" if device == "cpu" else "inductor")
    into(scores, lengths, out.fill_(-7))
    assert torch.equal(out, topk(scores, lengths, 16))
    # the aliasing check runs in the op and its fake: a compiled call refuses an out over lengths as eager does
    buf = torch.zeros(3 * 16, dtype=torch.int32, device=device)  # out over lengths: a dtype aot can take
    inside, held = buf.view(3, 16), buf[45:].copy_(lengths)
    fresh = torch.compile(lambda s, n, o: topk(s, n, 16, out=o), fullgraph=True,
                          backend="aot_eager" if device == "cpu" else "inductor")
    for call in (lambda: topk(scores, held, 16, out=inside), lambda: fresh(scores, held, inside)):
        with refused(ValueError, "topk: out shares memory"):
            call()
        assert torch.equal(held, lengths)


@requires_cuda
def test_cuda_graph_replay_fresh_data(cute_call):
    scores = torch.randn(8, 5000, device="cuda")
    lengths = torch.full((8,), 5000, dtype=torch.int32, device="cuda")
    out = torch.empty(8, 300, dtype=torch.int32, device="cuda")
    topk(scores, lengths, 300, out)  # warm-up: compiles the CuTe kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk(scores, lengths, 300, out)
    for _ in range(2):
        scores.copy_(_tie_heavy(8, 5000, "cuda"))
        lengths.copy_(torch.randint(0, 5001, (8,), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), topk_reference(scores.cpu(), lengths.cpu(), 300))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device):
    s, n = torch.randn(2, 10, device=device), torch.tensor([10, 5], dtype=torch.int32, device=device)
    for args, match in [((s.double(), n, 3), "float32"), ((s[0], n, 3), "2-D"), ((s.t(), n[:1].expand(10), 3), "last dim"),
                        ((s, n.long(), 3), "lengths"), ((s, n[:1], 3), "lengths"), ((s, n, -1), "k must be in"),
                        ((s, n, 2.0), "k must be an int"), ((s, n, 2**40), "k must be in"),
                        ((s.to("meta"), n, 3), "meta"), ((s, n[:1].expand(2), 3), "lengths must be contiguous"),
                        ((s, torch.stack([n, n], 1)[:, 0], 3), "lengths must be contiguous")]:
        with pytest.raises((ValueError, TypeError), match=match):
            topk(*args)
    for offsets, match in [(n.long(), "offsets must be int32"), (n[:1], "offsets must be int32 \\[2\\]"),
                           (n[:1].expand(2), "offsets must be contiguous"), (n.to("meta"), "meta")]:
        with pytest.raises(ValueError, match=match):
            topk(s, n, 3, offsets=offsets)
    with pytest.raises(ValueError, match="out shares memory"):
        topk(s, n, 2, s.view(torch.int32).view(-1)[:4].view(2, 2))
    square = torch.zeros(2, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="out shares memory"):
        topk(s, n, 2, square, offsets=square.view(-1)[:2])
    with pytest.raises(ValueError, match="out must be"):
        topk(s, n, 3, torch.empty(2, 4, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N,k", [(1, 1), (7, 3), (300, 64), (1000, 1000), (2176, 2048), (2176, 128), (513, 2000),
                                 (4096, 300)])
def test_short_rows_native_matches_reference(device, N, k):
    """kvops::topk_short_rows_ (csrc/topk, one warp per row on the GPU): tie-heavy rows, one shared top digit,
    all-equal rows, lengths 0, 1 and ragged."""
    from kvops.topk import short_rows_native

    rows = 40 if device == "cuda" else 6
    scores = _tie_heavy(rows, N, device)
    scores[1] = torch.randn(N, device=device) * 1e-3 + 5
    scores[2] = 2.0
    scores[3] = torch.randn(N, device=device)
    lengths = torch.randint(0, N + 1, (rows,), dtype=torch.int32)
    lengths[0], lengths[4], lengths[1:4] = 0, min(1, N), N
    lengths = lengths.to(device)
    offsets = torch.randint(-50, 1 << 20, (rows,), dtype=torch.int32, device=device)
    out = poison_(torch.empty(rows, k, dtype=torch.int32, device=device))
    short_rows_native(scores, lengths, offsets, k, out)
    assert torch.equal(out.cpu(), _shifted(topk_reference(scores.cpu(), lengths.cpu(), k), offsets))
    for o in (None, offsets):
        opcheck(torch.ops.kvops.topk_short_rows_.default, (scores, lengths, o, k, out))


@requires_cuda
def test_short_rows_native_after_a_narrower_launch():
    """A narrower row asks for less shared memory; a wider one after it must still launch (the opt-in only grows)."""
    from kvops.topk import short_rows_native

    for N in (4096, 3000, 4096):
        scores = _tie_heavy(8, N, "cuda")
        lengths = torch.full((8,), N, dtype=torch.int32, device="cuda")
        out = poison_(torch.empty(8, 300, dtype=torch.int32, device="cuda"))
        short_rows_native(scores, lengths, None, 300, out)
        assert torch.equal(out.cpu(), topk_reference(scores.cpu(), lengths.cpu(), 300))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", ["short_rows_native", "long_rows_native"])
def test_native_classes_bad_arguments(device, native):
    """Both native classes share their host checks; only the short-row class bounds the width."""
    from kvops.topk import ops

    call = getattr(ops, native)

    s = torch.randn(4, 100, device=device)
    n = torch.full((4,), 100, dtype=torch.int32, device=device)
    out = torch.empty(4, 10, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="scores must be float32"):
        call(s.double(), n, None, 10, out)
    with pytest.raises(TypeError, match="lengths and out must be int32"):
        call(s, n.long(), None, 10, out)
    if native == "short_rows_native":
        with pytest.raises(ValueError, match="at most 4096 keys"):
            call(torch.randn(4, 4097, device=device), n, None, 10, out)
    with pytest.raises(ValueError, match="lengths must be contiguous"):
        call(s, n[:3], None, 10, out)
    with pytest.raises(ValueError, match="out must be contiguous"):
        call(s, n, None, 9, out)
    with pytest.raises(ValueError, match="k must be in"):
        call(s, n, None, 0, out[:, :0])
    square = torch.randn(4, 10, device=device)
    with pytest.raises(ValueError, match="out overlaps"):
        call(square, n, None, 10, square.view(torch.int32))
    with pytest.raises(TypeError, match="offsets must be int32"):
        call(s, n, n.long(), 10, out)
    with pytest.raises(ValueError, match="offsets must be contiguous"):
        call(s, n, n[:3], 10, out)
    with pytest.raises(ValueError, match="out overlaps offsets"):
        call(s, n, out.view(-1)[:4], 10, out)


# ---- issue 30: bad input, second pass ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_offsets_out_of_range_are_refused_where_checked(device):
    """An offset below 0 can turn a kept index into -1 (the padding value), and index + offset past int32 wraps:
    offsets must lie in [0, 2**31 - N]. Host offsets are always checked; device offsets (read on the device, like
    lengths) only with validate=True or KVOPS_DEBUG=1, which read them back."""
    N = 40
    scores = torch.randn(3, N, device=device)
    lengths = torch.randint(1, N + 1, (3,), dtype=torch.int32, device=device)
    good = torch.randint(0, 1000, (3,), dtype=torch.int32, device=device)
    good[2] = 2**31 - N  # the largest: index N - 1 lands on int32 max
    want = _shifted(topk_reference(scores.cpu(), lengths.cpu(), 5), good)
    assert torch.equal(topk(scores, lengths, 5, offsets=good, validate=True).cpu(), want)
    for row, value, match in [(1, -1, r"topk: offsets\[1\] = -1 is outside \[0, 2147483608\]"),
                              (2, 2**31 - N + 1, r"topk: offsets\[2\] = 2147483609 is outside")]:
        bad = good.clone()
        bad[row] = value
        out = torch.full((3, 5), 7, dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match=match):
            topk(scores, lengths, 5, out, bad, validate=True)
        assert (out == 7).all()
        if device == "cpu":
            with pytest.raises(ValueError, match=match):
                topk(scores, lengths, 5, out, bad)
        else:
            topk(scores, lengths, 5, out, bad)  # trusted without validate: no sync
            os.environ["KVOPS_DEBUG"] = "1"
            try:
                with pytest.raises(ValueError, match=match):
                    topk(scores, lengths, 5, out, bad)
            finally:
                del os.environ["KVOPS_DEBUG"]
    with pytest.raises(TypeError, match="topk: validate must be a bool"):
        topk(scores, lengths, 5, offsets=good, validate=1)


def _long_rows(rows, N, k, device):
    """Rows that exercise the multi-CTA class: every slice count, one shared top digit, values packed into one
    second digit, ties that straddle slices, NaN and infinities, and lengths 0, 1, k, k + 1, short and ragged."""
    scores = torch.randn(rows, N)
    scores[0] = _tie_heavy(1, N, "cpu")[0]
    if rows > 1:
        scores[1] = torch.rand(N) * 1e-3 + 5  # one top digit, few second ones
    if rows > 2:
        scores[2] = 2.0  # all equal: the first k indices win
    if rows > 3:
        scores[3] = torch.randint(0, 3, (N,)).float()
    lengths = torch.randint(0, N + 1, (rows,), dtype=torch.int32)
    lengths[: min(rows, 4)] = N
    for row, n in zip(range(4, rows), (0, 1, k, k + 1)):
        lengths[row] = min(n, N)
    return scores.to(device), lengths.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,N,k", [(1, 1, 1), (3, 5000, 300), (8, 2048, 2047), (2, 70_001, 2048),
                                      (9, 33_000, 2048), (3, 50_000, 10_000), (6, 9000, 9000), (5, 4100, 5000),
                                      (200, 6000, 64), (140, 12_000, 300), (100, 20_000, 3000)])
@pytest.mark.parametrize("aligned", [True, False])
def test_long_rows_native_matches_reference(device, rows, N, k, aligned):
    """kvops::topk_long_rows_ (csrc/topk, several CTAs a row on the GPU) against the reference: one slice or
    many, slices held in registers or partly read again (the last two shapes on a GPU of 132 SMs), k below, at
    and above the length, rows 16-byte aligned or not (the GPU's vector or scalar loads), with
    and without offsets; the output poisoned first, so a slot the kernel misses shows."""
    from kvops.topk import long_rows_native

    scores, lengths = _long_rows(rows, N + (not aligned), k, device)
    if not aligned:
        scores = scores[:, 1:]
        lengths = lengths.clamp(max=N)
    want = topk_reference(scores.cpu(), lengths.cpu(), k)
    for offsets in (None, torch.randint(0, 1 << 20, (rows,), dtype=torch.int32, device=device)):
        out = poison_(torch.empty(rows, k, dtype=torch.int32, device=device))
        long_rows_native(scores, lengths, offsets, k, out)
        assert torch.equal(out.cpu(), _shifted(want, offsets))
    opcheck(torch.ops.kvops.topk_long_rows_.default, (scores, lengths, offsets, k, out))


@requires_cuda
def test_long_rows_native_graph_replay_fresh_data():
    """Captured once, replayed on new scores and lengths: the workspace comes from the graph's pool and is zeroed
    in the graph."""
    from kvops.topk import long_rows_native

    scores, lengths = _long_rows(8, 40_000, 2048, "cuda")
    out = torch.empty(8, 2048, dtype=torch.int32, device="cuda")
    long_rows_native(scores, lengths, None, 2048, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        long_rows_native(scores, lengths, None, 2048, out)
    for seed in range(2):
        torch.manual_seed(seed)
        fresh, fresh_lengths = _long_rows(8, 40_000, 2048, "cuda")
        scores.copy_(fresh)
        lengths.copy_(fresh_lengths.flip(0))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), topk_reference(scores.cpu(), lengths.cpu(), 2048))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", ["short_rows_native", "long_rows_native"])
def test_native_classes_take_padded_rows(device, native):
    """A scores view whose rows are padded (row stride above the width) is read in place, not refused as
    overlapping the output."""
    from kvops.topk import ops

    rows = 140 if device == "cuda" else 5
    scores = torch.randn(rows, 2003, device=device)[:, :2000]
    lengths = torch.randint(0, 2001, (rows,), dtype=torch.int32, device=device)
    out = poison_(torch.empty(rows, 100, dtype=torch.int32, device=device))
    getattr(ops, native)(scores, lengths, None, 100, out)
    assert torch.equal(out.cpu(), topk_reference(scores.cpu(), lengths.cpu(), 100))
