"""A Hugging Face transformers cache with TriAttention eviction and an NVFP4 host tier.

``TriAttentionCache`` is a ``transformers.Cache`` for ``model.generate(past_key_values=...)`` (or ``cache=`` in
transformers >= 5.24). Each layer's K and V live in one kvops pool ``[batch, plane, kv_head, slot, head_dim]``
(a page is a whole sequence, so the page table is ``[[0], [1], ...]``) and the kvops ops run on it unchanged:
every ``beta`` generated tokens past ``budget``, before the next step reads the cache, a round selects
(``TriAttentionSelector``) and compacts in place (``kvops.compaction``), on the GPU from a CUDA graph per batch
size as ``TriAttentionManager`` does.

Positions stay logical. The cache reports the logical length (``get_seq_length``: every token seen, evicted ones
too), from which the model derives the RoPE positions of new tokens, while the attention masks are sized by what
the cache physically holds (``get_mask_sizes``, ``get_query_offset``): every held token precedes the new ones, and
the prompt, where left padding lives, is never evicted, so the padding mask reads the same columns it would
without eviction. Batch rows advance in lockstep under ``generate`` (one token per step, one prompt length
after padding), so every row holds the same number of tokens and a round covers the whole batch.

With ``static=True`` the cache has the static shapes ``torch.compile`` needs (as transformers' ``StaticCache``):
attention reads every slot of the pools, the mask hides the slots past the held tokens, and the write offset, the
logical length and the slots' logical positions live in device tensors that a step updates in place, so a compiled
decode step (``generate`` compiles it by itself on the GPU for such a cache) has no graph break, never recompiles
and reads no Python int. The host reads the held count back and runs due rounds between steps, where ``generate``
builds the next step's mask (``get_mask_sizes``) outside the compiled graph; a caller that compiles the forward
itself builds the mask outside it too.

``offload(row)`` / ``onboard(row)`` move one row's KV to pinned host memory through the NVFP4 codec and back (for
multi-turn sessions); once every row is offloaded the device pools are released.
"""

from __future__ import annotations

import inspect

import torch

from .._checks import check_bool, check_int
from .._dispatch import python_op
from ..calibrate import require_transformers
from ..compaction import ORDERS
from ..manager import TriAttentionRound
from ..nvfp4 import PageBlobCodec, RowSpec
from ..triattention import Calibration, TriAttentionSelector, load_calibration

_transformers_module = require_transformers()


@python_op("transformers_write_slots_", mutates_args={"pool"})
def _write_slots(pool: torch.Tensor, slots: torch.Tensor, key_states: torch.Tensor,
                 value_states: torch.Tensor) -> None:
    """A step's K and V into `slots` of a pool's planes, in place. An op of its own because a compiled step that
    wrote into the plane views itself would copy both whole planes per layer (functionalized writes to a view of a
    graph input are not done in place)."""
    pool[:, 0].index_copy_(2, slots, key_states)
    pool[:, 1].index_copy_(2, slots, value_states)


def _tokens(query_length) -> int:
    """A step's token count, from what transformers passes as the query length (an int or the positions)."""
    return query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)


class _PoolLayer(_transformers_module.cache_utils.CacheLayerMixin):
    """One layer's view of the shared pools: the held tokens of plane K and V, ``[batch, kv_head, held, dim]``."""

    is_sliding = False

    def __init__(self, cache: "TriAttentionCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx

    @property
    def is_compileable(self) -> bool:
        return self.cache.static

    def lazy_initialization(self, key_states, value_states) -> None:
        self.cache._allocate(key_states)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache._write(self.layer_idx, key_states, value_states)

    def get_seq_length(self):
        return self.cache._offset if self.cache.static and self.cache._offset is not None else self.cache.held

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        q = _tokens(query_length)
        if self.cache.static:  # every slot; the first update (the prompt) allocates q + max_generated of them
            return (self.cache.pools[0].shape[3] if self.cache.pools is not None else q + self.cache.max_generated), 0
        return self.cache.held + q, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def keys(self):
        return None if self.cache.pools is None else self.cache.pools[self.layer_idx][:, 0, :, :self.cache.held]

    @keys.setter
    def keys(self, value):  # the base class initialises keys/values; the pools are the storage
        pass

    @property
    def values(self):
        return None if self.cache.pools is None else self.cache.pools[self.layer_idx][:, 1, :, :self.cache.held]

    @values.setter
    def values(self, value):
        pass


class TriAttentionCache(_transformers_module.Cache):
    """A transformers cache whose layers are kvops pools, compacted by TriAttention rounds.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (layers, heads, RoPE).
    calibration : str, os.PathLike or Calibration
        A shipped name (``kvops.triattention.SHIPPED``), a file from ``kvops calibrate``, or a loaded Calibration.
    budget, beta : int
        Generated tokens kept per round, and the tokens between rounds: a round runs once a row holds more than
        ``budget`` generated tokens and ``beta`` arrived since its last round, so it never holds more than
        ``budget + beta``.
    mode : str
        ``"union"``, ``"per_head"`` or ``"per_layer_perhead"`` (``kvops.compaction.MODES``).
    compaction_order : str
        ``"fill"`` (only the kept tokens past the new length move; attention is over a set, so slot order does
        not matter) or ``"ordered"`` (``kvops.compaction.ORDERS``).
    cuda_graphs : bool
        Replay each round size from a CUDA graph on the GPU (as ``TriAttentionManager`` does).
    static : bool
        Static shapes for ``torch.compile`` of the decode step (see the module's docstring): attention reads all
        ``prompt + budget + beta + 1`` slots under a mask instead of the held ones.
    """

    def __init__(self, config, calibration, *, budget: int = 2048, beta: int = 128, mode: str = "union",
                 compaction_order: str = "fill", cuda_graphs: bool = True, static: bool = False):
        what = "TriAttentionCache"
        model_config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if not isinstance(calibration, Calibration):
            calibration = load_calibration(calibration, model_config)
        check_int(what, "beta", beta, 1)
        check_bool(what, "static", static)
        if compaction_order not in ORDERS:
            raise ValueError(f"{what}: compaction_order must be one of {ORDERS}, got {compaction_order!r}")
        if any(kind != "full_attention" for kind in model_config.get("layer_types") or ()):
            raise ValueError(f"{what}: the model has {sorted(set(model_config['layer_types']))} layers; this cache "
                             f"holds full-attention layers only (sliding-window layers need their own eviction)")
        self.num_layers = model_config["num_hidden_layers"]
        super().__init__(layers=[_PoolLayer(self, i) for i in range(self.num_layers)])
        # the generated tokens a row can hold (a step may overshoot a due round by one): all of them are scored,
        # so no token past max_decode is ever dropped unscored
        self.max_generated = budget + beta + 1
        self.selector = TriAttentionSelector(calibration, budget, mode, max_decode=self.max_generated)
        self.budget, self.beta, self.order, self.cuda_graphs = budget, beta, compaction_order, cuda_graphs
        self.static = static
        # static: the slot the next token is written to (= held) and the logical length, on the device
        self._offset: torch.Tensor | None = None
        self._logical: torch.Tensor | None = None
        self._start = 0            # the slot a step's first token goes to (set at its first layer's write)
        self.pools: list[torch.Tensor] | None = None  # per layer [batch, 2, kv_head, capacity, dim]
        self._held = 0             # tokens each row holds (physical; mirrors _offset in a static cache)
        self.evicted = 0           # tokens each row has dropped (logical length = held + evicted)
        self.prompt = 0            # the first update's length: never evicted
        self._round_held = 0       # what each row held after the prompt or the last round
        self.slot_positions: torch.Tensor | None = None  # logical position of each slot, [batch, rows, capacity]
        # each round: (the logical position of the first token after it, the kept logical positions of its
        # generated tokens [batch, rows, budget] in slot order)
        self.rounds: list[tuple[int, torch.Tensor]] = []
        self._round: TriAttentionRound | None = None
        self._host: torch.Tensor | None = None
        self._offloaded: set[int] = set()
        self._writing = False      # between a step's first and last layer: no round may move tokens then

    # -- what transformers asks -------------------------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        return self.static

    @property
    def held(self) -> int:
        """Tokens each row holds (physical slots in use). A static cache counts them on the device: reading this
        waits for it (generate waits at every step anyway, for its stopping check)."""
        if self.static and self._offset is not None:
            self._held = int(self._offset)
        return self._held

    def get_seq_length(self, layer_idx: int = 0):
        """The logical length: every token seen (evicted ones too), from which the model takes RoPE positions (a
        device tensor once a static cache holds tokens)."""
        if self.static and self._logical is not None:
            return self._logical
        return self.held + self.evicted

    def get_query_offset(self, layer_idx: int = 0):
        """The slot of the next token: the held tokens precede it (a device tensor in a static cache)."""
        self._settle()
        return self._offset if self.static and self._offset is not None else self.held

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """Sizes the next step's mask. A due round runs first. A static cache checks the step here, where the
        host last sees it before a compiled step writes (generate builds the mask outside the graph)."""
        held = self._settle()
        if self.static and self.pools is not None:
            self._check_step(_tokens(query_length), held)
        return self.layers[layer_idx].get_mask_sizes(query_length)

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    def views(self) -> list[torch.Tensor]:
        """The per-layer pools as kvops' 5-D [page, plane, head, token, dim] views (a page is a batch row)."""
        return self.pools

    # -- storage ----------------------------------------------------------------------------------------------
    def _allocate(self, key_states: torch.Tensor) -> None:
        if self.pools is not None:
            return
        if key_states.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"TriAttentionCache: the kvops kernels hold bfloat16 or float16 KV, got "
                            f"{key_states.dtype}; load the model in one of them")
        B, H, q, D = key_states.shape
        self.prompt = q
        capacity = q + self.max_generated
        self.pools = [torch.zeros(B, 2, H, capacity, D, dtype=key_states.dtype, device=key_states.device)
                      for _ in range(self.num_layers)]
        self.slot_positions = torch.arange(capacity, device=key_states.device).expand(
            B, self.selector.rows, capacity).clone()
        self._round_held = q
        if self.static:
            self._offset = torch.zeros((), dtype=torch.long, device=key_states.device)
            self._logical = torch.zeros((), dtype=torch.long, device=key_states.device)
            self._mark_static()

    def _mark_static(self) -> None:
        """What a compiled step writes in place keeps its address (cudagraphs replay on it)."""
        if not torch.compiler.is_compiling():
            for t in (*self.pools, self._offset, self._logical, self.slot_positions):
                torch._dynamo.mark_static_address(t)

    def _write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        q, pool = key_states.shape[2], self.pools[layer_idx]
        if self.static:  # tensor ops on device-side offsets only: the same graph every step, no host read
            steps = torch.arange(q, device=pool.device)
            slots = steps + self._offset
            if layer_idx == 0:
                logical = (steps + self._logical).expand(*self.slot_positions.shape[:2], q)
                self.slot_positions.index_copy_(2, slots, logical)
            _write_slots(pool, slots, key_states, value_states)
            if layer_idx == self.num_layers - 1:
                self._offset.add_(q)
                self._logical.add_(q)
            return pool[:, 0], pool[:, 1]
        if layer_idx == 0:
            self._begin_step(q)
        if layer_idx == self.num_layers - 1:
            self._writing = False
        start, end = self._start, self._start + q
        pool[:, 0, :, start:end] = key_states
        pool[:, 1, :, start:end] = value_states
        return pool[:, 0, :, :end], pool[:, 1, :, :end]

    def _check_step(self, q: int, held: int) -> None:
        if self._offloaded:
            raise RuntimeError(f"TriAttentionCache: rows {sorted(self._offloaded)} are offloaded; onboard them "
                               f"before generating")
        if held + q > self.pools[0].shape[3]:
            raise RuntimeError(f"TriAttentionCache: {held + q} tokens do not fit the {self.pools[0].shape[3]} "
                               f"slots; a step may add at most beta + 1 tokens past the prompt")

    def _begin_step(self, q: int) -> None:
        """The host's side of an eager step, at its first layer's write: a due round, the step's check and its
        slots' logical positions."""
        start = self._settle()
        self._check_step(q, start)
        logical = start + self.evicted
        self.slot_positions[..., start:start + q] = torch.arange(logical, logical + q, device=self.device)
        # the step's tokens count as held from here: no round may run until its last layer has written them
        self._start, self._held, self._writing = start, start + q, self.num_layers > 1

    # -- eviction ---------------------------------------------------------------------------------------------
    def _settle(self) -> int:
        """Run a due round and return the tokens each row then holds (read once: a device read in a static
        cache). It runs when the cache is next read (the next forward sizes its masks before any layer writes),
        so every layer of a step sees the same held tokens."""
        if self.pools is None or self._offloaded or self._writing:
            return self._held
        held = self.held
        if held - self.prompt > self.budget and held - self._round_held >= self.beta:
            held = self._compress(held)
        return held

    def _compress(self, held: int) -> int:
        """One round over the whole batch, before the next token is written: keep `budget` of the generated tokens
        of the `held` each row holds. Returns what each row holds after it."""
        B = self.pools[0].shape[0]
        if self._round is None:
            self._round = TriAttentionRound(self.selector, self, B, 1, 0, self.cuda_graphs, self.order)
        table = torch.arange(B, dtype=torch.int32)[:, None]
        self._round.run(table, [held] * B, [self.prompt] * B, [0] * B, [held + self.evicted] * B)
        # what landed at prompt + m came from slot sources[m] (the move's own lists): follow the logical positions
        landed = self._round.params.sources[:B, :self.selector.rows, :self.budget].long()
        end = self.prompt + self.budget
        self.slot_positions[..., self.prompt:end] = self.slot_positions.gather(-1, landed)
        self.rounds.append((held + self.evicted, self.slot_positions[..., self.prompt:end].clone()))
        self.evicted += held - end
        self._held = self._round_held = end
        if self.static:
            self._offset.fill_(end)
        return end

    # -- host tier --------------------------------------------------------------------------------------------
    def _codec(self) -> PageBlobCodec:
        D = self.pools[0].shape[-1]
        return PageBlobCodec(self.pools, [RowSpec.full(D, plane_dim=1)] * self.num_layers)

    def offload(self, row: int) -> None:
        """Encode batch row `row` into pinned host memory (NVFP4); the device pools go once every row is out."""
        if self.pools is None or not 0 <= row < self.pools[0].shape[0] or row in self._offloaded:
            raise ValueError(f"TriAttentionCache.offload: row {row!r} is not a resident batch row")
        codec = self._codec()
        if self._host is None:
            self._host = codec.allocate(self.pools[0].shape[0])
        pairs = torch.tensor([[row, row]], dtype=torch.int32, device=self.device)
        codec.encode(self.pools, self._host, pairs)
        self._offloaded.add(row)
        if len(self._offloaded) == self.pools[0].shape[0]:
            torch.cuda.synchronize() if self.device.type == "cuda" else None
            self._shapes = [(p.shape, p.dtype, p.device) for p in self.pools]
            self.pools = None

    def onboard(self, row: int) -> None:
        """Decode batch row `row` back from the host tier into the device pools (reallocated if released)."""
        if row not in self._offloaded:
            raise ValueError(f"TriAttentionCache.onboard: row {row!r} is not offloaded")
        if self.pools is None:
            self.pools = [torch.zeros(s, dtype=t, device=d) for s, t, d in self._shapes]
            self._round = None  # its buffers were bound to the released pools
            if self.static:
                self._mark_static()
        codec = self._codec()
        pairs = torch.tensor([[row, row]], dtype=torch.int32, device=self.device)
        codec.decode(self._host, self.pools, pairs)
        self._offloaded.discard(row)


GROUPED_SDPA = "kvops_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa`` attention, except that one query token of grouped-query heads under a mask reads K
    and V without repeating them: the G query heads of a KV head become G query rows of that head.

    A static cache needs a mask (it hides the slots past the held tokens), and transformers' ``sdpa`` then repeats K
    and V once per query head in a compiled step: G times the cache's bytes written and read again per layer.
    Select it with ``model.set_attn_implementation(GROUPED_SDPA)``; every other case is ``sdpa``'s own.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    B, Hq, q, D = query.shape
    if attention_mask is None or attention_mask.shape[1] != 1 or groups == 1 or q != 1 or \
            kwargs.get("position_bias") is not None:  # a mask per head would need packing too
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    packed = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, Hq // groups, groups, D), key, value, attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"))
    return packed.reshape(B, Hq, 1, D).transpose(1, 2).contiguous(), None


_sdpa = _transformers_module.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]
_transformers_module.AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
_transformers_module.masking_utils.AttentionMaskInterface.register(
    GROUPED_SDPA, _transformers_module.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks


def cache_keyword(model) -> str:
    """The keyword ``generate`` and ``forward`` take a cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_bytes(cache: TriAttentionCache) -> int:
    """Bytes of K and V the cache holds on the device (the held slots of every layer)."""
    if cache.pools is None:
        return 0
    p = cache.pools[0]
    return cache.num_layers * p.shape[0] * 2 * p.shape[2] * cache.held * p.shape[4] * p.dtype.itemsize


__all__ = ["GROUPED_SDPA", "TriAttentionCache", "cache_keyword", "grouped_sdpa", "kv_bytes"]
