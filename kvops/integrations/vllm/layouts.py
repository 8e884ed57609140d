"""vLLM's KV cache blocks as kvops pools (pure torch: nothing here imports vLLM).

vLLM 0.32 hands an offloading worker every layer's blocks as int8 pages ``[num_blocks, page_bytes]`` (the
OffloadingConnector asks for the LBHNC cache layout, so one block of one layer is one contiguous page of
``[kv_heads, block_size, 2 * head_size]`` elements in the cache dtype). What a page holds depends on the attention
backend that wrote it:

- GPU backends (FlashAttention, FlashInfer with the HND layout LBHNC gives): each token's ``2 * head_size`` holds K
  then V (FlashAttention: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``). The pages are a kvops pool as
  they are: ``[blocks, heads, tokens, 2 (K/V), head_size]``, plane dim 3, rows unit-stride. No copy.
- The CPU backend: each head holds a K region then a V region of ``block_size * head_size`` elements, packed for
  the attention ISA (vLLM ``csrc/cpu/cpu_attn*.hpp``, ``reshape_and_cache``): ``vec``/``vec16`` store K transposed
  (``[head_size, tokens]``) and V as ``[tokens, head_size]``; ``amx`` (bf16) packs pairs for VNNI, K as
  ``[tokens/16, head_size/2, 16, 2]`` and V as ``[head_size/16, tokens/2, 16, 2]``. K's rows are not unit-stride,
  so the tier gathers blocks into a staging pool ``[blocks, heads, 2 (K/V), tokens, head_size]`` (plane dim 2)
  before encoding and scatters them back after decoding.

``BlockLayout.planes`` returns, per plane, a view of the pages whose dims after (block, head) flatten row-major to
``(token, dim)``; the tests check them against the caches vLLM's own kernels write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ISA -> per plane (K, V): the region's shape after (block, head), and the permutation to (token..., dim...) order
_CPU_PLANES = {
    "vec": (lambda n, d: ((d, n), (1, 0)), lambda n, d: ((n, d), (0, 1))),
    "amx": (lambda n, d: ((n // 16, d // 2, 16, 2), (0, 2, 1, 3)),
            lambda n, d: ((d // 16, n // 2, 16, 2), (1, 3, 0, 2))),
}
_CPU_PLANES["vec16"] = _CPU_PLANES["vec"]
CPU_ISAS = tuple(_CPU_PLANES)
GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")  # K|V in each token's content dim under LBHNC


def layer_layout(what: str, layer, tokens: int, dtype: torch.dtype, cpu: bool) -> "BlockLayout":
    """The layout of a vLLM attention layer's blocks: vLLM's CPU backend (its ISA, ``layer.isa``) when `cpu`, else
    one of the GPU backends kvops reads (ValueError naming any other)."""
    if cpu:
        return BlockLayout("cpu", layer.num_kv_heads, tokens, layer.head_size, dtype, isa=getattr(layer, "isa", None))
    backend = layer.attn_backend.get_name()
    if backend not in GPU_BACKENDS:
        raise ValueError(f"{what}: kvops reads the block pages of the {', '.join(GPU_BACKENDS)} backends and vLLM's "
                         f"CPU backend, not {backend}")
    return BlockLayout("gpu", layer.num_kv_heads, tokens, layer.head_size, dtype)


@dataclass(frozen=True)
class BlockLayout:
    """How one layer's block of ``heads x tokens`` K and V rows of ``head_size`` lies in its page.

    backend: "gpu" (K|V per token, the pages are a pool as they are) or "cpu" (per head a K then a V region,
    packed by ``isa``)."""

    backend: str
    heads: int
    tokens: int
    head_size: int
    dtype: torch.dtype
    isa: str | None = None

    def __post_init__(self):
        what = "kvops vLLM block layout"
        if self.backend not in ("gpu", "cpu"):
            raise ValueError(f"{what}: backend must be 'gpu' or 'cpu', got {self.backend!r}")
        for name in ("heads", "tokens", "head_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}: {name} must be a positive int, got {value!r}")
        if self.backend == "cpu":
            if self.isa not in _CPU_PLANES:
                raise ValueError(f"{what}: vLLM's CPU attention ISA {self.isa!r} packs pages in a layout kvops does "
                                 f"not read (it reads {', '.join(CPU_ISAS)})")
            if self.isa == "amx" and (self.tokens % 16 or self.head_size % 16):
                raise ValueError(f"{what}: the amx layout needs block_size and head_size multiples of 16, got "
                                 f"{self.tokens} and {self.head_size}")

    @property
    def page_bytes(self) -> int:
        return self.heads * self.tokens * 2 * self.head_size * self.dtype.itemsize

    @property
    def zero_copy(self) -> bool:
        """Whether the pages are a kvops pool as they are (else the tier stages them)."""
        return self.backend == "gpu"

    @property
    def plane_dim(self) -> int:
        """The K/V dim of ``pool`` (zero copy) or of the staging pool."""
        return 3 if self.zero_copy else 2

    def pool_shape(self, blocks: int) -> tuple[int, ...]:
        """The kvops pool of ``blocks`` blocks: the pages themselves (zero copy) or the staging pool."""
        if self.zero_copy:
            return (blocks, self.heads, self.tokens, 2, self.head_size)
        return (blocks, self.heads, 2, self.tokens, self.head_size)

    def typed(self, pages: torch.Tensor) -> torch.Tensor:
        """The int8 pages ``[num_blocks, page_bytes]`` (unit-stride bytes) in the cache dtype, ``[num_blocks,
        heads, tokens * 2 * head_size]``; ValueError if they are not this layout's pages."""
        what = "kvops vLLM block layout"
        if not isinstance(pages, torch.Tensor) or pages.dim() != 2 or pages.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"{what}: vLLM's block pages must be an int8 [num_blocks, page_bytes] tensor, got "
                             f"{getattr(pages, 'dtype', type(pages).__name__)} "
                             f"{tuple(getattr(pages, 'shape', ()))}")
        if pages.shape[1] < self.page_bytes or pages.stride(1) != 1:
            raise ValueError(f"{what}: a page of {self.heads} heads x {self.tokens} tokens x 2 x {self.head_size} "
                             f"{self.dtype} needs {self.page_bytes} unit-stride bytes, got {pages.shape[1]} bytes "
                             f"with stride {pages.stride(1)}")
        esize = self.dtype.itemsize
        if pages.stride(0) % esize or pages.storage_offset() % esize:
            raise ValueError(f"{what}: the pages are not aligned to {self.dtype} elements")
        typed = pages[:, :self.page_bytes].view(self.dtype)
        return typed.view(pages.shape[0], self.heads, self.tokens * 2 * self.head_size)

    def pool(self, pages: torch.Tensor) -> torch.Tensor:
        """Zero copy: the pages as the pool ``[num_blocks, heads, tokens, 2, head_size]``."""
        assert self.zero_copy
        return self.typed(pages).unflatten(2, (self.tokens, 2, self.head_size))

    def planes(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU: K and V views ``[num_blocks, heads, *packed]`` whose trailing dims, row-major, are (token, dim)."""
        assert not self.zero_copy
        typed = self.typed(pages).unflatten(2, (2, self.tokens * self.head_size))
        views = []
        for plane, packing in enumerate(_CPU_PLANES[self.isa]):
            shape, perm = packing(self.tokens, self.head_size)
            views.append(typed[:, :, plane].unflatten(2, shape).permute(0, 1, *(2 + p for p in perm)))
        return views[0], views[1]

    def gather(self, planes: tuple[torch.Tensor, torch.Tensor], blocks: torch.Tensor, out: torch.Tensor) -> None:
        """CPU: ``out[i] <- block blocks[i]`` in the staging layout ``[n, heads, 2, tokens, head_size]``."""
        for plane, view in enumerate(planes):
            dst = out[:, :, plane]
            dst.view(dst.shape[0], *view.shape[1:]).copy_(view[blocks])

    def scatter(self, planes: tuple[torch.Tensor, torch.Tensor], blocks: torch.Tensor, src: torch.Tensor) -> None:
        """CPU: block ``blocks[i] <- src[i]``, the inverse of ``gather``."""
        for plane, view in enumerate(planes):
            part = src[:, :, plane]
            view[blocks] = part.reshape(part.shape[0], *view.shape[1:])
