"""Plain-torch reference of the NVFP4 semantics and the cold-page codec (float64 where it matters).

Independent of csrc/: E4M3 rounding comes from torch's float8 conversion, E2M1 rounding from a
nearest-grid-point search, and every fp32 step of the definition is computed in float64 and then
rounded once to float32 (innocuous for a single *, / since 53 >= 2*24 + 2).
"""

from __future__ import annotations

import math

import torch

from .layout import PoolLayout, plan_layout

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
_EVEN_FIRST = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # argmin takes the first minimum: ties -> even code
_CANONICAL_NAN = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float8_e4m3fn: 0x7F, torch.float32: 0x7FC00000}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.float64)


def e4m3_rn_satfinite(v: torch.Tensor) -> torch.Tensor:
    """float64 -> E4M3 (fn) bytes, RNE, saturating at +-448 (Inf too); NaN -> 0x7f."""
    v32 = v.to(torch.float32)
    sat = torch.where(v32.isnan(), v32, v32.clamp(-448.0, 448.0))
    out = sat.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(v32.isnan(), torch.full_like(out, 0x7F), out)


def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


def e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """|q| (float64, non-negative) -> E2M1 magnitude code, nearest with ties to even, saturating at 6."""
    d = (q.unsqueeze(-1) - E2M1_GRID[_EVEN_FIRST]).abs()
    return _EVEN_FIRST[d.argmin(-1)].to(torch.uint8)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)


def quantize_blocks(x64: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x64: [..., nb, 16] exact float64 values. Returns codes uint8 [..., nb, 16] and scale bytes [..., nb]."""
    nan_block = x64.isnan().any(-1)
    amax = torch.where(x64.isnan(), 0.0, x64.abs()).amax(-1)
    y = _f32(x64 * g)  # one fp32 rounding
    ymax = _f32(amax * g)
    scale = e4m3_rn_satfinite(_f32(ymax / 6.0))
    scale = torch.where(nan_block, torch.full_like(scale, 0x7F), scale)
    s = e4m3_value(scale).unsqueeze(-1)
    q = _f32(y.abs() / torch.where(s == 0, torch.ones_like(s), s)).clamp(max=6.0)  # beyond 6 saturates
    codes = e2m1_round(q) | (torch.signbit(y).to(torch.uint8) << 3)
    zero = (s == 0) | nan_block.unsqueeze(-1)
    codes = torch.where(zero, torch.zeros_like(codes), codes)
    return codes, scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, g: float) -> torch.Tensor:
    """codes [..., nb, 16], scale bytes [..., nb] -> fp32-rounded float64 values (NaN for NaN blocks)."""
    mag = E2M1_GRID[(codes & 7).long()] * e4m3_value(scale).unsqueeze(-1)
    v = _f32(mag / g)
    return torch.where((codes & 8).bool(), -v, v)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.reshape(*codes.shape[:-2], -1)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    c = torch.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    return _blocks(c)


def to_dtype(v64: torch.Tensor, dtype: torch.dtype, nan_mask: torch.Tensor | None = None) -> torch.Tensor:
    """float64 (already fp32-exact) -> dtype by RNE; fp8 saturates; NaN positions get the canonical NaN."""
    v = v64.to(torch.float32)
    if dtype == torch.float8_e4m3fn:
        v = torch.where(v.isnan(), v, v.clamp(-448.0, 448.0))
    out = v.to(dtype)
    nan = v.isnan() if nan_mask is None else (nan_mask | v.isnan())
    iv = out.view(_INT_VIEW[out.element_size()])
    canon = torch.tensor(_CANONICAL_NAN[dtype], dtype=torch.int64).to(iv.dtype)
    return torch.where(nan, canon, iv).view(dtype)


def quantize(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = 1.0 if global_scale is None else float(global_scale)
    codes, scale = quantize_blocks(_blocks(x.to(torch.float64)), g)
    return pack_nibbles(codes), scale.view(torch.float8_e4m3fn)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = 1.0 if global_scale is None else float(global_scale)
    sc = scales.view(torch.uint8)
    v = dequantize_blocks(unpack_nibbles(packed), sc, g)
    nan = (sc == 0x7F).unsqueeze(-1).expand_as(v)
    return to_dtype(v.reshape(*v.shape[:-2], -1), dtype, nan.reshape(*v.shape[:-2], -1))


# ---- cold-page codec -------------------------------------------------------------------------------

def page_global_scale(amax: float, policy) -> float:
    if not isinstance(policy, str):
        return float(torch.tensor(policy, dtype=torch.float32))
    if policy == "identity" or not (0 < amax < float("inf")):
        return 1.0
    g = float(torch.tensor(2688.0 / amax, dtype=torch.float64).to(torch.float32))
    g = min(max(g, 2.0 ** -64), 2.0 ** 64)
    if policy == "per_page_pow2":
        g = 2.0 ** (math.frexp(g)[1] - 1)
    return g


def _plane_rows(pool_page: torch.Tensor, lay: PoolLayout) -> torch.Tensor:
    """pool[page] -> [planes, rows, row] in the blob's row order."""
    t = pool_page
    if lay.spec.plane_dim:
        t = t.movedim(lay.spec.plane_dim - 1, 0)
    else:
        t = t.unsqueeze(0)
    return t.reshape(lay.planes, lay.rows, t.shape[-1])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def encode_page(pool_page: torch.Tensor, lay: PoolLayout) -> torch.Tensor:
    """One pool's section of a blob for one page."""
    sec = torch.zeros(lay.section_bytes, dtype=torch.uint8)
    sec[:4] = torch.tensor(list(lay.tag.to_bytes(4, "little")), dtype=torch.uint8)  # the layout tag
    q0, ql = lay.spec.quantized_range
    r0, rl = lay.spec.residual_range or (0, 0)
    for p, rows in enumerate(_plane_rows(pool_page, lay)):
        x64 = rows[:, q0:q0 + ql].to(torch.float64)
        amax = x64.abs().max().item() if ql else 0.0
        g = page_global_scale(amax, lay.spec.global_scale)
        sec[4 + 4 * p:8 + 4 * p] = torch.tensor([g], dtype=torch.float32).view(torch.uint8)
        base = lay.plane_offset + p * lay.plane_bytes
        codes, scale = quantize_blocks(_blocks(x64), g)
        sec[base + lay.off_codes:][:rows.shape[0] * ql // 2] = pack_nibbles(codes).reshape(-1)
        sec[base + lay.off_scales:][:scale.numel()] = scale.reshape(-1)
        if rl:
            b0, b1 = (r0 - q0) // 16, (r0 - q0 + rl) // 16
            res = _f32(_blocks(x64)[:, b0:b1] - dequantize_blocks(codes[:, b0:b1], scale[:, b0:b1], g))
            rcodes, rscale = quantize_blocks(res, g)
            sec[base + lay.off_rcodes:][:rows.shape[0] * rl // 2] = pack_nibbles(rcodes).reshape(-1)
            sec[base + lay.off_rscales:][:rscale.numel()] = rscale.reshape(-1)
        lossless = torch.cat([rows[:, :q0], rows[:, q0 + ql:]], -1)
        lb = _bytes(lossless)
        sec[base + lay.off_lossless:][:lb.numel()] = lb
    return sec


def decode_page(section: torch.Tensor, lay: PoolLayout) -> torch.Tensor:
    """A blob section -> pool[page] contents (the pool's page shape and dtype)."""
    shape, dtype = lay.shape, lay.dtype
    row = shape[-1]
    q0, ql = lay.spec.quantized_range
    r0, rl = lay.spec.residual_range or (0, 0)
    planes = []
    for p in range(lay.planes):
        g = section[4 + 4 * p:8 + 4 * p].view(torch.float32).item()
        base = lay.plane_offset + p * lay.plane_bytes
        esize = dtype.itemsize
        ll = (row - ql) * esize * lay.rows
        lossless = section[base + lay.off_lossless:][:ll].view(dtype).reshape(lay.rows, row - ql)
        out = torch.empty(lay.rows, row, dtype=dtype)
        out[:, :q0] = lossless[:, :q0]
        out[:, q0 + ql:] = lossless[:, q0:]
        if ql:
            nb = ql // 16
            codes = unpack_nibbles(section[base + lay.off_codes:][:lay.rows * ql // 2].reshape(lay.rows, ql // 2))
            scale = section[base + lay.off_scales:][:lay.rows * nb].reshape(lay.rows, nb)
            v = dequantize_blocks(codes, scale, g)
            nan = (scale == 0x7F).unsqueeze(-1).expand_as(v).clone()
            if rl:
                b0, b1 = (r0 - q0) // 16, (r0 - q0 + rl) // 16
                rc = unpack_nibbles(section[base + lay.off_rcodes:][:lay.rows * rl // 2].reshape(lay.rows, rl // 2))
                rs = section[base + lay.off_rscales:][:lay.rows * rl // 16].reshape(lay.rows, rl // 16)
                v[:, b0:b1] = _f32(v[:, b0:b1] + dequantize_blocks(rc, rs, g))
                nan[:, b0:b1] |= (rs == 0x7F).unsqueeze(-1)
            out[:, q0:q0 + ql] = to_dtype(v.reshape(lay.rows, ql), dtype, nan.reshape(lay.rows, ql))
        planes.append(out)
    t = torch.stack(planes)  # [planes, rows, row]
    mid = [s for k, s in enumerate(shape[1:-1], start=1) if k != lay.spec.plane_dim]
    t = t.reshape(lay.planes, *mid, row)
    if lay.spec.plane_dim:
        return t.movedim(0, lay.spec.plane_dim - 1)
    return t.squeeze(0)


def encode_pages(pools, specs, cold_pages: torch.Tensor, page_pairs: torch.Tensor) -> None:
    layouts, nbytes = plan_layout([(p.shape, p.dtype) for p in pools], specs)
    for slot, page in page_pairs.tolist():
        blob = torch.zeros(nbytes, dtype=torch.uint8)
        for pool, lay in zip(pools, layouts):
            blob[lay.section_offset:lay.section_offset + lay.section_bytes] = encode_page(pool[page].cpu(), lay)
        cold_pages[slot] = blob.to(cold_pages.device)


def decode_pages(cold_pages: torch.Tensor, pools, specs, page_pairs: torch.Tensor) -> None:
    layouts, _ = plan_layout([(p.shape, p.dtype) for p in pools], specs)
    for page, slot in page_pairs.tolist():
        blob = cold_pages[slot].cpu()
        for pool, lay in zip(pools, layouts):
            if int.from_bytes(bytes(blob[lay.section_offset:lay.section_offset + 4].tolist()), "little") != lay.tag:
                continue  # written under another layout: left untouched, as the kernels leave it
            pool[page] = decode_page(blob[lay.section_offset:lay.section_offset + lay.section_bytes], lay).to(pool.device)
