"""Thin wrappers over torch.ops.kvops.nvfp4_*, with their fake (meta) implementations beside them."""

from __future__ import annotations

import torch

from .._checks import check_device, check_device_or_host, check_no_meta_mix

_ops = torch.ops.kvops


def quantize(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize the last dim of x in blocks of 16.

    Parameters
    ----------
    x : torch.Tensor
        bf16, fp16, fp32 or fp8 e4m3 ``[..., n]``, n a multiple of 16.
    global_scale : torch.Tensor, optional
        A one-element float32 g (positive, finite) on x's device or the host; 1 when None.

    Returns
    -------
    packed, scales : torch.Tensor
        uint8 ``[..., n/2]`` (element 2i is the low nibble) and float8_e4m3fn ``[..., n/16]``. In fp32:
        s = e4m3_rn_satfinite(amax * g / 6); c = e2m1_rne_satfinite(x * g / s), or 0 when s == 0. A block holding a
        NaN gets scale 0x7f (E4M3 NaN) and all-zero codes, so it decodes to NaN.
    """
    _check_args("quantize", x=x, global_scale=global_scale)
    return _ops.nvfp4_quantize(x, global_scale)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of ``quantize``: e2m1(c) * s / g in fp32, rounded to `dtype`.

    Parameters
    ----------
    packed, scales : torch.Tensor
        As ``quantize`` returns them: uint8 ``[..., n/2]`` and float8_e4m3fn ``[..., n/16]``, one device.
    global_scale : torch.Tensor, optional
        The g the data was quantized with (one-element float32, on the data's device or the host); 1 when None.
    dtype : torch.dtype
        bf16, fp16, fp32 or fp8 e4m3 (which saturates).

    Returns
    -------
    torch.Tensor
        ``[..., n]`` of `dtype`.
    """
    _check_args("dequantize", packed=packed, scales=scales, global_scale=global_scale)
    if not isinstance(dtype, torch.dtype):  # the op's schema would refuse it with a RuntimeError
        raise TypeError(f"dequantize: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return _ops.nvfp4_dequantize(packed, scales, global_scale, dtype)


def _check_args(what: str, global_scale: torch.Tensor | None, **tensors: torch.Tensor) -> None:
    """The data on one real device; the global scale there too or on the host (a host scale is read once)."""
    device = check_device(what, **tensors)
    if global_scale is not None:
        check_device_or_host(what, device, global_scale=global_scale)


@torch.library.register_fake("kvops::nvfp4_quantize")
def _quantize_fake(x, global_scale=None):
    check_no_meta_mix("nvfp4_quantize", x, global_scale)
    torch._check_value(x.dim() >= 1, lambda: "nvfp4_quantize: x must have at least one dim")
    torch._check_value(x.shape[-1] % 16 == 0, lambda: "nvfp4_quantize: x last dim must be a multiple of 16")
    packed = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    scales = x.new_empty((*x.shape[:-1], x.shape[-1] // 16), dtype=torch.float8_e4m3fn)
    return packed, scales


@torch.library.register_fake("kvops::nvfp4_dequantize")
def _dequantize_fake(packed, scales, global_scale, dtype):
    check_no_meta_mix("nvfp4_dequantize", packed, scales, global_scale)
    torch._check_value(packed.dim() >= 1, lambda: "nvfp4_dequantize: packed must have at least one dim")
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype)


@torch.library.register_fake("kvops::nvfp4_encode_pages_")
def _encode_pages_fake(pools, cold_pages, page_pairs, plan, validate=False, staging=None):
    check_no_meta_mix("nvfp4_encode_pages_", pools, cold_pages, page_pairs, staging)


@torch.library.register_fake("kvops::nvfp4_decode_pages_")
def _decode_pages_fake(cold_pages, pools, page_pairs, plan, validate=False, refused=None, staging=None):
    check_no_meta_mix("nvfp4_decode_pages_", cold_pages, pools, page_pairs, refused, staging)
