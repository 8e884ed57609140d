"""kvops: KV-cache compression kernels for LLM inference engines, registered under torch.ops.kvops."""

import torch  # noqa: F401  (libtorch must be loaded before kvops._C)

try:
    from . import _C  # noqa: F401  (registers every schema and the CPU/CUDA impls)
except ImportError as e:  # pragma: no cover
    raise ImportError(
        "kvops._C is not built; install with `pip install --no-build-isolation -e .` (see README.md)"
    ) from e

from . import attention, cache, codecs, compaction, config, nvfp4, triattention  # noqa: E402
# kvops.topk is the op, kvops.topk(...): this binds the name to the function over the package kvops/topk/, whose
# modules are imported by name (`from kvops.topk import reference`); kvops/topk/__init__.py says why.
from .topk import topk  # noqa: E402
from ._targets import VERSION as __version__  # noqa: E402, F401

__all__ = ["attention", "cache", "codecs", "compaction", "config", "nvfp4", "topk", "triattention"]
