"""``KvopsEvictionConnector``: TriAttention eviction in vLLM's own KV cache, compacted in place.

vLLM derives a request's positions, sequence length and slot mapping from one number, its computed tokens, and
sizes its block allocation by it too. Under eviction the request holds fewer tokens than it has computed, so the
two split: RoPE positions stay logical (what vLLM computes), while the slot mapping, the sequence lengths the
attention reads and the blocks it holds follow the physical length. The connector's hooks carry the rounds; two
small patches, installed for vLLM 0.32 only, carry the split:

- scheduler: the engine's ``KVCacheManager.allocate_slots`` (this instance's, bound through
  ``bind_kv_cache_manager``) sees each request at its physical length (``block_cache.physical_length``: the round
  rule, which both processes compute alike) and first returns the blocks past it to vLLM's block pool;
- worker: ``GPUModelRunner._prepare_inputs`` (which vLLM's CPU runner inherits) subtracts each request's evicted
  tokens from the positions its slot mapping is computed from and from its sequence lengths.

The rounds run in the worker after each forward (``wait_for_save``): every decode step is confirmed to a
``TriAttentionManager`` on a ``block_cache.BlockCache`` over vLLM's pages, which scores the due requests' keys and
compacts their kept tokens in place; the worker then truncates their block-table rows, as the scheduler frees
the same blocks before its next allocation. A compacted block holds other tokens than its hash names, so the
connector needs ``enable_prefix_caching=False``. A preempted request is recomputed in full (its evicted tokens
come back) and its rounds start again from there, its recomputed tokens counting as its prompt.
docs/vllm.md says how to turn it on.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.utils import CpuGpuBuffer

from ...config import TriAttentionConfig, config_from_dict
from ...manager import Request, TriAttentionManager, create_compression_manager
from . import CONNECTOR_NAME as WHAT
from . import check_vllm_version
from .block_cache import BlockCache, physical_length
from .layouts import BlockLayout, layer_layout

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, which vLLM configures
CONFIG_KEY = "kvops_triattention"  # kv_connector_extra_config: a TriAttentionConfig dict, or its JSON file's path


def parse_config(extra: dict) -> TriAttentionConfig:
    """The connector's one key of ``kv_connector_extra_config``: ``kvops_triattention``, the config as
    ``TriAttentionConfig.to_dict()`` gives it, or the path of the JSON file ``to_json`` writes."""
    unknown = sorted(k for k in extra if k != CONFIG_KEY)
    if unknown:
        raise ValueError(f"{WHAT}: unknown kv_connector_extra_config keys {unknown}; it reads {CONFIG_KEY!r}")
    if CONFIG_KEY not in extra:
        raise ValueError(f"{WHAT}: kv_connector_extra_config needs {CONFIG_KEY!r}: a TriAttentionConfig as a dict "
                         "(TriAttentionConfig.to_dict()) or the path of its JSON file")
    value = extra[CONFIG_KEY]
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(value) as f:
                value = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{WHAT}: {CONFIG_KEY}={os.fspath(extra[CONFIG_KEY])!r} is not a readable JSON "
                             f"file: {e}") from e
    if not isinstance(value, dict):
        raise TypeError(f"{WHAT}: {CONFIG_KEY} must be a dict or a JSON file's path, got {type(value).__name__}")
    config = config_from_dict(value)
    if not isinstance(config, TriAttentionConfig):
        raise ValueError(f"{WHAT}: {CONFIG_KEY} must be a TriAttention config, got {type(config).__name__}")
    return config


def model_config(vllm_config) -> dict[str, Any]:
    """The model's Hugging Face config as a dict: the geometry and RoPE a calibration is checked against
    (``load_calibration``, ``create_compression_manager``)."""
    return vllm_config.model_config.hf_text_config.to_dict()


@dataclass(frozen=True)
class _Settings:
    """What both halves check at construction and the scheduler needs: the rule's budget and beta."""

    config: TriAttentionConfig
    budget: int
    beta: int

    @classmethod
    def check(cls, vllm_config, kv_cache_config) -> "_Settings":
        check_vllm_version()
        transfer = vllm_config.kv_transfer_config
        config = parse_config(dict(transfer.kv_connector_extra_config or {}))
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(f"{WHAT}: rounds rewrite a request's blocks in place, so they cannot be shared through "
                             "the prefix cache; pass enable_prefix_caching=False (--no-enable-prefix-caching)")
        if vllm_config.scheduler_config.async_scheduling:
            raise ValueError(f"{WHAT}: has run under synchronous scheduling only (vLLM's CPU platform has no "
                             "other); pass async_scheduling=False (--no-async-scheduling)")
        if vllm_config.speculative_config is not None:
            raise ValueError(f"{WHAT}: speculative decoding is not supported (a round needs each step's tokens "
                             "confirmed)")
        cache_dtype = vllm_config.cache_config.cache_dtype
        dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else cache_dtype
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{WHAT}: compacts bfloat16 and float16 caches, not a {dtype} cache (dtype=, "
                             "kv_cache_dtype=)")
        calibration = config.load_calibration(model_config(vllm_config))  # a calibration of another model raises
        split = config.layer_groups(calibration)
        if split.local_layers:
            raise ValueError(f"{WHAT}: a layer split with local layers ({split}) needs a block table per layer "
                             "group; vLLM gives full-attention layers one (docs/vllm.md, Refused): use "
                             "layer_split=False")
        if kv_cache_config is not None:
            groups = kv_cache_config.kv_cache_groups
            if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec) or \
                    getattr(groups[0].kv_cache_spec, "sliding_window", None):
                raise ValueError(f"{WHAT}: evicts from one KV cache group of full attention; this model has "
                                 f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
        limit = vllm_config.model_config.max_model_len
        first = max(split.budget + 1, config.beta)
        if first + 1 > limit:
            raise ValueError(f"{WHAT}: budget {split.budget} and beta {config.beta} put the first round at {first} "
                             f"decode tokens past a prompt, beyond max_model_len {limit}: no request would ever be "
                             f"compacted")
        return cls(config, split.budget, config.beta)


class _SchedulerSide:
    """Keeps vLLM's block accounting at each request's physical length (module docstring)."""

    def __init__(self, settings: _Settings):
        self.settings = settings
        self.prompt: dict[str, int] = {}  # tokens each request (re)started from: its prompt, or all after a preemption

    def bind(self, kv_cache_manager) -> None:
        (single,) = kv_cache_manager.coordinator.single_type_managers
        original = kv_cache_manager.allocate_slots

        def allocate_slots(request, num_new_tokens, *args, **kwargs):
            rid, computed = request.request_id, request.num_computed_tokens
            if computed == 0:  # admitted, or resumed after a preemption (recomputed in full)
                self.prompt[rid] = request.num_tokens
            held = physical_length(self.prompt[rid], computed, self.settings.budget, self.settings.beta)
            if held == computed:
                return original(request, num_new_tokens, *args, **kwargs)
            blocks = single.req_to_blocks[rid]
            keep = triton.cdiv(held, single.block_size)
            if len(blocks) > keep:  # the worker compacted them at the end of the step that wrote them
                tail = blocks[keep:]
                del blocks[keep:]
                single.block_pool.free_blocks(reversed(tail))
            request.num_computed_tokens = held  # what allocate_slots sizes the request's blocks by
            try:
                return original(request, num_new_tokens, *args, **kwargs)
            finally:
                request.num_computed_tokens = computed

        kv_cache_manager.allocate_slots = allocate_slots

    def finished(self, rid: str) -> None:
        self.prompt.pop(rid, None)


class _WorkerSide:
    """Runs the rounds on vLLM's pages and keeps the runner's inputs physical (module docstring)."""

    def __init__(self, settings: _Settings, vllm_config):
        self.settings, self.vllm_config = settings, vllm_config
        self.cache: BlockCache | None = None
        self.manager: TriAttentionManager | None = None
        self.runner = None
        self.prompt: dict[str, int] = {}
        self.evicted: dict[str, int] = {}  # request id -> tokens its rounds removed (logical - physical)
        # this step's requests as _prepare_inputs saw them: (id, tokens computed before it (logical), scheduled, row)
        self.step: list[tuple[str, int, int, int]] = []
        self.evicted_rows: CpuGpuBuffer | None = None  # this step's evicted tokens per runner row
        self.shifted = False  # whether this step's slot mapping subtracts them
        self.rounds = 0
        self.round_seconds = 0.0

    # -- setup -------------------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            _check_siblings(get_kv_transfer_group())
        context = self.vllm_config.compilation_config.static_forward_context
        names = sorted(kv_caches, key=extract_layer_index)
        dtype = kv_caches[names[0]].dtype
        block_size = self.vllm_config.cache_config.block_size
        layouts, pages = [], []
        for name in names:
            layout = layer_layout(WHAT, context[name], block_size, dtype, current_platform.is_cpu())
            layouts.append(layout)
            pages.append(_pages(name, kv_caches[name], layout))
        if len(set(layouts)) != 1:
            raise ValueError(f"{WHAT}: the layers' blocks differ ({sorted(set(map(str, layouts)))})")
        self.cache = BlockCache(pages, layouts[0], self._block_ids, self._truncate)
        manager = create_compression_manager(self.settings.config, self.cache, model_config(self.vllm_config))
        manager.cuda_graphs = not self.cache.staged
        self.manager = manager
        config = self.settings.config
        logger.info("%s: TriAttention %s, budget %d, beta %d, over %d layers of %s blocks (%s)", WHAT,
                    config.eviction_mode, self.settings.budget, config.beta, len(pages),
                    "staged CPU" if self.cache.staged else "in-place", layouts[0])

    def _row(self, rid: str) -> int:
        return self.runner.input_batch.req_id_to_index[rid]

    def _block_ids(self, rid: str) -> np.ndarray:
        table = self.runner.input_batch.block_table[0]
        row = self._row(rid)
        return table.block_table.np[row, :table.num_blocks_per_row[row]]

    def _truncate(self, rid: str, blocks: int) -> None:
        table = self.runner.input_batch.block_table[0]
        row = self._row(rid)
        table.num_blocks_per_row[row] = blocks

    # -- each step -------------------------------------------------------------------------------------------
    def prepare_inputs(self, runner, original, scheduler_output, num_scheduled_tokens):
        """``GPUModelRunner._prepare_inputs`` with each request's slot mapping and sequence length physical."""
        if self.runner is not runner:
            self._bind(runner)
        batch = runner.input_batch
        for rid in scheduler_output.preempted_req_ids or ():
            self._forget(rid)
        for rid in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            self._forget(rid)
        n = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:n]
        self.step = []
        evicted = self.evicted_rows.np[:n]
        table = batch.block_table[0]
        for row, rid in enumerate(batch.req_ids[:n]):
            before = int(computed[row])
            if rid not in self.prompt:  # admitted, or resumed: its tokens so far (a tier may hold some) are its prompt
                self.prompt[rid] = runner.requests[rid].num_tokens
                self.evicted[rid] = 0
            evicted[row] = self.evicted[rid]
            scheduled = int(num_scheduled_tokens[row])
            held = before - self.evicted[rid] + scheduled
            if table.num_blocks_per_row[row] != triton.cdiv(held, table.block_size):
                raise RuntimeError(f"{WHAT}: request {rid!r} will hold {held} tokens in "
                                   f"{table.num_blocks_per_row[row]} blocks of {table.block_size}: the scheduler and "
                                   "the worker disagree on its rounds")
            self.step.append((rid, before, scheduled, row))
        self.shifted = bool(evicted.any())
        if not self.shifted:
            return original(runner, scheduler_output, num_scheduled_tokens)
        # pinned, copied once per step on the runner's stream: the slot mapping reads it per token through the
        # runner's own token-to-request index (compute_slot_mapping below)
        shift = self.evicted_rows.copy_to_gpu(n)
        try:
            out = original(runner, scheduler_output, num_scheduled_tokens)
        finally:
            self.shifted = False
        runner.seq_lens[:n] -= shift.to(runner.seq_lens.dtype)
        runner.optimistic_seq_lens_cpu[:n] -= self.evicted_rows.cpu[:n].to(runner.optimistic_seq_lens_cpu.dtype)
        return out

    def _bind(self, runner) -> None:
        """The runner's block table computes slot mappings from physical positions."""
        tables = runner.input_batch.block_table
        if len(tables.block_tables) != 1:
            raise ValueError(f"{WHAT}: evicts from one KV cache group, the runner has {len(tables.block_tables)}")
        original = type(tables).compute_slot_mapping
        worker = self

        def compute_slot_mapping(num_reqs, query_start_loc, positions):
            if worker.shifted:
                rows = runner.req_indices.gpu[:positions.shape[0]]  # _prepare_inputs filled it for this step
                positions = positions - worker.evicted_rows.gpu[rows]
            return original(tables, num_reqs, query_start_loc, positions)

        tables.compute_slot_mapping = compute_slot_mapping
        self.evicted_rows = CpuGpuBuffer(runner.max_num_reqs, dtype=torch.int32, device=runner.device)
        self.runner, self.shifted = runner, False

    def after_forward(self) -> None:
        """Confirms the step's tokens to the manager, which runs the due rounds in vLLM's pages."""
        if self.runner is None or not self.step:
            return
        manager, cache, settings = self.manager, self.cache, self.settings
        prefilled, decoded = [], []
        for rid, before, scheduled, _ in self.step:
            prompt = self.prompt[rid]
            if rid not in manager.prompt_length:
                manager.on_request_init(Request(rid, prompt))
            cache.lengths[rid] = before + scheduled - self.evicted[rid]
            if before < prompt:
                if before + scheduled > prompt:
                    raise RuntimeError(f"{WHAT}: request {rid!r} ran past its {prompt} prompt tokens in a prefill "
                                       "step")
                prefilled.append(Request(rid, prompt))
            else:
                decoded.append((rid, scheduled))
        self.step = []
        if prefilled:
            manager.on_context_step_end(prefilled)
        if not decoded:
            return
        # the round rule the scheduler sizes blocks by says who is due; the manager's own plan must agree
        logical = {rid: cache.lengths[rid] + self.evicted[rid] for rid, _ in decoded}
        want = {rid: physical_length(self.prompt[rid], logical[rid], settings.budget, settings.beta)
                for rid, _ in decoded}
        due = [rid for rid, _ in decoded if want[rid] < cache.lengths[rid]]
        start = time.perf_counter()
        if due and cache.stage(due, [manager.prompt_length[r] + manager.policy.sink_tokens for r in due]):
            manager.rebind()
        manager.on_generation_step_end(decoded)
        for rid, _ in decoded:
            held = cache.lengths[rid]
            if held != want[rid]:
                raise RuntimeError(f"{WHAT}: request {rid!r} holds {held} tokens after this step, the scheduler's "
                                   f"rule {want[rid]}")
            self.evicted[rid] = logical[rid] - held
        if due:
            self.rounds += 1
            self.round_seconds += time.perf_counter() - start  # host time: all of it on the CPU

    def _forget(self, rid: str) -> None:
        if self.manager is not None and rid in self.manager.prompt_length:
            self.manager.on_request_finish(Request(rid, self.manager.prompt_length[rid]))
        self.prompt.pop(rid, None)
        self.evicted.pop(rid, None)
        if self.cache is not None:
            self.cache.lengths.pop(rid, None)

    def finished(self, rids) -> None:
        for rid in rids:
            self._forget(rid)




def _check_siblings(group) -> None:
    """Under a MultiConnector, the other connectors must never store a block a round rewrites: vLLM's offloading
    connector with ``offload_prompt_only`` (its default) is the one that has run beside the eviction."""
    for child in getattr(group, "sub_connectors", ()):
        if isinstance(child, KvopsEvictionConnector):
            continue
        transfer = child._kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        if transfer.kv_connector != "OffloadingConnector" or not extra.get("offload_prompt_only", True):
            raise ValueError(f"{WHAT}: beside it a MultiConnector may run vLLM's OffloadingConnector with "
                             f"offload_prompt_only true (prompt blocks, which rounds never rewrite); got "
                             f"{transfer.kv_connector} with {dict(extra)}")


def _pages(name: str, kv: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """A layer's cache tensor as int8 pages [num_blocks, page_bytes]: one dim indexes the blocks, and each block's
    elements fill a contiguous range of ``layout.page_bytes``."""
    esize, page = kv.element_size(), layout.page_bytes // kv.element_size()
    for dim in range(kv.dim()):
        rest = [d for d in range(kv.dim()) if d != dim]
        inner = sum((kv.shape[d] - 1) * kv.stride(d) for d in rest) + 1
        if kv.stride(dim) == page and inner == page and int(np.prod([kv.shape[d] for d in rest])) == page:
            blocks = torch.as_strided(kv, (kv.shape[dim], page), (page, 1))
            return blocks.view(torch.int8).view(kv.shape[dim], page * esize)
    raise ValueError(f"{WHAT}: layer {name}'s cache {tuple(kv.shape)} (strides {kv.stride()}) is not one page of "
                     f"{layout.page_bytes} bytes per block")


class KvopsEvictionConnector(KVConnectorBase_V1):
    """A vLLM KV connector (``kv_connector="KvopsEvictionConnector"``, ``kv_role="kv_both"``) that runs
    TriAttention eviction (module docstring); ``kv_connector_extra_config={"kvops_triattention": config}``."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = _Settings.check(vllm_config, kv_cache_config)
        self.scheduler_side = _SchedulerSide(self.settings) if role == KVConnectorRole.SCHEDULER else None
        self.worker_side = _WorkerSide(self.settings, vllm_config) if role == KVConnectorRole.WORKER else None
        if self.worker_side is not None:
            install_runner_patch()

    # -- worker ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker_side.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        self.worker_side.after_forward()

    def get_finished(self, finished_req_ids: set[str]):
        self.worker_side.finished(finished_req_ids)
        return None, None

    # -- scheduler -------------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.scheduler_side.finished(request.request_id)
        return False, None


def eviction_connector(connector) -> KvopsEvictionConnector | None:
    """The eviction connector a process runs: the connector itself, or one of a MultiConnector's."""
    if isinstance(connector, KvopsEvictionConnector):
        return connector
    for child in getattr(connector, "sub_connectors", ()):
        if isinstance(child, KvopsEvictionConnector):
            return child
    return None


_PATCHED = False


def install_runner_patch() -> None:
    """``GPUModelRunner._prepare_inputs`` through the eviction worker of the runner's connector, when it runs
    one (vLLM 0.32's runner; ``check_vllm_version`` gates it)."""
    global _PATCHED
    if _PATCHED:
        return
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_inputs

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        connector = eviction_connector(get_kv_transfer_group()) if has_kv_transfer_group() else None
        if connector is not None:
            return connector.worker_side.prepare_inputs(self, original, scheduler_output, num_scheduled_tokens)
        return original(self, scheduler_output, num_scheduled_tokens)

    GPUModelRunner._prepare_inputs = _prepare_inputs
    _PATCHED = True
