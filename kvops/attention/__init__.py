"""Decode attention over a paged KV cache (docs/attention.md)."""

from .ops import HEAD_DIMS, QUERY_DTYPES, decode_attention

__all__ = ["HEAD_DIMS", "QUERY_DTYPES", "decode_attention"]
