"""NVFP4 primitives and the cold-page codec (docs/nvfp4.md)."""

from .codec import ColdPageCodec
from .layout import DEFAULT_SCALE, RowSpec, plan_layout
from .ops import dequantize, quantize

__all__ = ["ColdPageCodec", "RowSpec", "plan_layout", "quantize", "dequantize", "DEFAULT_SCALE"]
