"""Decode attention over a paged KV cache (docs/attention.md)."""

from .ops import decode_attention

__all__ = ["decode_attention"]
