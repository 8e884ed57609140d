"""Compression managers: one method per instance, driven by the engine's lifecycle hooks.

An engine calls, for each request and step, in this order:

1. ``on_request_init(request)`` when a request is admitted, before its prefill is scheduled;
2. ``on_context_step_end(requests)`` after a prefill (context) step has written those requests' KV;
3. ``on_generation_step_begin(batch)`` before a decode step is launched;
4. ``on_generation_step_end(batch)`` after a decode step's tokens are confirmed (accepted) and their KV written;
5. ``on_request_finish(request)`` when the request leaves, before its pages are released.

The rule: a manager may refuse, defer or do nothing at any hook before it changes anything physical; once it
has moved bytes it either completes the change (cache contents, lengths and freed pages all updated) or raises,
never leaving a half-updated state visible to the engine. Every hook is a no-op by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import triton

from ._checks import check_int
from .compaction import build_compaction_params, compact
from .config import KVCacheCompressionConfig, NVFP4ColdPageConfig, TriAttentionConfig
from .triattention import TriAttentionSelector

SUPPORTED_ARCHS = ((9, 0), (10, 0))  # sm_90a and sm_100a are the archs kvops builds kernels for


@dataclass
class Request:
    """What a manager needs to know of a request: its id and its prompt length (the prompt is never evicted)."""

    id: Any
    prompt_length: int

    def __post_init__(self):
        check_int("Request", "prompt_length", self.prompt_length)


class KVCacheCompressionManager:
    def __init__(self, config: KVCacheCompressionConfig, kv_cache, model_config: Mapping[str, Any]):
        self.config, self.kv_cache, self.model_config = config, kv_cache, model_config

    def on_request_init(self, request: Request) -> None:
        pass

    def on_context_step_end(self, requests: Sequence[Request]) -> None:
        pass

    def on_generation_step_begin(self, batch: Sequence[Any]) -> None:
        pass

    def on_generation_step_end(self, batch: Sequence[tuple[Any, int]]) -> None:
        pass

    def on_request_finish(self, request: Request) -> None:
        pass


class TriAttentionManager(KVCacheCompressionManager):
    """Every `beta` confirmed generated tokens, once a request's decode length exceeds `budget`, keeps its
    `budget` best decode tokens (kvops.triattention) and compacts the cache in place (kvops.compaction). It
    keeps each request's logical position, so RoPE positions stay right after eviction."""

    def __init__(self, config: TriAttentionConfig, kv_cache, model_config: Mapping[str, Any]):
        super().__init__(config, kv_cache, model_config)
        calibration = config.load_calibration(model_config)
        # A round scores at most budget + 2*beta decode tokens (a round is due after beta more, and a step may
        # confirm several); anything newer is the protected tail, which stays within beta while no step confirms
        # more than beta + 1 tokens.
        self.max_tail = config.beta
        # A cache that stores its keys scaled (fp8, vLLM's k_scale) says so with a `k_scale` attribute: float32
        # [L] or [L, Hkv] (TriAttentionSelector).
        self.selector = TriAttentionSelector(calibration, config.budget, config.eviction_mode,
                                             config.normalize_scores, max_decode=config.budget + 2 * config.beta,
                                             k_scale=getattr(kv_cache, "k_scale", None))
        self.prompt_length: dict[Any, int] = {}
        self.since_round: dict[Any, int] = {}
        self.num_compressed_tokens: dict[Any, int] = {}
        self.rounds = 0
        # On the GPU, each round size is captured once and replayed (TriAttentionRound); set False to run every
        # round eagerly (e.g. under a debugger or an engine that captures its own graphs).
        self.cuda_graphs = True
        self._round: TriAttentionRound | None = None

    def on_request_init(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"TriAttentionManager.on_request_init: expected a Request, got {type(request).__name__}")
        if request.id in self.prompt_length:
            raise ValueError(f"TriAttentionManager.on_request_init: request {request.id!r} is already admitted")
        self.prompt_length[request.id] = request.prompt_length
        self.since_round[request.id] = 0
        self.num_compressed_tokens[request.id] = 0

    def on_request_finish(self, request: Request) -> None:
        for table in (self.prompt_length, self.since_round, self.num_compressed_tokens):
            table.pop(request.id, None)

    def logical_position(self, rid) -> int:
        """The next token's absolute position: the cache length plus every token evicted so far."""
        return self.kv_cache.length(rid) + self.num_compressed_tokens[rid]

    def due(self, batch: Sequence[tuple[Any, int]]) -> list:
        """Requests due for a round after this step: at most one round per step, however many tokens it
        confirmed."""
        what = "TriAttentionManager.on_generation_step_end"
        batch = list(batch)
        for i, item in enumerate(batch):  # every item first, then apply
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"{what}: batch[{i}] must be (request id, confirmed tokens), got {item!r}")
            if item[0] not in self.prompt_length:
                raise ValueError(f"{what}: request {item[0]!r} was never admitted (on_request_init) or has finished")
            check_int(what, f"batch[{i}] confirmed tokens", item[1])
        if len({rid for rid, _ in batch}) != len(batch):
            raise ValueError(f"{what}: a request appears twice in the batch")
        due = []
        for rid, confirmed in batch:
            self.since_round[rid] += confirmed
            decode = self.kv_cache.length(rid) - self.prompt_length[rid]
            if decode > self.config.budget and self.since_round[rid] >= self.config.beta:
                due.append(rid)
        return due

    def on_generation_step_end(self, batch: Sequence[tuple[Any, int]]) -> None:
        rids = self.due(batch)
        if not rids:
            return
        cache = self.kv_cache
        if not all(cache.resident(r) for r in rids):  # refuse before anything moves
            raise RuntimeError(f"TriAttentionManager: requests {[r for r in rids if not cache.resident(r)]} are "
                               f"offloaded; a round needs their pages on the GPU")
        lengths = [cache.length(r) for r in rids]
        prompts = [self.prompt_length[r] for r in rids]
        tails = [max(0, n - p - self.selector.max_decode) for n, p in zip(lengths, prompts)]
        if max(tails) > self.max_tail:  # refuse before anything moves
            raise RuntimeError(f"TriAttentionManager: a step confirmed more than beta={self.config.beta} tokens past "
                               f"a due round ({max(tails)} unscored); call on_generation_step_end every step")
        width = max(triton.cdiv(n, cache.page_size) for n in lengths)  # page-table columns this round needs
        if self._round is None or not self._round.fits(len(rids), width):
            self._round = TriAttentionRound(self.selector, cache, len(rids), width, self.max_tail, self.cuda_graphs,
                                            self.config.compaction_order)
        self._round.run(cache.page_table(rids, self._round.width, device="cpu"),
                        [n - t for n, t in zip(lengths, tails)], prompts, tails,
                        [self.logical_position(r) for r in rids])
        # The kept decode tokens land after the prompt, then the tail: lengths known here, nothing read back.
        new_lengths = [p + self.config.budget + t for p, t in zip(prompts, tails)]
        cache.shrink(rids, new_lengths)
        for rid, before, after in zip(rids, lengths, new_lengths):
            self.num_compressed_tokens[rid] += before - after
            self.since_round[rid] = 0
        self.rounds += 1


class TriAttentionRound:
    """The device half of a TriAttention round, on buffers bound once: selection -> packing -> compaction for the
    first R of up to `max_requests` due requests, on the current stream, with no host sync. With `cuda_graphs`,
    the first round of each R runs eagerly (compiling the kernels) and is captured; later rounds of that R copy
    their inputs into the bound buffers and replay. Capacities grow in powers of two (the manager rebinds)."""

    def __init__(self, selector: TriAttentionSelector, cache, requests: int, width: int, max_tail: int,
                 cuda_graphs: bool, order: str = "fill"):
        self.selector, self.requests = selector, 1 << (requests - 1).bit_length()
        self.width = 1 << (width - 1).bit_length()
        device = cache.device
        self.page_table = torch.full((self.requests, self.width), -1, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(4, self.requests, dtype=torch.int32, device=device)  # scored, prompt, tail, position
        kept = torch.zeros(self.requests, selector.rows, selector.budget, dtype=torch.int32, device=device)
        self.params = build_compaction_params(cache.views(), self.page_table, kept, self.lengths[0], self.lengths[2],
                                              self.lengths[1], max_tail=max_tail, order=order)
        self.graphs: dict[int, torch.cuda.CUDAGraph] | None = {} if cuda_graphs and device.type == "cuda" else None

    def fits(self, requests: int, width: int) -> bool:
        return requests <= self.requests and width <= self.width

    def _launch(self, R: int) -> None:
        scored, prompt, tail, position = self.lengths[:, :R]
        self.params.kept[:R].copy_(self.selector.select(self.params.pools, self.page_table[:R], scored, prompt,
                                                        position))
        compact(self.params, R)

    def run(self, page_table: torch.Tensor, scored: Sequence[int], prompts: Sequence[int], tails: Sequence[int],
            positions: Sequence[int]) -> None:
        R = len(scored)
        self.page_table[:R].copy_(page_table, non_blocking=True)
        self.lengths[:, :R].copy_(torch.tensor([scored, prompts, tails, positions], dtype=torch.int32),
                                  non_blocking=True)
        if self.graphs is None:
            self._launch(R)
        elif R in self.graphs:
            self.graphs[R].replay()
        else:
            self._launch(R)  # this round, eagerly; it also compiles the kernels before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch(R)  # recorded, not run
            self.graphs[R] = graph


class NVFP4ColdPageManager(KVCacheCompressionManager):
    """Storage-bound: the physical KV length never changes; pages leaving the GPU go through the NVFP4 codec of
    the cache's host tier (configure the cache with ``codec_specs=[config.row_spec()] * num_layers``)."""


MANAGERS = {TriAttentionConfig: TriAttentionManager, NVFP4ColdPageConfig: NVFP4ColdPageManager}


def create_compression_manager(config: KVCacheCompressionConfig, kv_cache, model_config: Mapping[str, Any]
                               ) -> KVCacheCompressionManager:
    """The manager for `config` on `kv_cache`, after admission checks that raise a clear error: one method per
    instance, a method/cache combination the method supports, and kernels for the cache's GPU."""
    if isinstance(config, (list, tuple)):
        raise ValueError(f"create_compression_manager: one method per manager instance, got {len(config)} configs")
    if type(config) not in MANAGERS:
        raise ValueError(f"create_compression_manager: unsupported config {type(config).__name__}")
    if getattr(kv_cache, "block_reuse", False) and not config.supports_block_reuse():
        raise ValueError(f"create_compression_manager: {config.algorithm} does not support a cache with block "
                         "reuse (prefix sharing): it rewrites pages in place")
    if getattr(kv_cache, "speculative_decoding", False) and not config.supports_speculative_decoding():
        raise ValueError(f"create_compression_manager: {config.algorithm} does not support speculative decoding")
    if not isinstance(model_config, Mapping):
        raise TypeError(f"create_compression_manager: model_config must be a dict, got {type(model_config).__name__}")
    if isinstance(config, TriAttentionConfig):  # the cache must hold the model the calibration describes
        pools, heads = getattr(kv_cache, "pools", None), getattr(kv_cache, "num_kv_heads", None)
        layers = model_config.get("num_hidden_layers")
        kv_heads = model_config.get("num_key_value_heads") or model_config.get("num_attention_heads")
        if pools is not None and layers is not None and len(pools) != layers:
            raise ValueError(f"create_compression_manager: the cache has {len(pools)} layers, the model "
                             f"{layers} (num_hidden_layers)")
        if heads is not None and kv_heads is not None and heads != kv_heads:
            raise ValueError(f"create_compression_manager: the cache has {heads} KV heads, the model {kv_heads} "
                             f"(num_key_value_heads)")
    device = torch.device(kv_cache.device)
    if device.type == "cuda":
        arch = torch.cuda.get_device_capability(device)
        if arch not in SUPPORTED_ARCHS:
            raise RuntimeError(f"create_compression_manager: no kvops kernels for sm_{arch[0]}{arch[1]} "
                               f"(built for {', '.join(f'sm_{a}{b}a' for a, b in SUPPORTED_ARCHS)})")
    return MANAGERS[type(config)](config, kv_cache, model_config)
