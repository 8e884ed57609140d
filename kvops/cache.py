"""PagedKVCache: a small but real engine-side paged KV cache, the reference integration of kvops.

GPU (or CPU) tier: per-layer pools, HND ``[P, 2, H, T, D]`` or NHD ``[P, 2, T, H, D]``, a free-page allocator
and per-request page lists. Host tier: fixed-size cold slots written by a cold-page codec (lossless by default,
NVFP4 when row specs are given), in pinned memory when CUDA is present. Physical compaction goes through
kvops.compaction. Every operation checks first and then changes state, so an error leaves the cache as it
was; free + used == total holds on both tiers (check_invariants).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import triton

from ._checks import as_device, check_bool, check_device, check_disjoint, check_hashable, check_int
from .compaction import build_compaction_params, compact
from .nvfp4 import PageBlobCodec, RowSpec


@dataclass
class _Request:
    length: int = 0
    pages: list[int] = field(default_factory=list)  # GPU pages, in token order
    slots: list[int] | None = None                  # host slots while offloaded (pages is then empty)


KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)  # csrc/compaction's


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int, *,
                 host_slots: int = 0, dtype: torch.dtype = torch.bfloat16, layout: str = "HND",
                 device: torch.device | str = "cpu", codec_specs: Sequence[RowSpec] | None = None):
        if layout not in ("HND", "NHD"):
            raise ValueError(f"PagedKVCache: layout must be 'HND' or 'NHD', got {layout!r}")
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("page_size", page_size), ("num_pages", num_pages)):
            check_int("PagedKVCache", name, v, 1)
        check_int("PagedKVCache", "host_slots", host_slots)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"PagedKVCache: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if dtype not in KV_DTYPES:
            raise ValueError(f"PagedKVCache: dtype must be a floating-point KV dtype the compaction moves (bf16, fp16, "
                             f"fp8 e4m3fn or e5m2), got {dtype}")
        device = as_device("PagedKVCache", device)
        if device.type == "meta":
            raise ValueError("PagedKVCache: device must be a real device, got meta")
        if codec_specs is not None:
            if not isinstance(codec_specs, (list, tuple)) or len(codec_specs) != num_layers:
                raise ValueError(f"PagedKVCache: codec_specs must be a list of {num_layers} RowSpecs (one per layer), "
                                 f"got {codec_specs!r}"[:300])
            for i, spec in enumerate(codec_specs):
                if not isinstance(spec, RowSpec):
                    raise TypeError(f"PagedKVCache: codec_specs[{i}] must be a RowSpec, got {type(spec).__name__}")
        self.layout, self.page_size, self.num_kv_heads, self.head_dim = layout, page_size, num_kv_heads, head_dim
        shape = (num_pages, 2, num_kv_heads, page_size, head_dim) if layout == "HND" else \
            (num_pages, 2, page_size, num_kv_heads, head_dim)
        self.pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        specs = list(codec_specs) if codec_specs is not None else [RowSpec.lossless(plane_dim=1)] * num_layers
        try:
            self.codec = PageBlobCodec(self.pools, specs)
        except ValueError as e:
            raise ValueError(f"PagedKVCache: codec_specs do not fit the pools: {e}") from e
        self.host = self.codec.allocate(host_slots)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._free_slots = list(range(host_slots - 1, -1, -1))
        self._requests: dict[object, _Request] = {}

    # -- views and accounting -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    def views(self) -> list[torch.Tensor]:
        """Per-layer 5-D [page, plane, head, token, dim] views (the compaction convention)."""
        return self.pools if self.layout == "HND" else [p.transpose(2, 3) for p in self.pools]

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every page and slot is either free or held by exactly one request, and
        every request holds exactly the pages (or slots) its length needs."""
        used_pages = [p for r in self._requests.values() for p in r.pages]
        used_slots = [s for r in self._requests.values() for s in (r.slots or [])]
        for kind, used, free, total in (("page", used_pages, self._free_pages, self.pools[0].shape[0]),
                                        ("slot", used_slots, self._free_slots, self.host.shape[0])):
            both = used + free
            assert len(both) == total and sorted(both) == list(range(total)), f"{kind} accounting broken"
        for rid, r in self._requests.items():
            held = len(r.pages) if r.slots is None else len(r.slots)
            assert held == self._pages_for(r.length), \
                f"request {rid!r}: length {r.length} needs {self._pages_for(r.length)} pages, it holds {held}"

    def _distinct(self, what: str, rids: Sequence) -> list[_Request]:
        if not isinstance(rids, (list, tuple)):
            raise TypeError(f"{what}: rids must be a list or tuple of request ids, got {type(rids).__name__}")
        for i, rid in enumerate(rids):
            check_hashable(what, f"rids[{i}]", rid)
        if len(set(rids)) != len(rids):
            raise ValueError(f"{what}: request ids must be distinct, got {list(rids)}")
        return [self._get(r) for r in rids]

    def _get(self, rid) -> _Request:
        check_hashable("PagedKVCache", "request id", rid)
        if rid not in self._requests:
            raise ValueError(f"PagedKVCache: unknown request {rid!r}")
        return self._requests[rid]

    def _pages_for(self, length: int) -> int:
        return triton.cdiv(length, self.page_size)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def add_request(self, rid) -> None:
        """A new request, holding no tokens; rid is any hashable id."""
        check_hashable("PagedKVCache.add_request", "rid", rid)
        if rid in self._requests:
            raise ValueError(f"PagedKVCache: request {rid!r} already exists")
        self._requests[rid] = _Request()

    def length(self, rid) -> int:
        return self._get(rid).length

    def resident(self, rid) -> bool:
        """Whether the request's pages are on the GPU (not offloaded to the host tier)."""
        return self._get(rid).slots is None

    def append(self, rid, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n tokens, k and v [n, H, D] (prefill: many; decode: one): dense floating-point tensors of one
        dtype on the cache's device, converted to the pool dtype."""
        what = "PagedKVCache.append"
        req = self._get(rid)
        if req.slots is not None:
            raise ValueError(f"PagedKVCache: request {rid!r} is offloaded; onboard it before appending")
        H, D = self.num_kv_heads, self.head_dim
        check_device(what, self.device, k=k, v=v)
        if k.layout != torch.strided or v.layout != torch.strided:
            raise ValueError(f"{what}: k and v must be dense (strided) tensors, got {k.layout} and {v.layout}")
        if not k.dtype.is_floating_point or v.dtype != k.dtype:
            raise TypeError(f"{what}: k and v must be floating-point tensors of one dtype, got {k.dtype} and "
                            f"{v.dtype}")
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (H, D):
            raise ValueError(f"{what}: k and v must both be [n, {H}, {D}], got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        check_disjoint(what, "pools", self.pools, [("k", k), ("v", v)])  # written layer by layer while read
        n = k.shape[0]
        extra = self._pages_for(req.length + n) - len(req.pages)
        if extra > len(self._free_pages):
            raise ValueError(f"PagedKVCache.append: request {rid!r} needs {extra} more pages, {len(self._free_pages)} "
                             f"are free")
        req.pages += [self._free_pages.pop() for _ in range(extra)]
        pos = torch.arange(req.length, req.length + n)
        pages = torch.tensor(req.pages, dtype=torch.long)[pos // self.page_size].to(self.device)
        slots = (pos % self.page_size).to(self.device)
        for layer, view in enumerate(self.views()):
            view[pages, 0, :, slots] = k.to(view.dtype)
            view[pages, 1, :, slots] = v.to(view.dtype)
        req.length += n

    def read(self, rid) -> torch.Tensor:
        """[L, 2, length, H, D]: the request's K and V, gathered (for tests and the demo)."""
        req = self._get(rid)
        if req.slots is not None:
            raise ValueError(f"PagedKVCache.read: request {rid!r} is offloaded")
        pos = torch.arange(req.length)
        pages = torch.tensor(req.pages, dtype=torch.long)[pos // self.page_size].to(self.device)
        slots = (pos % self.page_size).to(self.device)
        return torch.stack([view[pages, :, :, slots].transpose(0, 1) for view in self.views()])

    def finish(self, rid) -> None:
        req = self._get(rid)
        self._free_pages += reversed(req.pages)
        self._free_slots += reversed(req.slots or [])
        del self._requests[rid]

    def page_table(self, rids: Sequence, width: int | None = None, device: torch.device | str | None = None
                   ) -> torch.Tensor:
        """int32 [R, width] (default: the longest request's pages) on `device` (default: the pools'), -1 past
        each request's pages."""
        if not isinstance(rids, (list, tuple)):
            raise TypeError(f"PagedKVCache.page_table: rids must be a list or tuple of request ids, got "
                            f"{type(rids).__name__}")
        reqs = [self._get(r) for r in rids]
        need = max([len(r.pages) for r in reqs] + [1])
        if width is not None:
            check_int("PagedKVCache.page_table", "width", width, need)
        if device is not None:
            device = as_device("PagedKVCache.page_table", device)
        table = torch.full((len(reqs), width or need), -1, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, :len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        return table.to(self.device if device is None else device)

    # -- compaction -----------------------------------------------------------------------------------------
    def compact(self, rids: Sequence, kept: torch.Tensor, scored_lengths: torch.Tensor, tail_lengths: torch.Tensor,
                destination_bases: torch.Tensor, *, max_tail: int, validate: bool = True,
                order: str = "fill") -> torch.Tensor:
        """Move each request's kept tokens down in place (kvops.compaction), then release the pages past the new
        lengths. Returns the new lengths. Validation (on by default here: ``compact(validate=)``) raises before
        anything moves; so does, always, scored + tail differing from a request's length (tokens past it would be
        dropped, and the lengths the move returns would not fit the request). order: "fill" (the
        default) or "ordered" (kvops.compaction.build_compaction_params). No requests (empty rids and tensors):
        nothing moves, and the result is empty."""
        check_bool("PagedKVCache.compact", "validate", validate)
        reqs = self._distinct("PagedKVCache.compact", rids)
        if any(r.slots is not None for r in reqs):
            raise ValueError("PagedKVCache.compact: offloaded requests cannot be compacted")
        params = build_compaction_params(self.views(), self.page_table(rids), kept, scored_lengths, tail_lengths,
                                         destination_bases, max_tail=max_tail, order=order)  # checks the arguments
        ends = (scored_lengths.long() + tail_lengths.long()).tolist()  # a sync, fine for a reference cache
        if ends != [r.length for r in reqs]:
            raise ValueError(f"PagedKVCache.compact: scored_lengths + tail_lengths ({ends}) must equal the "
                             f"requests' lengths {[r.length for r in reqs]}")
        new_lengths = compact(params, len(reqs), validate=validate).tolist()
        self.shrink(rids, new_lengths)
        return torch.tensor(new_lengths, dtype=torch.int32)

    def shrink(self, rids: Sequence, new_lengths: Sequence[int]) -> None:
        """After an in-place compaction: set the requests' new lengths and release the pages past them. The
        caller knows the lengths (destination base + kept + tail), so nothing is read back from the device."""
        what = "PagedKVCache.shrink"
        reqs = self._distinct(what, rids)
        if not isinstance(new_lengths, (list, tuple)):
            raise TypeError(f"{what}: new_lengths must be a list or tuple of ints, got {type(new_lengths).__name__}")
        if len(new_lengths) != len(reqs):
            raise ValueError(f"{what}: {len(new_lengths)} new lengths for {len(reqs)} requests")
        for i, (req, n) in enumerate(zip(reqs, new_lengths)):  # every entry first, then apply
            check_int(what, f"new_lengths[{i}]", n, 0, req.length)
            if req.slots is not None:
                raise ValueError(f"{what}: request {list(rids)[i]!r} is offloaded")
        for req, n in zip(reqs, new_lengths):
            keep = self._pages_for(n)
            self._free_pages += reversed(req.pages[keep:])
            del req.pages[keep:]
            req.length = n

    # -- host tier --------------------------------------------------------------------------------------------
    def offload(self, rid) -> None:
        """Encode the request's pages into host slots through the codec and free its GPU pages."""
        self._migrate(rid, to_host=True)

    def onboard(self, rid, validate: bool = True) -> None:
        """Allocate GPU pages, decode the request's host slots into them and free the slots. With validate (the
        default), every slot's global scales are read first (a sync on the GPU): a slot never encoded or corrupt
        raises ValueError with nothing written or changed. Without it, such a plane is left as the page held it
        (another request's stale KV) and only ``codec.refused(device)`` counts it."""
        check_bool("PagedKVCache.onboard", "validate", validate)
        self._migrate(rid, to_host=False, validate=validate)

    def _migrate(self, rid, to_host: bool, validate: bool = False) -> None:
        req = self._get(rid)
        what = "offload" if to_host else "onboard"
        if (req.slots is None) != to_host:
            raise ValueError(f"PagedKVCache.{what}: request {rid!r} is {'already' if to_host else 'not'} offloaded")
        sources, source_free = (req.pages, self._free_pages) if to_host else (req.slots, self._free_slots)
        target_free, target = (self._free_slots, "host slots") if to_host else (self._free_pages, "pages")
        n = len(sources)
        if n > len(target_free):
            raise ValueError(f"PagedKVCache.{what}: {n} {target} needed, {len(target_free)} free")
        targets = target_free[len(target_free) - n:][::-1]  # what pop() hands out; taken once the copy went through
        if targets:  # pairs are (destination, source); later writes to freed pages queue behind the copy
            pairs = torch.tensor(list(zip(targets, sources)), dtype=torch.int32, device=self.device)
            if to_host:
                self.codec.encode(self.pools, self.host, pairs)
            else:
                try:
                    self.codec.decode(self.host, self.pools, pairs, validate=validate)
                except ValueError as e:
                    raise ValueError(f"PagedKVCache.onboard: request {rid!r}: {e}") from e
        del target_free[len(target_free) - n:]
        source_free += reversed(sources)
        req.pages, req.slots = ([], targets) if to_host else (targets, None)
