"""Row specs and the cold-page blob layout (the one place that computes it).

A cold page is one fixed-size blob holding the rows of one page index across every configured
pool. Blob layout, all offsets 16-byte aligned, all padding zero::

    blob     = section(pool 0) | section(pool 1) | ... | zero padding to 16
    section  = g table: u32 layout tag, then fp32 global scale per plane, padded to 16
             | plane 0 | plane 1 | ...                         (planes: the K/V plane dim, else 1)
    plane    = codes     rows x q_len/2      packed E2M1, element 2i in the low nibble   (pad 16)
             | rcodes    rows x r_len/2      2FP4 residual component codes               (pad 16)
             | scales    rows x q_len/16     E4M3 block scales                           (pad 16)
             | rscales   rows x r_len/16     residual block scales                       (pad 16)
             | lossless  rows x (row - q_len) elements, bit-exact, hot dtype (prefix then suffix)

Rows of a plane are the pool's middle dims other than the plane dim, in row-major order. The layout tag (a hash
of the section's plan, never 0) says which layout wrote the section: decode refuses a section whose tag is not its
own, as it refuses a global scale encode never writes (a blob of another codec of the same size, or a slot never
encoded).
"""

from __future__ import annotations

import operator
import struct
import zlib
from dataclasses import dataclass

import torch

HOT_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
SCALE_POLICIES = ("identity", "per_page", "per_page_pow2")
DEFAULT_SCALE = "per_page_pow2"
MAX_MIDDLE_DIMS = 4  # plane dim + 3 others (csrc/nvfp4/codec.h: kMaxOtherDims)

# csrc/nvfp4/codec.h: PlanField
PLAN_FIELDS = 16
_SCALE_KIND = {"identity": 0, "per_page": 1, "per_page_pow2": 2}


def _pad16(n: int) -> int:
    return (n + 15) & ~15


@dataclass(frozen=True)
class RowSpec:
    """How one pool's rows are stored in a cold page.

    quantized_range: (start, length) in elements; one contiguous run, multiples of 16; (0, 0) makes
        the pool lossless. Everything outside it is copied bit-exactly.
    residual_range: optional (start, length) inside the quantized run, stored as two NVFP4
        components (2FP4): the second quantizes the rounding error of the first (for RoPE dims).
    global_scale: "per_page_pow2" (default: g = 2688/amax of the page's plane, rounded down to a
        power of two), "per_page" (g = 2688/amax exactly), "identity" (g = 1), or a fixed float.
    plane_dim: the pool dim holding K/V (per-page scales are per plane); None for a single plane.
    """

    quantized_range: tuple[int, int] = (0, 0)
    residual_range: tuple[int, int] | None = None
    global_scale: str | float = DEFAULT_SCALE
    plane_dim: int | None = None

    @classmethod
    def lossless(cls, plane_dim: int | None = None) -> "RowSpec":
        return cls((0, 0), plane_dim=plane_dim)

    @classmethod
    def full(cls, row_size: int, **kw) -> "RowSpec":
        """Quantize the whole row."""
        return cls((0, row_size), **kw)

    @classmethod
    def for_rope(cls, row_size: int, rope_range: tuple[int, int] | None, *, skip_rope_quantization: bool = False,
                 rope_residual: bool = False, **kw) -> "RowSpec":
        """A row with RoPE dims at rope_range: quantize them, keep them lossless (skip), or 2FP4 (residual)."""
        if skip_rope_quantization and rope_residual:
            raise ValueError("rope policy: skip_rope_quantization and rope_residual exclude each other")
        if isinstance(row_size, bool) or not isinstance(row_size, int):
            raise TypeError(f"rope policy: row_size must be an int, got {row_size!r}")
        if rope_range is not None and (not isinstance(rope_range, (tuple, list)) or len(rope_range) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in rope_range)):
            raise TypeError(f"rope policy: rope_range must be a (start, length) pair of ints or None, got "
                            f"{rope_range!r}")
        if not rope_range or rope_range[1] == 0:
            return cls((0, row_size), **kw)
        start, length = rope_range
        if start < 0 or length < 0 or start + length > row_size:
            raise ValueError(f"rope_range {rope_range} lies outside a row of {row_size}")
        if rope_residual:
            return cls((0, row_size), residual_range=(start, length), **kw)
        if not skip_rope_quantization:
            return cls((0, row_size), **kw)
        if length == row_size:
            raise ValueError("rope policy: the whole row is RoPE, so skip_rope_quantization leaves nothing to quantize")
        if start != 0 and start + length != row_size:
            raise ValueError(f"rope policy: RoPE at {rope_range} is in the middle of a row of {row_size}; "
                             "skipping it would need two quantized runs")
        return cls((length, row_size - length) if start == 0 else (0, start), **kw)


@dataclass(frozen=True)
class PoolLayout:
    """One pool's section of the blob (byte offsets)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: RowSpec
    planes: int
    rows: int  # rows per plane
    section_offset: int
    plane_offset: int
    plane_bytes: int
    off_codes: int
    off_rcodes: int
    off_scales: int
    off_rscales: int
    off_lossless: int
    scale_bits: int = 0  # fp32 bits of a fixed g

    @property
    def section_bytes(self) -> int:
        return self.plane_offset + self.planes * self.plane_bytes

    def plan(self) -> list[int]:
        """This pool's entries of the op's int[] plan (csrc/nvfp4/codec.h: PlanField order)."""
        q0, ql = self.spec.quantized_range
        r0, rl = self.spec.residual_range or (0, 0)
        kind = _SCALE_KIND.get(self.spec.global_scale, 0) if isinstance(self.spec.global_scale, str) else 0
        fields = [q0, ql, r0, rl, self.spec.plane_dim or 0, kind, self.scale_bits, self.section_offset,
                  self.plane_offset, self.plane_bytes, self.off_codes, self.off_rcodes, self.off_scales,
                  self.off_rscales, self.off_lossless]
        # the layout tag (uint32, as the blob holds it): a CRC-32 of the other fields, the shape and the dtype
        return fields + [zlib.crc32(repr((fields, self.shape, str(self.dtype))).encode()) or 1]

    @property
    def tag(self) -> int:
        """The section's layout tag (the plan's last field), never 0."""
        return self.plan()[-1]


def _check_spec(i: int, shape: tuple[int, ...], dtype: torch.dtype, spec: RowSpec) -> None:
    def bad(msg, error=ValueError):
        raise error(f"pools[{i}] (shape {tuple(shape)}, {dtype}): {msg}")

    if not isinstance(spec, RowSpec):
        bad(f"spec must be a RowSpec, got {type(spec).__name__}", TypeError)
    if not isinstance(dtype, torch.dtype):
        bad(f"dtype must be a torch.dtype, got {type(dtype).__name__}", TypeError)
    if len(shape) < 2:
        bad("a pool needs a page dim (0) and a row dim (last)")
    if len(shape) - 2 > MAX_MIDDLE_DIMS:
        bad(f"at most {MAX_MIDDLE_DIMS} dims between page and row are supported")
    for k, n in enumerate(shape):
        if n < 0:
            bad(f"dim {k} is negative")
        if n == 0 and k > 0:  # no pages is a pool with nothing to move yet; an empty row dim has no rows
            bad(f"dim {k} is empty; every dim but the page dim (0) needs at least one element")

    def int_pair(name, value):
        ok = isinstance(value, (tuple, list)) and len(value) == 2 and \
            all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok:
            bad(f"{name} must be a (start, length) pair of ints, got {value!r}", TypeError)

    int_pair("quantized_range", spec.quantized_range)
    if spec.residual_range is not None:
        int_pair("residual_range", spec.residual_range)
    if spec.plane_dim is not None and (isinstance(spec.plane_dim, bool) or not isinstance(spec.plane_dim, int)):
        bad(f"plane_dim must be an int or None, got {spec.plane_dim!r}", TypeError)
    row = shape[-1]
    esize = dtype.itemsize
    if (row * esize) % 16:
        bad(f"rows of {row * esize} bytes are not a multiple of 16")
    q0, ql = spec.quantized_range
    if q0 < 0 or ql < 0 or q0 % 16 or ql % 16:
        bad(f"quantized_range {spec.quantized_range} must be non-negative multiples of 16")
    if q0 + ql > row:
        bad(f"quantized_range {spec.quantized_range} runs outside the row of {row}")
    if ql and dtype not in HOT_DTYPES:
        bad("only bfloat16, float16 and float8_e4m3fn rows can be quantized; quantized_range must be empty")
    if spec.residual_range is not None:
        r0, rl = spec.residual_range
        if r0 % 16 or rl % 16 or rl <= 0:
            bad(f"residual_range {spec.residual_range} must be positive multiples of 16")
        if r0 < q0 or r0 + rl > q0 + ql:
            bad(f"residual_range {spec.residual_range} lies outside quantized_range {spec.quantized_range}")
    if spec.plane_dim is not None and not 1 <= spec.plane_dim <= len(shape) - 2:
        bad(f"plane_dim {spec.plane_dim} is not a dim between page and row")
    if spec.plane_dim is None and len(shape) - 2 > MAX_MIDDLE_DIMS - 1:
        bad(f"at most {MAX_MIDDLE_DIMS - 1} dims between page and row are supported besides the plane dim (a pool "
            f"with no plane_dim has none)")
    g = spec.global_scale
    if isinstance(g, str):
        if g not in SCALE_POLICIES:
            bad(f"global_scale {g!r} is not one of {SCALE_POLICIES} or a positive float")
    elif isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g < float("inf")):
        bad(f"global_scale {g!r} must be a positive finite float")
    elif not 0 < (float(torch.tensor(float(g), dtype=torch.float32)) if g < 2.0**128 else float("inf")) < float("inf"):
        bad(f"global_scale {g!r} is not a positive finite float32")


def _shape_and_dtype(i: int, pool) -> tuple[tuple[int, ...], torch.dtype]:
    """plan_layout's pools[i] as (a tuple of Python ints, dtype): refused unless a (sequence of ints, dtype) pair."""
    if not isinstance(pool, (list, tuple)) or len(pool) != 2:
        raise TypeError(f"plan_layout: pools[{i}] must be a (shape, dtype) pair, got {pool!r}")
    shape, dtype = pool
    try:
        if isinstance(shape, (str, bytes)) or any(isinstance(n, bool) for n in shape):
            raise TypeError
        return tuple(operator.index(n) for n in shape), dtype
    except TypeError:
        raise TypeError(f"pools[{i}] (shape {shape!r}, {dtype}): shape must be a sequence of ints") from None


def plan_layout(pools: list[tuple[tuple[int, ...], torch.dtype]], specs: list[RowSpec]) -> tuple[list[PoolLayout], int]:
    """Lays out one blob for pools given as (shape, dtype); returns the pool layouts and the blob size."""
    if not isinstance(pools, (list, tuple)) or not isinstance(specs, (list, tuple)):
        raise TypeError(f"plan_layout: pools and specs must be lists, got {type(pools).__name__} and "
                        f"{type(specs).__name__}")
    if len(pools) == 0:
        raise ValueError("at least one pool is needed")
    if len(specs) != len(pools):
        raise ValueError(f"{len(specs)} row specs for {len(pools)} pools")
    layouts, offset = [], 0
    for i, (pool, spec) in enumerate(zip(pools, specs)):
        shape, dtype = _shape_and_dtype(i, pool)
        _check_spec(i, shape, dtype, spec)
        planes = shape[spec.plane_dim] if spec.plane_dim else 1
        rows = 1
        for k in range(1, len(shape) - 1):
            if k != spec.plane_dim:
                rows *= shape[k]
        esize = dtype.itemsize
        q = spec.quantized_range[1]
        r = spec.residual_range[1] if spec.residual_range else 0
        off_codes = 0
        off_rcodes = off_codes + _pad16(rows * q // 2)
        off_scales = off_rcodes + _pad16(rows * r // 2)
        off_rscales = off_scales + _pad16(rows * q // 16)
        off_lossless = off_rscales + _pad16(rows * r // 16)
        plane_bytes = off_lossless + rows * (shape[-1] - q) * esize
        g = spec.global_scale
        bits = 0 if isinstance(g, str) else struct.unpack("<i", struct.pack("<f", float(g)))[0]
        if g == "identity":
            bits = struct.unpack("<i", struct.pack("<f", 1.0))[0]
        lay = PoolLayout(shape, dtype, spec, planes, rows, offset, _pad16(4 + 4 * planes), plane_bytes, off_codes,
                         off_rcodes, off_scales, off_rscales, off_lossless, bits)
        layouts.append(lay)
        offset += lay.section_bytes
    return layouts, _pad16(offset)
