"""NVFP4 primitives: kvops.nvfp4.quantize / dequantize against the float64 reference."""

import math

import pytest
import torch

from kvops.nvfp4 import dequantize, quantize
from kvops.nvfp4 import reference as ref

from conftest import DEVICES, HAS_CUDA, bytes_of, opcheck, requires_cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
SCALES = [None, 1.0, 0.25, 64.0, 2.0**-20, 37.5, 1e-3, 3e5]


def _data(shape, dtype, device="cpu", kind="normal"):
    if kind == "normal":
        x = torch.randn(shape) * 3
    elif kind == "lognormal":  # heavy tailed, wide dynamic range
        x = torch.randn(shape).sign() * torch.exp(torch.randn(shape) * 2.5)
    elif kind == "outliers":
        x = torch.randn(shape)
        x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 50),))] *= 1000
    elif kind == "tiny":
        x = torch.randn(shape) * 1e-6
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-448, 448)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    return x.to(dtype).to(device)


def _g(v, device):
    return None if v is None else torch.tensor(v, dtype=torch.float32, device=device)


def _check_against_reference(x, g):
    p, s = quantize(x, g)
    rp, rs = ref.quantize(x.cpu(), None if g is None else g.cpu())
    assert torch.equal(p.cpu(), rp), f"codes differ at {(p.cpu() != rp).nonzero()[:5].tolist()}"
    assert torch.equal(bytes_of(s), bytes_of(rs))
    for dt in DTYPES:
        d = dequantize(p, s, g, dt)
        rd = ref.dequantize(rp, rs, None if g is None else g.cpu(), dt)
        assert d.dtype == dt and d.shape == x.shape
        assert torch.equal(bytes_of(d), bytes_of(rd)), f"dequantize to {dt} differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "lognormal", "outliers", "tiny"])
def test_matches_reference(device, dtype, kind):
    shape = [(3, 5, 48), (1, 16), (33, 256), (7, 576)][torch.randint(0, 4, ()).item()]
    x = _data(shape, dtype, device, kind)
    for g in SCALES:
        _check_against_reference(x, _g(g, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_values(device, dtype):
    """All-zero blocks, NaN/Inf, exact rounding ties, subnormal and saturated block scales."""
    rows = []
    rows.append(torch.zeros(16))
    nan = torch.randn(16)
    nan[5] = float("nan")
    rows.append(nan)
    inf = torch.randn(16)
    inf[3] = float("inf")
    inf[9] = -float("inf")
    rows.append(inf)
    # Every E2M1 tie: the block max 6 makes s = 1, so k + 0.5-step midpoints are exact ties.
    rows.append(torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]))
    rows.append(torch.tensor([6.0 * 1.5, 0.25 * 1.5, 0.75 * 1.5, 1.25 * 1.5, 1.75 * 1.5, 2.5 * 1.5, 3.5 * 1.5, 5.0 * 1.5] * 2))
    rows.append(torch.full((16,), 1e-4))           # subnormal E4M3 scale
    rows.append(torch.full((16,), 1e-9))           # scale underflows to 0 -> codes 0
    rows.append(torch.linspace(-3000, 3000, 16))   # scale saturates at 448
    x = torch.stack(rows).to(dtype).to(device)
    for g in [None, 1.0, 8.0, 37.5]:
        _check_against_reference(x, _g(g, device))
    p, s = quantize(x)
    assert bytes_of(s)[1].item() == 0x7F and int(p[1].abs().sum()) == 0  # NaN block
    assert dequantize(p, s)[1].isnan().all()
    assert not dequantize(p, s)[0].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_every_bit_pattern(device, dtype):
    """Every value of the dtype, 16 to a block, in bit-pattern order and shuffled."""
    n = 1 << (8 * dtype.itemsize)
    bits = torch.arange(n, dtype=torch.int32).to(torch.int16 if n > 256 else torch.uint8)
    x = bits.view(dtype).reshape(-1, 16 * 16)
    for xs in (x, x.reshape(-1)[torch.randperm(n)].reshape(x.shape)):
        xs = xs.to(device)
        for g in [None, 4.0]:
            _check_against_reference(xs, _g(g, device))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_and_cuda_bytes_identical(dtype):
    x = _data((1000, 128), dtype, "cpu", "lognormal")
    for g in SCALES[1:]:
        gc, gg = _g(g, "cpu"), _g(g, "cuda")
        pc, sc = quantize(x, gc)
        pg, sg = quantize(x.cuda(), gg)
        assert torch.equal(pc, pg.cpu()) and torch.equal(bytes_of(sc), bytes_of(sg))
        for dt in DTYPES:
            assert torch.equal(bytes_of(dequantize(pc, sc, gc, dt)), bytes_of(dequantize(pg, sg, gg, dt)))


@requires_cuda
def test_cuda_global_scale_on_host_or_device():
    x = _data((64, 64), torch.bfloat16, "cuda")
    a = quantize(x, torch.tensor(3.0))
    b = quantize(x, torch.tensor(3.0, device="cuda"))
    assert torch.equal(a[0], b[0]) and torch.equal(bytes_of(a[1]), bytes_of(b[1]))


def test_relative_error_is_nvfp4_sized():
    x = torch.randn(4096, 128)
    p, s = quantize(x)
    err = (dequantize(p, s, dtype=torch.float32) - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()
    assert 0.05 < err < 0.15  # 3-bit mantissa-ish: ~9-10% RMS on Gaussian data


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = _data((4, 64), torch.bfloat16, device)
    g = _g(2.0, device)
    opcheck(torch.ops.kvops.nvfp4_quantize.default, (x, g))
    opcheck(torch.ops.kvops.nvfp4_quantize.default, (x, None))
    p, s = quantize(x, g)
    for dt in DTYPES:
        opcheck(torch.ops.kvops.nvfp4_dequantize.default, (p, s, g, dt))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def roundtrip(x, g):
        p, s = quantize(x, g)
        return dequantize(p, s, g, torch.float16)

    x = _data((8, 128), torch.bfloat16, device)
    g = _g(4.0, device)
    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert torch.equal(bytes_of(compiled(x, g)), bytes_of(roundtrip(x, g)))


@requires_cuda
def test_cuda_graph_replay_fresh_data():
    x = _data((256, 128), torch.bfloat16, "cuda")
    g = torch.tensor(2.0, device="cuda")
    quantize(x, g)  # warm up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p, s = quantize(x, g)
        y = dequantize(p, s, g, torch.bfloat16)
    for _ in range(3):
        x.copy_(_data((256, 128), torch.bfloat16, "cuda", "lognormal"))
        g.fill_(float(torch.empty(()).uniform_(0.5, 100)))
        graph.replay()
        rp, rs = ref.quantize(x.cpu(), g.cpu())
        assert torch.equal(p.cpu(), rp) and torch.equal(bytes_of(s), bytes_of(rs))
        assert torch.equal(bytes_of(y), bytes_of(ref.dequantize(rp, rs, g.cpu(), torch.bfloat16)))


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    x = _data((4, 32), torch.bfloat16, device)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(x[:, :24])
    with pytest.raises(ValueError, match="x dtype"):
        quantize(x.to(torch.int32))
    with pytest.raises(ValueError, match="global_scale"):
        quantize(x, torch.tensor([1.0, 2.0], device=device))
    with pytest.raises(ValueError, match="global_scale"):
        quantize(x, torch.tensor(2.0, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="positive"):
        quantize(x, torch.tensor(-1.0))
    p, s = quantize(x)
    with pytest.raises(ValueError, match="scales shape"):
        dequantize(p, s[:, :1])
    with pytest.raises(ValueError, match="packed must be uint8"):
        dequantize(p.to(torch.int32), s)
    with pytest.raises(ValueError, match="scales must be float8_e4m3fn"):
        dequantize(p, s.view(torch.uint8))
    with pytest.raises(ValueError, match="dtype"):
        dequantize(p, s, dtype=torch.int32)
    if HAS_CUDA and device == "cpu":
        with pytest.raises(ValueError, match="global_scale is on"):
            quantize(x, torch.tensor(1.0, device="cuda"))


def test_reference_tie_rule_is_round_half_even():
    q = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, math.inf], dtype=torch.float64)
    assert ref.e2m1_round(q.clamp(max=6)).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 7]
