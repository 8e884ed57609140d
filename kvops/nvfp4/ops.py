"""Thin wrappers over torch.ops.kvops.nvfp4_*, with their fake (meta) implementations beside them."""

from __future__ import annotations

import torch

from .._checks import check_device, check_device_or_host, check_no_meta_mix

_ops = torch.ops.kvops


def quantize(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize the last dim of x (a multiple of 16).

    Returns (packed uint8 [..., n/2], scales float8_e4m3fn [..., n/16]); element 2i is the low nibble.
    In fp32: s = e4m3_rn_satfinite(amax * g / 6); c = e2m1_rne_satfinite(x * g / s), or 0 when s == 0.
    A block holding a NaN gets scale 0x7f (E4M3 NaN) and all-zero codes, so it decodes to NaN.
    """
    _check_args("quantize", x=x, global_scale=global_scale)
    return _ops.nvfp4_quantize(x, global_scale)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e2m1(c) * s / g in fp32, rounded to dtype (bf16, fp16, fp32; fp8 e4m3 saturates)."""
    _check_args("dequantize", packed=packed, scales=scales, global_scale=global_scale)
    return _ops.nvfp4_dequantize(packed, scales, global_scale, dtype)


def _check_args(what: str, global_scale: torch.Tensor | None, **tensors: torch.Tensor) -> None:
    """The data on one real device; the global scale there too or on the host (a host scale is read once)."""
    device = check_device(what, **tensors)
    if global_scale is not None:
        check_device_or_host(what, device, global_scale=global_scale)


@torch.library.register_fake("kvops::nvfp4_quantize")
def _quantize_fake(x, global_scale=None):
    check_no_meta_mix("nvfp4_quantize", x, global_scale)
    torch._check(x.shape[-1] % 16 == 0, lambda: "nvfp4_quantize: x last dim must be a multiple of 16")
    packed = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    scales = x.new_empty((*x.shape[:-1], x.shape[-1] // 16), dtype=torch.float8_e4m3fn)
    return packed, scales


@torch.library.register_fake("kvops::nvfp4_dequantize")
def _dequantize_fake(packed, scales, global_scale, dtype):
    check_no_meta_mix("nvfp4_dequantize", packed, scales, global_scale)
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype)


@torch.library.register_fake("kvops::nvfp4_encode_pages")
def _encode_pages_fake(pools, cold_pages, page_pairs, plan, validate=False):
    check_no_meta_mix("nvfp4_encode_pages", pools, cold_pages, page_pairs)


@torch.library.register_fake("kvops::nvfp4_decode_pages")
def _decode_pages_fake(cold_pages, pools, page_pairs, plan, validate=False, refused=None):
    check_no_meta_mix("nvfp4_decode_pages", cold_pages, pools, page_pairs, refused)
