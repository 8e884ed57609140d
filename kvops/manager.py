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

import heapq
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import triton

from ._checks import INT32_MAX, check_bool, check_choice, check_hashable, check_int, check_int32, overlap
from ._targets import CAPABILITIES as SUPPORTED_ARCHS  # noqa: F401  (the archs kvops builds kernels for)
from .compaction import ORDERS, build_compaction_params, compact, decision_rows
from .compaction.positions import SlotPositions, follow_slot_positions_
from .config import KVCacheCompressionConfig, NVFP4ColdPageConfig, TriAttentionConfig, check_recent_layers
from .distributed import capturable, check_group, check_same_on_ranks, rank_kv_heads
from .nvfp4 import PageBlobCodec
from .triattention import TriAttentionSelector



@dataclass
class Request:
    """What a manager needs to know of a request: its id (hashable: it keys the manager's tables) and its prompt
    length (the prompt is never evicted)."""

    id: Any
    prompt_length: int

    def __post_init__(self):
        check_hashable("Request", "id", self.id)
        check_int("Request", "prompt_length", self.prompt_length)


def _sequence(what: str, name: str, value) -> list:
    """A list or tuple-like sequence (not a string) of hook items, as a list."""
    if not isinstance(value, SequenceABC) or isinstance(value, (str, bytes)):
        raise TypeError(f"{what}: {name} must be a sequence (list or tuple), got {type(value).__name__}")
    return list(value)


def _request(what: str, name: str, request) -> Request:
    """A Request whose fields are still valid (it is a mutable dataclass)."""
    if not isinstance(request, Request):
        raise TypeError(f"{what}: {name} must be a Request, got {type(request).__name__} {request!r}"[:300])
    check_hashable(what, f"{name}.id", request.id)
    check_int(what, f"{name}.prompt_length", request.prompt_length)
    return request


def _distinct(what: str, name: str, ids: list) -> None:
    """Each request at most once in a hook's batch (a repeated id would be applied twice)."""
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what}: a request appears twice in {name}")


def _step_items(what: str, batch) -> list:
    """A decode step's (request id, confirmed tokens) pairs: hashable ids, counts that are ints >= 0."""
    batch = _sequence(what, "batch", batch)
    for i, item in enumerate(batch):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"{what}: batch[{i}] must be a (request id, confirmed tokens) pair, got {item!r}"[:300])
        check_hashable(what, f"batch[{i}]", item[0])
        check_int(what, f"batch[{i}] confirmed tokens", item[1])
    _distinct(what, "the batch", [rid for rid, _ in batch])
    return batch


class KVCacheCompressionManager:
    """The hooks an engine calls (module docstring). Here each checks its argument types and does nothing."""

    def __init__(self, config: KVCacheCompressionConfig, kv_cache, model_config: Mapping[str, Any]):
        self.config, self.kv_cache, self.model_config = config, kv_cache, model_config

    def _what(self, hook: str) -> str:
        return f"{type(self).__name__}.{hook}"

    def on_request_init(self, request: Request) -> None:
        _request(self._what("on_request_init"), "request", request)

    def on_context_step_end(self, requests: Sequence[Request]) -> None:
        what = self._what("on_context_step_end")
        requests = _sequence(what, "requests", requests)
        for i, request in enumerate(requests):
            _request(what, f"requests[{i}]", request)
        _distinct(what, "requests", [r.id for r in requests])

    def on_generation_step_begin(self, batch: Sequence[Any]) -> None:
        what = self._what("on_generation_step_begin")
        batch = _sequence(what, "batch", batch)
        for i, rid in enumerate(batch):
            check_hashable(what, f"batch[{i}]", rid)
        _distinct(what, "the batch", batch)

    def on_generation_step_end(self, batch: Sequence[tuple[Any, int]]) -> None:
        _step_items(self._what("on_generation_step_end"), batch)

    def on_request_finish(self, request: Request) -> None:
        _request(self._what("on_request_finish"), "request", request)


class TriAttentionManager(KVCacheCompressionManager):
    """Every `beta` confirmed generated tokens, once a request's decode length exceeds `budget`, keeps its
    `budget` best decode tokens (kvops.triattention) and compacts the cache in place (kvops.compaction). It
    keeps each request's logical position, so RoPE positions stay right after eviction. Each decode step must
    confirm exactly the tokens the cache gained since the request's last hook (its prompt at admission, or what it
    held at its last context step); a refused step changes nothing, so the engine may call it again.

    Under tensor parallelism each rank runs its own manager on its own cache (its KV heads), with the same hooks
    in the same order: `process_group` and `kv_heads` go to the selector (``TriAttentionSelector``). With
    `validate`, every step checks that the ranks hold the same lengths and every round the same page tables
    (small all-reduces, each a host sync), raising on every rank before anything moves.

    Under a layer split (``TriAttentionConfig.layer_split``: ``config.layer_groups``), `kv_cache` is a pair of
    caches, the scored layers' and the local layers' (each holding its layers in model order), as an engine
    keeps a page table per KV-cache group; every decode step writes both. The scored cache runs the rounds above
    at the split's budget; the local one keeps each request's prompt and newest ``local_budget`` tokens, with
    rounds of its own (the same rule at its count). ``length`` and ``logical_position`` answer for the scored
    cache, ``local_length`` for the local one."""

    def __init__(self, config: TriAttentionConfig, kv_cache, model_config: Mapping[str, Any], *, process_group=None,
                 kv_heads: range | None = None, validate: bool = False):
        if not isinstance(config, TriAttentionConfig):
            raise TypeError(f"TriAttentionManager: config must be a TriAttentionConfig, got {type(config).__name__}")
        self.process_group = check_group("TriAttentionManager", process_group)
        self.validate = check_bool("TriAttentionManager", "validate", validate)
        super().__init__(config, kv_cache, model_config)
        calibration = config.load_calibration(model_config)
        num_layers = calibration.num_layers
        self.layer_split = split = config.layer_groups(calibration)
        self.local_cache = None  # a layer split's local layers' cache
        if split.local_layers:
            if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
                raise TypeError(f"TriAttentionManager: under a layer split kv_cache must be the pair (the scored "
                                f"layers' cache, the local layers' cache), got {type(kv_cache).__name__}")
            self.kv_cache, self.local_cache = kv_cache
            _check_distinct_groups(self.kv_cache, self.local_cache)
            scored = [layer for layer in range(num_layers) if layer not in split.local_layers]
            for cache, layers, which in ((self.kv_cache, scored, "scored"),
                                         (self.local_cache, split.local_layers, "local")):
                pools = getattr(cache, "pools", None)
                if pools is not None and len(pools) != len(layers):
                    raise ValueError(f"TriAttentionManager: the {which} layers' cache holds {len(pools)} layers; the "
                                     f"split {split} gives it layers {list(layers)}")
            calibration = calibration.for_layers(scored)
        elif isinstance(kv_cache, (tuple, list)):
            raise TypeError(f"TriAttentionManager: kv_cache must be one paged cache: the config's layer groups "
                            f"{split} put every layer in one (a pair serves a split with local layers)")
        self.budget, self.local_budget = split.budget, split.local_budget
        self.policy = policy = config.keep_policy(num_layers, split)
        self.order = round_order(config.compaction_order, policy.recent_window, config.beta)
        # A round holds at most budget + 2*beta decode tokens (a round is due after beta more, and a step may
        # confirm several): the sinks, the scored ones, and the tail: the newest recent_window plus anything past
        # the scored bound, which stays within beta while no step confirms more than beta + 1 tokens.
        self.max_tail = config.beta + policy.recent_window
        # A cache that stores its keys scaled (fp8, vLLM's k_scale) says so with a `k_scale` attribute: float32
        # [L] or [L, Hkv] (TriAttentionSelector).
        self.selector = policy_selector("TriAttentionManager", calibration, self.budget, config.eviction_mode,
                                        self.budget + 2 * config.beta, *policy,
                                        normalize_scores=config.normalize_scores,
                                        k_scale=getattr(self.kv_cache, "k_scale", None),
                                        process_group=self.process_group, kv_heads=kv_heads)
        heads = getattr(self.kv_cache, "num_kv_heads", None)
        if heads is not None and heads != len(self.selector.kv_heads):  # create_compression_manager checks it too
            raise ValueError(f"TriAttentionManager: the cache holds {heads} KV heads, kv_heads "
                             f"{self.selector.kv_heads} names {len(self.selector.kv_heads)}")
        # what every rank's manager must share to run one round (checked with validate, before each step)
        recent = torch.zeros(calibration.num_layers, dtype=torch.int64)
        recent[list(policy.recent_layers)] = 1
        self._settings = torch.cat((self.selector.settings, torch.tensor(
            [config.beta, policy.sink_tokens, policy.recent_window, ORDERS.index(config.compaction_order),
             self.local_budget, len(split.local_layers)]), recent))
        self.prompt_length: dict[Any, int] = {}
        self.since_round: dict[Any, int] = {}
        self.num_compressed_tokens: dict[Any, int] = {}
        # The cache length each request's hooks have accounted for: its prompt at admission (or what the cache
        # held at its last context step), plus every confirmed token, or what a round left. A decode step must
        # confirm exactly what the cache gained since: a hook called twice, or a count past what was written,
        # would otherwise shift every later round.
        self.accounted_length: dict[Any, int] = {}
        self.rounds = 0
        # With a recency prior, each decode slot's logical position (kvops.compaction.positions): a table row
        # (seat) per admitted request, grown in powers of two; and the slots each request's last round stored.
        self._seats: dict[Any, int] = {}
        self._free_seats: list[int] = []  # a heap: a finished request's seat goes to the next admitted one
        self._stored: dict[Any, int] = {}
        self.slot_positions: torch.Tensor | None = None
        # On the GPU, each round size is captured once and replayed (TriAttentionRound); set False to run every
        # round eagerly (e.g. under a debugger or an engine that captures its own graphs).
        self.cuda_graphs = True
        self._round: TriAttentionRound | None = None
        # a layer split's local layers: the same accounting as the scored ones' above, in their own cache
        self.local_accounted: dict[Any, int] = {}
        self.local_since: dict[Any, int] = {}
        self.local_compressed: dict[Any, int] = {}
        self._local_round: TriAttentionRound | None = None

    def _caches(self) -> list:
        """The caches every step writes: the scored layers', and a layer split's local layers'."""
        return [self.kv_cache] if self.local_cache is None else [self.kv_cache, self.local_cache]

    def _admitted(self, what: str, name: str, rid) -> None:
        check_hashable(what, name, rid)
        if rid not in self.prompt_length:
            raise ValueError(f"{what}: {name}: request {rid!r} was never admitted (on_request_init) or has finished")

    def _prefilled(self, what: str, name: str, rid) -> None:
        """Decode steps start once the request's prompt is written: in the cache, and as its context steps
        accounted it (a chunked prefill in progress has written part of it)."""
        written = min(self.accounted_length[rid], self._cache_length(what, rid))
        if self.local_cache is not None:
            written = min(written, self.local_accounted[rid], self._cache_length(what, rid, self.local_cache))
        if written < self.prompt_length[rid]:
            raise ValueError(f"{what}: {name}: request {rid!r} has written {written} of its "
                             f"{self.prompt_length[rid]} prompt tokens; decode steps start after its last context "
                             f"step")

    def _cache_length(self, what: str, rid, cache=None) -> int:
        try:
            return (cache or self.kv_cache).length(rid)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{what}: request {rid!r} is admitted here but unknown to the cache (released there "
                             f"before on_request_finish?): {e}") from e

    def on_request_init(self, request: Request) -> None:
        what = "TriAttentionManager.on_request_init"
        request = _request(what, "request", request)
        if request.id in self.prompt_length:
            raise ValueError(f"{what}: request {request.id!r} is already admitted")
        self.prompt_length[request.id] = request.prompt_length
        self.since_round[request.id] = 0
        self.num_compressed_tokens[request.id] = 0
        self.accounted_length[request.id] = request.prompt_length  # what the prefill will write
        if self.local_cache is not None:
            self.local_accounted[request.id] = request.prompt_length
            self.local_since[request.id] = self.local_compressed[request.id] = 0
        if self.selector.recency_prior:
            self._seats[request.id] = heapq.heappop(self._free_seats) if self._free_seats else len(self._seats)
            self._stored[request.id] = 0

    def on_context_step_end(self, requests: Sequence[Request]) -> None:
        """After a prefill step: each request's cache holds (part of) its prompt, at most all of it; decode steps
        confirm tokens from there."""
        what = "TriAttentionManager.on_context_step_end"
        requests = _sequence(what, "requests", requests)
        for i, request in enumerate(requests):  # every item first, then apply
            request = _request(what, f"requests[{i}]", request)
            self._admitted(what, f"requests[{i}]", request.id)
            if request.prompt_length != self.prompt_length[request.id]:
                raise ValueError(f"{what}: requests[{i}] ({request.id!r}) has prompt_length {request.prompt_length}, "
                                 f"it was admitted with {self.prompt_length[request.id]}")
        _distinct(what, "requests", [r.id for r in requests])
        accounted = [self.accounted_length] + ([self.local_accounted] if self.local_cache is not None else [])
        lengths = [[self._cache_length(what, r.id, cache) for r in requests] for cache in self._caches()]
        for group in lengths:
            for request, length in zip(requests, group):
                if length > request.prompt_length:
                    raise ValueError(f"{what}: request {request.id!r} holds {length} tokens after its context "
                                     f"step, more than its prompt_length {request.prompt_length}")
        for table, group in zip(accounted, lengths):
            for request, length in zip(requests, group):
                table[request.id] = length

    def on_generation_step_begin(self, batch: Sequence[Any]) -> None:
        """Checks the batch (admitted, distinct request ids); a round only runs after a step."""
        what = "TriAttentionManager.on_generation_step_begin"
        batch = _sequence(what, "batch", batch)
        for i, rid in enumerate(batch):
            self._admitted(what, f"batch[{i}]", rid)
            self._prefilled(what, f"batch[{i}]", rid)
        _distinct(what, "the batch", batch)

    def on_request_finish(self, request: Request) -> None:
        what = "TriAttentionManager.on_request_finish"
        request = _request(what, "request", request)
        self._admitted(what, "request", request.id)
        if request.id in self._seats:
            heapq.heappush(self._free_seats, self._seats[request.id])
        for table in (self.prompt_length, self.since_round, self.num_compressed_tokens, self.accounted_length,
                      self._seats, self._stored, self.local_accounted, self.local_since, self.local_compressed):
            table.pop(request.id, None)

    def rebind(self) -> None:
        """The cache's views changed (an engine that stages pages, or reallocated its pools): the next rounds bind
        them again, and capture their graphs again."""
        self._round = self._local_round = None

    def logical_position(self, rid) -> int:
        """The next token's absolute position: the cache length plus every token evicted so far."""
        self._admitted("TriAttentionManager.logical_position", "rid", rid)
        return self.kv_cache.length(rid) + self.num_compressed_tokens[rid]

    def _plan(self, batch: Sequence[tuple[Any, int]]) -> tuple[dict, dict, list, dict, dict, list]:
        """Checks a step's batch and returns, changing nothing: each request's cache length and since-round count
        after the step, and the requests due for a round (at most one round per step, however many tokens the
        step confirmed); then the same of a layer split's local cache (empty without one)."""
        what = "TriAttentionManager.on_generation_step_end"
        batch = _step_items(what, batch)  # every item first, then apply
        for i, (rid, _) in enumerate(batch):
            self._admitted(what, f"batch[{i}]", rid)
            self._prefilled(what, f"batch[{i}]", rid)
        groups = [(self.kv_cache, self.accounted_length, self.since_round, self.budget, "cache")]
        if self.local_cache is not None:
            groups.append((self.local_cache, self.local_accounted, self.local_since, self.local_budget,
                           "local layers' cache"))
        plan = []
        for cache, accounted, since_round, budget, which in groups:
            lengths, since, due = {}, {}, []
            for rid, confirmed in batch:
                length = self._cache_length(what, rid, cache)
                grew = length - accounted[rid]
                if confirmed != grew:
                    raise ValueError(f"{what}: request {rid!r} confirmed {confirmed} tokens, but its {which} grew by "
                                     f"{grew} since the last hook (length {length}, {accounted[rid]} accounted for); "
                                     f"call it once per step, after the step's KV is written")
                lengths[rid], since[rid] = length, since_round[rid] + confirmed
                if length - self.prompt_length[rid] > budget and since[rid] >= self.config.beta:
                    due.append(rid)
            plan += [lengths, since, due]
        return tuple(plan + [{}, {}, []] * (2 - len(groups)))

    def due(self, batch: Sequence[tuple[Any, int]]) -> list:
        """Requests a round would cover after this step (`on_generation_step_end`'s batch); changes nothing. Under
        a layer split, the scored layers' round (the local layers' runs on its own schedule)."""
        return self._plan(batch)[2]

    def on_generation_step_end(self, batch: Sequence[tuple[Any, int]]) -> None:
        lengths, since, rids, local_lengths, local_since, local_rids = self._plan(batch)
        if self.validate:  # the ranks must agree on which requests are due: each runs the round's collectives
            check_same_on_ranks("TriAttentionManager.on_generation_step_end", self.process_group,
                                self.kv_cache.device, manager_settings=self._settings, step=torch.tensor(
                                    [[lengths[r], self.prompt_length[r], since[r], r in rids] for r, _ in batch],
                                    dtype=torch.int64).view(-1, 4))
        # both refuse (raise) before anything moves: the local round's checks first, then the scored round
        local = self._local_round_args(local_rids) if local_rids else None
        new_lengths = self._run_round(rids) if rids else []
        new_local = self._run_local_round(local_rids, *local) if local_rids else []
        # committed only now: a refused step counts nothing, so the engine may call it again
        for rid, n in zip(rids, new_lengths):
            self.num_compressed_tokens[rid] += lengths[rid] - n
            lengths[rid], since[rid] = n, 0
        for rid, n in zip(local_rids, new_local):
            self.local_compressed[rid] += local_lengths[rid] - n
            local_lengths[rid], local_since[rid] = n, 0
        self.accounted_length.update(lengths)
        self.since_round.update(since)
        self.local_accounted.update(local_lengths)
        self.local_since.update(local_since)
        self.rounds += bool(rids)

    def local_length(self, rid) -> int:
        """A request's length in a layer split's local layers' cache (its prompt and newest tokens)."""
        self._admitted("TriAttentionManager.local_length", "rid", rid)
        if self.local_cache is None:
            raise ValueError("TriAttentionManager.local_length: the config has no layer split with local layers")
        return self.local_cache.length(rid)

    def _local_round_args(self, rids: list) -> tuple[list, int]:
        """A local round's checks (raising before anything moves) and what it needs: the lengths and the page
        table width."""
        cache = self.local_cache
        if not all(cache.resident(r) for r in rids):
            raise RuntimeError(f"TriAttentionManager: requests {[r for r in rids if not cache.resident(r)]} are "
                               f"offloaded from the local layers' cache; a round needs their pages on the GPU")
        lengths = [cache.length(r) for r in rids]
        return lengths, max(triton.cdiv(n, cache.page_size) for n in lengths)

    def _run_local_round(self, rids: list, lengths: list, width: int) -> list[int]:
        """One round of the local layers over the due requests: each keeps its prompt and newest local_budget
        tokens (``TriAttentionRound`` with no selector); returns the new lengths."""
        cache = self.local_cache
        if self._local_round is None or not self._local_round.fits(len(rids), width):
            self._local_round = TriAttentionRound(None, cache, len(rids), width, 0, self.cuda_graphs,
                                                  self.config.compaction_order, window=self.local_budget)
        prompts = [self.prompt_length[r] for r in rids]
        positions = [n + self.local_compressed[r] for r, n in zip(rids, lengths)]
        self._local_round.run(cache.page_table(rids, self._local_round.width, device="cpu"), lengths, prompts,
                              [0] * len(rids), positions)
        new_lengths = [p + self.local_budget for p in prompts]
        cache.shrink(rids, new_lengths)
        return new_lengths

    def _run_round(self, rids: list) -> list[int]:
        """One round over the due requests; returns their new lengths. Raises before anything moves when a
        request is offloaded or holds more unscored tokens than the protected tail."""
        cache = self.kv_cache
        if not all(cache.resident(r) for r in rids):  # refuse before anything moves
            raise RuntimeError(f"TriAttentionManager: requests {[r for r in rids if not cache.resident(r)]} are "
                               f"offloaded; a round needs their pages on the GPU")
        lengths = [cache.length(r) for r in rids]
        # the sinks join the prompt (never moved); the newest recent_window, and anything past the scored
        # bound, are the tail (kept after the chosen tokens)
        prompts = [self.prompt_length[r] + self.policy.sink_tokens for r in rids]
        window = self.policy.recent_window
        tails = [window + max(0, n - p - window - self.selector.max_decode) for n, p in zip(lengths, prompts)]
        if max(tails) > self.max_tail:  # refuse before anything moves
            raise RuntimeError(f"TriAttentionManager: a step confirmed more than beta={self.config.beta} tokens past "
                               f"a due round ({max(tails)} unscored); call on_generation_step_end every step")
        width = max(triton.cdiv(n, cache.page_size) for n in lengths)  # page-table columns this round needs
        seats = [self._seats[r] for r in rids] if self.selector.recency_prior else []
        if seats and (self.slot_positions is None or max(seats) >= self.slot_positions.shape[0]):
            self._grow_slot_positions(max(seats) + 1)
        if self._round is None or not self._round.fits(len(rids), width):
            self._round = TriAttentionRound(self.selector, cache, len(rids), width, self.max_tail, self.cuda_graphs,
                                            self.order, self.policy.recent_layers, self.slot_positions)
        page_table = cache.page_table(rids, self._round.width, device="cpu")
        positions = [self.logical_position(r) for r in rids]
        if self.validate:
            check_same_on_ranks("TriAttentionManager.on_generation_step_end", self.process_group, cache.device,
                                page_table=page_table, positions=torch.tensor(positions))
        self._round.run(page_table, [n - t for n, t in zip(lengths, tails)], prompts, tails, positions, seats,
                        [self._stored[r] for r in rids] if seats else [])
        # The chosen decode tokens land after the prompt and the sinks, then the tail: lengths known here,
        # nothing read back.
        new_lengths = [p + self.selector.budget + t for p, t in zip(prompts, tails)]
        if seats:
            self._stored.update((r, self.selector.budget + t) for r, t in zip(rids, tails))
        cache.shrink(rids, new_lengths)
        return new_lengths

    def _grow_slot_positions(self, seats: int) -> None:
        """A slot-position table for at least `seats` seats (a power of two), keeping what the old one held; the
        round rebinds to it."""
        old, C = self.slot_positions, self.selector.budget + self.max_tail
        table = torch.zeros(1 << (seats - 1).bit_length(), self.selector.rows, C, dtype=torch.int32,
                            device=self.kv_cache.device)
        if old is not None:
            table[:old.shape[0]].copy_(old)
        self.slot_positions, self._round = table, None


class TriAttentionRound:
    """The device half of a TriAttention round, on buffers bound once: selection -> packing -> compaction for the
    first R of up to `max_requests` due requests, on the current stream, with no host sync. With `cuda_graphs`,
    the first round of each R runs eagerly (loading the kernels) and is captured; later rounds of that R copy
    their inputs into the bound buffers and replay. Capacities grow in powers of two (the manager rebinds). A
    round over no requests does nothing. The layers in `recent_layers` keep their newest scored tokens (the
    compaction's layer windows); `selector` scores the others (``policy_selector``). In fill order those layers
    keep them as rings (``build_compaction_params(window_offsets=)``), so a round moves only what it evicts there.
    A ring turns by the tokens each round evicts, so its offset is the request's evicted tokens modulo the budget:
    its logical position less its cache length. With no selector (`selector` None), every layer keeps its newest
    `window` tokens: the round of a layer split's local layers, which scores nothing.

    A selector with a recency prior reads each decode token's logical position: `slot_positions` is the table
    of the stored ones, int32 ``[seats, selector rows, >= selector.budget + max_tail]``
    (``kvops.compaction.positions``), which each round reads and then updates through its compaction; ``run``
    takes each request's seat and stored slots."""

    def __init__(self, selector: TriAttentionSelector | None, cache, requests: int, width: int, max_tail: int,
                 cuda_graphs: bool, order: str = "fill", recent_layers: Sequence[int] = (),
                 slot_positions: torch.Tensor | None = None, window: int | None = None):
        what = "TriAttentionRound"
        check_int(what, "requests", requests, 1)  # capacities: at least one request, one page
        check_int(what, "width", width, 1)
        check_bool(what, "cuda_graphs", cuda_graphs)
        L = len(cache.views())
        if selector is None:
            self.budget = check_int(what, "window", window, 1)
            recent_layers = tuple(range(L))
        else:
            self.budget = selector.budget
            recent_layers = check_recent_layers(what, recent_layers, L)
        self.selector, self.requests, self.max_tail = selector, 1 << (requests - 1).bit_length(), max_tail
        self.width = 1 << (width - 1).bit_length()
        device = cache.device
        self.page_table = torch.full((self.requests, self.width), -1, dtype=torch.int32, device=device)
        # scored, prompt, tail, position, window offset; with slot positions: seat, stored slots, in-order base
        self.lengths = torch.zeros(8, self.requests, dtype=torch.int32, device=device)
        self.scored = [layer for layer in range(L) if layer not in recent_layers]
        # the compaction's rows: every layer's (one unread row when no layer is scored)
        heads = 0 if selector is None else selector.calibration.num_kv_heads
        rows = 1 if selector is None else decision_rows(selector.mode, L, heads)
        # per_layer_perhead rows of the scored layers (row l * heads + g) when some layers keep their newest
        self.rows_index = None if selector is None or rows == selector.rows else torch.tensor(
            [layer * heads + g for layer in self.scored for g in range(heads)], device=device)
        self.slot_positions = self.list_rows = None
        if selector is not None and selector.recency_prior:
            stored = selector.budget + max_tail  # a round leaves at most that many decode slots
            check_int32(what, self.page_table.device, slot_positions=(slot_positions, 3))
            if slot_positions.shape[1] != selector.rows or slot_positions.shape[2] < stored or \
                    not slot_positions.is_contiguous():
                raise ValueError(f"{what}: slot_positions must be contiguous int32 [seats, {selector.rows}, >= "
                                 f"{stored}], got {tuple(slot_positions.shape)}")
            self.slot_positions = slot_positions
            if self.rows_index is not None:
                self.list_rows = self.rows_index.to(torch.int32)
        kept = torch.zeros(self.requests, rows, self.budget, dtype=torch.int32, device=device)
        windows = [self.budget if layer in recent_layers else 0 for layer in range(L)]
        ring = order == "fill" and bool(recent_layers)
        self.params = build_compaction_params(cache.views(), self.page_table, kept, self.lengths[0], self.lengths[2],
                                              self.lengths[1], max_tail=max_tail, order=order,
                                              layer_windows=windows if recent_layers else None,
                                              window_offsets=self.lengths[4] if ring else None)
        # (a gloo group's all-reduce cannot be captured: such rounds run eagerly whatever cuda_graphs says)
        capture = cuda_graphs and device.type == "cuda" and (selector is None or capturable(selector.process_group))
        self.graphs: dict[int, torch.cuda.CUDAGraph] | None = {} if capture else None

    def fits(self, requests: int, width: int) -> bool:
        return requests <= self.requests and width <= self.width

    def _launch(self, R: int) -> None:
        scored, prompt, tail, position, _, seat, stored, base = self.lengths[:, :R]
        p, positions = self.params, None
        if self.slot_positions is not None:
            positions = SlotPositions(self.slot_positions, seat, stored, base)
        if self.selector is not None:
            picked = self.selector.select([p.pools[layer] for layer in self.scored] if len(self.scored) < len(p.pools)
                                          else p.pools, self.page_table[:R], scored, prompt, position,
                                          positions=positions)
            if self.rows_index is None:
                self.params.kept[:R].copy_(picked)
            else:
                self.params.kept[:R].index_copy_(1, self.rows_index, picked)
        compact(p, R)
        if positions is not None:  # what landed in each slot: after the compaction, which wrote the lists
            follow_slot_positions_(positions, p.sources[:R], p.destination_bases[:R], p.new_lengths[:R],
                                   None if p.moves is None else p.moves[:R], self.list_rows)

    def run(self, page_table: torch.Tensor, scored: Sequence[int], prompts: Sequence[int], tails: Sequence[int],
            positions: Sequence[int], seats: Sequence[int] = (), stored: Sequence[int] = ()) -> None:
        """One round over R requests: their page tables [R, width], scored lengths, prompts (with the sinks), tails
        and logical positions (the next token's: the cache length, scored + tail, plus every token evicted). With
        slot positions, each request's seat (a row of the table) and stored slots (what its last round left past
        its prompt, 0 before its first round; the slots from there on hold its tokens in order)."""
        what = "TriAttentionRound.run"
        check_int32(what, page_table=(page_table, 2))
        tracked = self.slot_positions is not None
        if not tracked:
            seats = stored = [0] * len(scored)
        for name, values in (("scored", scored), ("prompts", prompts), ("tails", tails), ("positions", positions),
                             ("seats", seats), ("stored", stored)):
            if not isinstance(values, (list, tuple)):
                raise TypeError(f"{what}: {name} must be a list of ints, got {type(values).__name__}")
            # int32 on the device; the fast test first (a round of many requests runs it each time)
            if not all(type(v) is int for v in values) or values and not 0 <= min(values) <= max(values) <= INT32_MAX:
                for i, v in enumerate(values):
                    check_int(what, f"{name}[{i}]", v, 0, INT32_MAX)
        R = len(scored)
        if not len(prompts) == len(tails) == len(positions) == len(seats) == len(stored) == R or \
                R > self.requests or tuple(page_table.shape) != (R, self.width):
            raise ValueError(f"{what}: page_table [R, {self.width}] and R scored lengths, prompts, tails, positions"
                             f"{', seats and stored slots' if tracked else ''} for R <= {self.requests} requests, got "
                             f"{tuple(page_table.shape)} and {len(scored)}, {len(prompts)}, {len(tails)}, "
                             f"{len(positions)}, {len(seats)}, {len(stored)}")
        if tracked:
            S, C = self.slot_positions.shape[0], self.budget + self.max_tail
            for r, (seat, held) in enumerate(zip(seats, stored)):
                if seat >= S or held > min(C, scored[r] + tails[r] - prompts[r]):
                    raise ValueError(f"{what}: request {r} needs a seat below {S} and at most {C} stored slots, "
                                     f"within its decode tokens; got seat {seat}, stored {held}")
            if len(set(seats)) != R:
                raise ValueError(f"{what}: two requests share a seat: {list(seats)}")
        for r, (n, p, t, q) in enumerate(zip(scored, prompts, tails, positions)):
            if p > n or n + t > INT32_MAX or q < n + t:
                raise ValueError(f"{what}: request {r} needs prompt <= scored, scored + tail within int32 and a "
                                 f"position at least scored + tail (its cache length), got prompt {p}, scored {n}, "
                                 f"tail {t}, position {q}")
        K = self.budget  # the rings' offsets: the tokens evicted so far, modulo the ring's size
        offsets = [(q - n - t) % K for n, t, q in zip(scored, tails, positions)] if self.params.window_offsets \
            is not None else [0] * R
        if R == 0:
            return
        self.page_table[:R].copy_(page_table, non_blocking=True)
        bases = [q - n - t + p for n, t, q, p in zip(scored, tails, positions, prompts)]  # slot 0 in order
        self.lengths[:, :R].copy_(torch.tensor([scored, prompts, tails, positions, offsets, seats, stored, bases],
                                               dtype=torch.int32), non_blocking=True)
        if self.graphs is None:
            self._launch(R)
        elif R in self.graphs:
            self.graphs[R].replay()
        else:
            self._launch(R)  # this round, eagerly; it also loads the kernels before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch(R)  # recorded, not run
            self.graphs[R] = graph


class NVFP4ColdPageManager(KVCacheCompressionManager):
    """Storage-bound: the physical KV length never changes and the hooks move nothing; pages leaving the GPU go
    through the NVFP4 codec of the cache's host tier. At admission it checks that a cache with a codec
    (``kv_cache.codec``, a ``PageBlobCodec``: ``PagedKVCache``'s host tier) encodes every layer with the config's
    row spec, so that no page goes cold in another format than the config names (build the cache with
    ``codec_specs=[config.row_spec()] * num_layers``). An engine cache without one runs the codec itself
    (``kvops.codecs``)."""

    def __init__(self, config: NVFP4ColdPageConfig, kv_cache, model_config: Mapping[str, Any]):
        if not isinstance(config, NVFP4ColdPageConfig):
            raise TypeError(f"NVFP4ColdPageManager: config must be an NVFP4ColdPageConfig, got "
                            f"{type(config).__name__}")
        codec = getattr(kv_cache, "codec", None)
        if isinstance(codec, PageBlobCodec):
            want = config.row_spec()
            for layer, spec in enumerate(codec.specs):
                if spec != want:
                    raise ValueError(f"NVFP4ColdPageManager: the cache's host tier encodes layer {layer} as {spec}, "
                                     f"the config as {want}: build the cache with "
                                     f"codec_specs=[config.row_spec()] * num_layers")
        super().__init__(config, kv_cache, model_config)


def _check_distinct_groups(scored, local) -> None:
    """A layer split's two caches hold different layers: one cache passed as both, or two over the same pools,
    would let one group's round compact the other group's layers (tokens lost, positions behind the writes)."""
    what = "TriAttentionManager"
    if scored is local:
        raise ValueError(f"{what}: under a layer split the scored and the local layers need a cache each; one "
                         f"{type(scored).__name__} was passed as both")
    if not (callable(getattr(scored, "views", None)) and callable(getattr(local, "views", None))):
        return  # create_compression_manager checks the interface; TriAttentionManager alone leaves it to the steps
    local_views = local.views()
    for i, p in enumerate(scored.views()):
        for j, q in enumerate(local_views):
            if overlap(p, q):
                raise ValueError(f"{what}: the scored layers' cache (layer {i} of its pools) and the local layers' "
                                 f"cache (layer {j}) share memory; each layer group needs pools of its own")


def _model_head_dim(model_config: Mapping[str, Any]) -> int | None:
    """The model's head_dim: its "head_dim" field, else hidden_size // num_attention_heads (None if neither)."""
    if model_config.get("head_dim") is not None:
        return model_config["head_dim"]
    hidden, heads = model_config.get("hidden_size"), model_config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _model_row_size(model_config: Mapping[str, Any]) -> int | None:
    """Elements of one cached KV row: the latent plus its RoPE part under latent attention (MLA), else head_dim."""
    if model_config.get("kv_lora_rank") is not None:
        return model_config["kv_lora_rank"] + model_config.get("qk_rope_head_dim", 0)
    return _model_head_dim(model_config)


def round_order(order: str, recent_window: int, beta: int) -> str:
    """The compaction order of a keep policy's rounds. A fill round leaves the newest tokens out of time order
    (they fill the evicted slots), while a round takes its protected window from the last slots: that holds
    only while the window is no longer than the beta tokens since the last round, which arrive in order. A longer
    window reaches back into the last round's tail, so its rounds run "ordered", which keeps the tail last and in
    order (docs/triattention.md, "Keep policy")."""
    check_choice("round_order", "order", order, ORDERS)
    check_int("round_order", "recent_window", recent_window)
    check_int("round_order", "beta", beta, 1)
    return "ordered" if order == "fill" and recent_window > beta else order


def policy_selector(what: str, calibration, budget: int, mode: str, max_decode: int, sink_tokens: int = 0,
                    recent_window: int = 0, recent_layers: tuple[int, ...] = (), recency_prior: float = 0.0, *,
                    k_scale=None, **selector_kwargs) -> TriAttentionSelector:
    """The selector of a round under a keep policy (a resolved ``KeepPolicy``'s fields, checked by
    ``check_keep_policy``): it chooses ``budget - sink_tokens - recent_window`` tokens among at most
    ``max_decode - sink_tokens - recent_window`` scored ones, over the layers not in recent_layers (their
    statistics and k_scale rows only), its scores leaning to recent tokens by recency_prior."""
    L = calibration.num_layers
    layers = check_recent_layers(what, recent_layers, L)
    scored = [layer for layer in range(L) if layer not in layers]
    if layers:
        calibration = calibration.for_layers(scored)
        if isinstance(k_scale, torch.Tensor) and k_scale.dim() in (1, 2):
            if k_scale.shape[0] != L:  # the selector would count only the scored layers in its message
                raise ValueError(f"{what}: k_scale must be [{L}] (per layer) or [{L}, KV heads], got shape "
                                 f"{tuple(k_scale.shape)}")
            k_scale = k_scale[scored]
    protected = sink_tokens + recent_window
    return TriAttentionSelector(calibration, budget - protected, mode, max_decode=max_decode - protected,
                                k_scale=k_scale, recency_prior=recency_prior, **selector_kwargs)


MANAGERS = {TriAttentionConfig: TriAttentionManager, NVFP4ColdPageConfig: NVFP4ColdPageManager}
# model_config's sizes create_compression_manager compares with the cache
MODEL_SIZES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
               "kv_lora_rank", "qk_rope_head_dim")


def create_compression_manager(config: KVCacheCompressionConfig, kv_cache, model_config: Mapping[str, Any], *,
                               process_group=None, kv_heads: range | None = None, validate: bool = False
                               ) -> KVCacheCompressionManager:
    """The manager for `config` on `kv_cache`, after admission checks that raise a clear error: one method per
    instance, a method/cache combination the method supports, and kernels for the cache's GPU.

    Under tensor parallelism (kvops.distributed), each rank creates its own on its own cache, which holds the
    rank's KV heads `kv_heads` (by default its block of the even split) of the model `model_config` describes.
    TriAttention takes `process_group`, `kv_heads` and `validate` (``TriAttentionManager``); the cold-page codec
    works on each rank's pools and communicates nothing."""
    what = "create_compression_manager"
    process_group = check_group(what, process_group)
    check_bool(what, "validate", validate)
    if isinstance(config, (list, tuple)):
        raise ValueError(f"{what}: one method per manager instance, got {len(config)} configs")
    if type(config) not in MANAGERS:
        raise ValueError(f"{what}: unsupported config {type(config).__name__}")
    if not isinstance(model_config, Mapping):
        raise TypeError(f"{what}: model_config must be a dict, got {type(model_config).__name__}")
    for key in MODEL_SIZES:  # the fields the checks below read, where given
        if model_config.get(key) is not None:
            check_int(f"{what}: model_config", key, model_config[key], 0 if key == "qk_rope_head_dim" else 1)
    needs = ("device",) + (("length", "resident", "page_table", "shrink", "views", "page_size")
                           if isinstance(config, TriAttentionConfig) else ())
    # a layer split's pair of caches (the scored layers', the local layers'): TriAttentionManager checks the pair
    split = isinstance(config, TriAttentionConfig) and config.layer_split and isinstance(kv_cache, (list, tuple))
    caches = list(kv_cache) if split else [kv_cache]
    for cache in caches:
        missing = [name for name in needs if not hasattr(cache, name)]
        if missing:
            raise TypeError(f"{what}: kv_cache must be a paged KV cache (kvops.cache.PagedKVCache or one with its "
                            f"interface{'; a pair of them under a layer split' if split else ''}); a "
                            f"{type(cache).__name__} has no {', '.join(missing)}")
    if any(getattr(c, "block_reuse", False) for c in caches) and not config.supports_block_reuse():
        raise ValueError(f"{what}: {config.algorithm} does not support a cache with block "
                         "reuse (prefix sharing): it rewrites pages in place")
    if any(getattr(c, "speculative_decoding", False) for c in caches) and not config.supports_speculative_decoding():
        raise ValueError(f"{what}: {config.algorithm} does not support speculative decoding")
    # the cache must hold the model's KV (and the calibration, TriAttention's, describes that model)
    pools = [getattr(c, "pools", None) for c in caches]
    layers = model_config.get("num_hidden_layers")
    model_heads = model_config.get("num_key_value_heads") or model_config.get("num_attention_heads")
    if None not in pools and layers is not None and sum(map(len, pools)) != layers:
        raise ValueError(f"{what}: the cache{'s' if split else ''} {'have' if split else 'has'} "
                         f"{sum(map(len, pools))} layers, the model {layers} (num_hidden_layers)")
    if isinstance(model_heads, int) and not isinstance(model_heads, bool) and model_heads > 0:
        held = rank_kv_heads(what, process_group, model_heads, kv_heads)
        for heads in (getattr(c, "num_kv_heads", None) for c in caches):
            if heads is not None and heads != len(held):
                raise ValueError(f"{what}: the cache has {heads} KV heads, the model {model_heads} "
                                 f"(num_key_value_heads)" + ("" if len(held) == model_heads else
                                                             f", of which this rank holds {len(held)} ({held})"))
    row = _model_row_size(model_config)
    where = "(head_dim, else hidden_size // num_attention_heads; kv_lora_rank + qk_rope_head_dim for latent attention)"
    for cache_row in (getattr(c, "head_dim", None) for c in caches):
        if cache_row is not None and row is not None and cache_row != row:
            raise ValueError(f"{what}: the cache's head_dim is {cache_row}, the model's KV rows hold {row} elements "
                             f"{where}")
    if isinstance(config, NVFP4ColdPageConfig) and row is not None and config.row_size != row:
        raise ValueError(f"{what}: NVFP4ColdPageConfig.row_size is {config.row_size}, the model's KV rows hold {row} "
                         f"elements {where}")
    device = torch.device(caches[0].device)
    if device.type == "cuda":
        arch = torch.cuda.get_device_capability(device)
        if arch not in SUPPORTED_ARCHS:
            raise RuntimeError(f"create_compression_manager: no kvops kernels for sm_{arch[0]}{arch[1]} "
                               f"(built for {', '.join(f'sm_{a}{b}a' for a, b in SUPPORTED_ARCHS)})")
    if isinstance(config, TriAttentionConfig):
        return TriAttentionManager(config, kv_cache, model_config, process_group=process_group, kv_heads=kv_heads,
                                   validate=validate)
    return MANAGERS[type(config)](config, kv_cache, model_config)
