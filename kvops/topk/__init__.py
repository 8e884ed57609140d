"""kvops.topk: per-row top-k over rows of ragged lengths (docs/topk.md).

ops.py holds the op (kvops::topk_) and its dispatch over three GPU classes: the native warp-per-row kernel
(csrc/topk), the native multi-CTA kernel for a few long rows (csrc/topk) and the CuTe DSL radix select
(radix_cute.py); reference.py holds the plain-torch oracles and the key rule every class ranks by.

``kvops.topk`` is the function, not this package: ``kvops/__init__.py`` binds the name to ``ops.topk`` after the
package is imported, so ``kvops.topk(scores, lengths, k)`` reads as the op it is (a callable module would not
trace under ``torch.compile(fullgraph=True)``). The package's modules are reached by import, e.g. ``from
kvops.topk import reference`` or ``from kvops.topk.reference import topk_reference``, not as attributes of
``kvops.topk``.
"""

from .ops import LONG_ROW, MAX_K, SHORT_ROW, SPECS, cute_rows, long_rows_native, short_rows_native, topk, topk_spec
from .reference import sort_keys, topk_reference, topk_torch

__all__ = ["LONG_ROW", "MAX_K", "SHORT_ROW", "SPECS", "cute_rows", "long_rows_native", "short_rows_native",
           "sort_keys", "topk", "topk_reference", "topk_spec", "topk_torch"]
