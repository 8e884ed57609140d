"""NVFP4 primitives and the cold-page codec (docs/nvfp4.md)."""

from .codec import PageBlobCodec
from .layout import DEFAULT_SCALE, RowSpec, plan_layout
from .ops import dequantize, quantize

__all__ = ["PageBlobCodec", "RowSpec", "plan_layout", "quantize", "dequantize", "DEFAULT_SCALE"]
