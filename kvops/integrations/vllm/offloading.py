"""``KvopsOffloadingSpec``: vLLM's KV offloading (OffloadingConnector) with a host tier of kvops cold pages.

vLLM's scheduler keeps deciding what to offload and what to load back (its ``CPUOffloadingManager``: chunks of
``blocks_per_chunk`` blocks, LRU or ARC); this spec changes what a chunk costs and how it moves: every block is one
cold page across all layers (NVFP4, or lossless), so ``cpu_bytes_to_use`` holds about 3.55x the blocks of vLLM's
raw tier for a bf16 cache, and a worker moves blocks with one fused kvops kernel per direction
(``tier.BlobTier``). docs/vllm.md has the configuration keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingManager,
                                     OffloadingSpec, OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ...codecs import ColdPageCodec, LosslessColdPageCodec, NVFP4ColdPageCodec
from ...config import NVFP4ColdPageConfig
from . import check_vllm_version
from .layouts import BlockLayout, layer_layout
from .tier import BlobTier, Transfer, cold_block_bytes

WHAT = "KvopsOffloadingSpec"
CODECS = ("nvfp4", "lossless")
ROPE = ("quantize", "lossless", "2fp4")
# kv_connector_extra_config keys vLLM itself reads with this spec (the factory, the offloading config, the base
# spec, CPUOffloadingManager's options)
VLLM_KEYS = ("spec_name", "spec_module_path", "cpu_bytes_to_use", "block_size", "blocks_per_chunk",
             "offload_prompt_only", "eviction_policy", "cache_policy_module_path", "store_threshold",
             "max_tracker_size", "self_describing_kv_events", "canonical_layout")


@dataclasses.dataclass(frozen=True)
class Options:
    """The spec's own keys of ``kv_connector_extra_config`` (docs/vllm.md)."""

    codec: str = "nvfp4"
    rope: str = "quantize"
    global_scale: str | float = NVFP4ColdPageConfig.global_scale
    staged: bool = False

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> "Options":
        keys = {f"kvops_{f.name}": f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in extra if k not in keys and k not in VLLM_KEYS)
        if unknown:
            raise ValueError(f"{WHAT}: unknown kv_connector_extra_config keys {unknown}; it reads "
                             f"{sorted(keys)} and vLLM's {sorted(VLLM_KEYS)}")
        opts = cls(**{name: extra[key] for key, name in keys.items() if key in extra})
        for name, choices in (("codec", CODECS), ("rope", ROPE)):
            if getattr(opts, name) not in choices:
                raise ValueError(f"{WHAT}: kvops_{name} must be one of {CODECS if name == 'codec' else ROPE}, got "
                                 f"{getattr(opts, name)!r}")
        if opts.codec == "lossless" and ({"kvops_rope", "kvops_global_scale"} & set(extra)):
            raise ValueError(f"{WHAT}: kvops_rope and kvops_global_scale configure the nvfp4 codec; "
                             "kvops_codec='lossless' stores rows as they are")
        if not isinstance(opts.staged, bool):
            raise TypeError(f"{WHAT}: kvops_staged must be a bool, got {opts.staged!r}")
        if extra.get("canonical_layout"):
            raise ValueError(f"{WHAT}: canonical_layout is vLLM's raw-page format; a kvops tier holds cold pages")
        return opts


def _head_dims(model_name: str) -> tuple[int, int]:
    """(head_size, rotary dims) from the model's Hugging Face config. The scheduler builds its spec outside vLLM's
    config context, so both processes read them here alike; the worker checks them against its attention
    layers."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_name).get_text_config()
    except Exception as e:  # noqa: BLE001 - any failure to read it is reported the same way
        raise ValueError(f"{WHAT}: cannot read the model config of {model_name!r} for the head size: {e}") from e
    head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return head_size, int(getattr(cfg, "rotary_dim", None) or head_size * factor)


def _vllm_config():
    config = get_current_vllm_config_or_none()
    if config is None:
        raise RuntimeError(f"{WHAT}: vLLM builds the offloading worker inside its config context; none is set")
    return config


class KvopsOffloadingSpec(OffloadingSpec):
    """An ``OffloadingSpec`` whose host tier holds kvops cold pages: ``spec_name="KvopsOffloadingSpec"``."""

    @classmethod
    def build_metric_definitions(cls, extra_config):
        return CPUOffloadingSpec.build_metric_definitions(extra_config)  # the manager is vLLM's CPU one

    def __init__(self, config):
        check_vllm_version()
        super().__init__(config)
        self.options = Options.parse(self.extra_config)
        if len(config.groups) != 1:
            raise ValueError(f"{WHAT}: offloads one KV cache group (full attention); this model has "
                             f"{len(config.groups)} groups to offload")
        self.dtype = getattr(torch, str(config.model.dtype), None)
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{WHAT}: kvops encodes bfloat16 and float16 caches; a {config.model.dtype!r} cache "
                             "is not supported")
        self.layer_names = config.groups[0].layer_names
        self.tokens = config.groups[0].tokens_per_block
        self.head_size, rope = _head_dims(config.model.name)
        page = config.worker_kv_bytes_per_block // max(len(self.layer_names), 1)
        self.heads = page // (self.tokens * 2 * self.head_size * self.dtype.itemsize)
        if self.heads < 1 or page % (self.tokens * 2 * self.head_size * self.dtype.itemsize):
            raise ValueError(f"{WHAT}: a layer's block of {page} bytes is not heads x {self.tokens} tokens x 2 x "
                             f"{self.head_size} {self.dtype}")
        try:
            self.codec_config = NVFP4ColdPageConfig(
                row_size=self.head_size, rope_range=(0, rope) if self.options.rope != "quantize" else None,
                skip_rope_quantization=self.options.rope == "lossless",
                residual_dim=rope if self.options.rope == "2fp4" else 0, global_scale=self.options.global_scale)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{WHAT}: kvops_rope={self.options.rope!r}, kvops_global_scale="
                          f"{self.options.global_scale!r} do not fit this model (heads of {self.head_size}, RoPE on "
                          f"the first {rope} dims): {e}") from e
        sizing = BlockLayout("gpu", self.heads, self.tokens, self.head_size, self.dtype)  # the blob's size only
        self.cold_block_bytes = cold_block_bytes([sizing] * len(self.layer_names), self.new_codec())
        bytes_to_use = self.extra_config.get("cpu_bytes_to_use")
        if isinstance(bytes_to_use, bool) or not isinstance(bytes_to_use, (int, float)) or \
                not 0 < bytes_to_use < math.inf:
            raise ValueError(f"{WHAT}: cpu_bytes_to_use (the host tier's bytes, all workers together) must be a "
                             f"positive number, got {bytes_to_use!r}")
        chunk_bytes = self.cold_block_bytes * self.blocks_per_chunk * config.parallel.world_size
        self.num_chunks = int(bytes_to_use) // chunk_bytes
        if self.num_chunks < 1:
            raise ValueError(f"{WHAT}: cpu_bytes_to_use={bytes_to_use} holds no chunk of {chunk_bytes} bytes "
                             f"({self.blocks_per_chunk} blocks of {self.cold_block_bytes} cold bytes on each of "
                             f"{config.parallel.world_size} workers)")
        self._manager: OffloadingManager | None = None
        self._worker: KvopsOffloadingWorker | None = None

    def new_codec(self) -> ColdPageCodec:
        if self.options.codec == "lossless":
            return LosslessColdPageCodec()
        return NVFP4ColdPageCodec(self.codec_config)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            extra = self.extra_config
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks, cache_policy=extra.get("eviction_policy", "lru"),
                cache_policy_module_path=extra.get("cache_policy_module_path"),
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(extra.get("store_threshold", 0)),
                max_tracker_size=int(extra.get("max_tracker_size", 64_000)))
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvopsOffloadingWorker(self, kv_caches)
        return self._worker


class KvopsOffloadingWorker(OffloadingWorker):
    """Moves blocks between vLLM's cache and a ``BlobTier`` of ``num_chunks * blocks_per_chunk`` cold pages."""

    def __init__(self, spec: KvopsOffloadingSpec, kv_caches: CanonicalKVCaches):
        context = _vllm_config().compilation_config.static_forward_context
        refs = kv_caches.group_data_refs[0]
        if len(refs) != len(spec.layer_names):
            raise ValueError(f"{WHAT}: {len(refs)} cache regions for {len(spec.layer_names)} layers (packed "
                             "layouts are not supported)")
        first: dict[int, str] = {}
        for ref, name in zip(refs, spec.layer_names):
            first.setdefault(ref.tensor_idx, name)  # layers aliasing one region share its blocks
        pages = [kv_caches.tensors[i].tensor for i in first]
        layouts = [layer_layout(WHAT, context[name], spec.tokens, spec.dtype, current_platform.is_cpu())
                   for name in first.values()]
        for ref, name in zip(refs, spec.layer_names):
            lay = layouts[list(first).index(ref.tensor_idx)]
            if (lay.heads, lay.head_size) != (spec.heads, spec.head_size):
                raise ValueError(f"{WHAT}: layer {name} has {lay.heads} KV heads of {lay.head_size}; the model "
                                 f"config said {spec.heads} of {spec.head_size}")
            if ref.page_size_bytes != lay.page_bytes:
                raise ValueError(f"{WHAT}: layer {name}'s blocks hold {ref.page_size_bytes} bytes, not the "
                                 f"{lay.page_bytes} of {lay.heads} heads x {lay.tokens} tokens x 2 x "
                                 f"{lay.head_size} {lay.dtype}")
        self.blocks_per_chunk = spec.blocks_per_chunk
        self.tier = BlobTier(pages, layouts, spec.new_codec(), spec.num_chunks * spec.blocks_per_chunk,
                             staged=spec.options.staged)
        if self.tier.cold_page_bytes > spec.cold_block_bytes:  # the scheduler sized the tier for these
            raise ValueError(f"{WHAT}: the worker's cold pages ({self.tier.cold_page_bytes} bytes) outgrow the "
                             f"{spec.cold_block_bytes} the scheduler sized the tier for")
        self._jobs: dict[int, Transfer] = {}

    def _pairs(self, gpu: GPULoadStoreSpec, host: LoadStoreSpec) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, slots): a chunk is blocks_per_chunk slots; the first chunk may start part-way (vLLM's
        block_indices)."""
        assert isinstance(host, CPULoadStoreSpec), type(host)
        k = self.blocks_per_chunk
        (size,), (first,) = gpu.group_sizes, gpu.block_indices
        slots = (host.block_ids.astype(np.int64)[:, None] * k + np.arange(k)).reshape(-1)
        skip = first % k
        return gpu.block_ids.astype(np.int64), slots[skip:skip + size]

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        blocks, slots = self._pairs(src_spec, dst_spec)
        self._jobs[job_id] = self.tier.store(blocks, slots)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        blocks, slots = self._pairs(dst_spec, src_spec)
        self._jobs[job_id] = self.tier.load(slots, blocks)
        return True

    def get_finished(self) -> list[TransferResult]:
        done = [job for job, transfer in self._jobs.items() if transfer.done()]
        return [TransferResult(job, True, transfer_size=t.cold_bytes, transfer_time=t.seconds)
                for t, job in ((self._jobs.pop(job), job) for job in done)]

    def wait(self, job_ids: set[int]) -> None:
        for job in job_ids:
            if job in self._jobs:
                self._jobs[job].wait()

    def shutdown(self) -> None:
        for transfer in self._jobs.values():
            transfer.wait()

