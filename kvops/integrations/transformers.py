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

import collections
import functools
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import torch

from .._checks import check_bool, check_choice, check_device, check_int
from .._dispatch import python_op
from ..calibrate import require_transformers
from ..compaction import MODES, ORDERS, decision_rows
from ..config import (DEFAULT_MODE, MAX_POSITIONS, LayerSplit, check_recent_layers, check_round_sizes, layer_split,
                      resolve_keep_policy)
from ..attention import HEAD_DIMS, QUERY_DTYPES, decode_attention
from ..manager import TriAttentionRound, policy_selector, round_order
from ..nvfp4 import PageBlobCodec, RowSpec
from ..triattention import Calibration, load_calibration, validate_calibration

_transformers_module = require_transformers()


@python_op("transformers_write_slots_", mutates_args={"pool"})
def _write_slots(pool: torch.Tensor, slots: torch.Tensor, key_states: torch.Tensor,
                 value_states: torch.Tensor) -> None:
    """A step's K and V into `slots` of a pool's planes, in place. An op of its own because a compiled step that
    wrote into the plane views itself would copy both whole planes per layer (functionalized writes to a view of a
    graph input are not done in place)."""
    pool[:, 0].index_copy_(2, slots, key_states)
    pool[:, 1].index_copy_(2, slots, value_states)


def _tokens(query_length):
    """A step's token count, from what transformers passes as the query length (an int, or the step's positions:
    a 1-D tensor). check_int refuses any other kind."""
    if isinstance(query_length, torch.Tensor):
        if query_length.dim() != 1:
            raise ValueError(f"TriAttentionCache.get_mask_sizes: query_length must be an int or the step's 1-D "
                             f"positions, got a tensor of shape {tuple(query_length.shape)}")
        return query_length.shape[0]
    return query_length


_KV_DTYPES = (torch.bfloat16, torch.float16)


class _Layers(NamedTuple):
    """Some of a cache's layers, as a round reads them (``TriAttentionRound``: their pools and device)."""

    pools: list
    device: torch.device

    def views(self) -> list:
        return self.pools


@dataclass
class _Step:
    """An eager step between its first and last layer's write: its tokens count as held only once the last layer
    has written them (a step stopped or refused half-way holds nothing)."""

    start: int           # the slot of its first token (in the scored layers)
    local_start: int     # and in the local layers (a layer split's)
    tokens: int
    shape: torch.Size    # every layer's key_states and value_states
    first: bool          # the cache's first step (the prompt): it allocated the pools
    layer: int = 0       # the layer it writes next


class _PoolLayer(_transformers_module.cache_utils.CacheLayerMixin):
    """One layer's view of the shared pools: the held tokens of plane K and V, ``[batch, kv_head, held, dim]``."""

    is_sliding = False

    def __init__(self, cache: "TriAttentionCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx

    @property
    def is_compileable(self) -> bool:
        return self.cache.static

    @property
    def is_initialized(self) -> bool:
        return self.cache.pools is not None

    @is_initialized.setter
    def is_initialized(self, value):  # the base class sets it; the cache's pools are the state
        pass

    def lazy_initialization(self, key_states, value_states) -> None:
        """The cache allocates its pools at a step's first layer, once it has checked the step."""

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache._write(self.layer_idx, key_states, value_states)

    def get_seq_length(self):
        return self.cache._offset if self.cache.static and self.cache._offset is not None else self.cache.held

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self.cache._mask_sizes(_tokens(query_length)), 0

    def get_max_length(self) -> int:
        return -1

    @property
    def keys(self):
        return None if self.cache.pools is None else self.cache.pools[self.layer_idx][:, 0, :, :self.cache._held_by(
            self.layer_idx)]

    @keys.setter
    def keys(self, value):  # the base class initialises keys/values; the pools are the storage
        pass

    @property
    def values(self):
        return None if self.cache.pools is None else self.cache.pools[self.layer_idx][:, 1, :, :self.cache._held_by(
            self.layer_idx)]

    @values.setter
    def values(self, value):
        pass


class TriAttentionCache(_transformers_module.Cache):
    """A transformers cache whose layers are kvops pools, compacted by TriAttention rounds.

    Parameters
    ----------
    config : transformers.PretrainedConfig or dict
        The model's config (layers, heads, RoPE), or its ``to_dict()``.
    calibration : str, os.PathLike, dict or Calibration
        A shipped name (``kvops.triattention.SHIPPED``), a file from ``kvops calibrate``, its loaded dict, or a
        loaded Calibration; checked against the config's layers, heads, KV heads, head_dim and number of RoPE
        frequencies (a Calibration's frequencies are its own: ``load_calibration`` takes them from the config, the
        file or its arguments).
    budget, beta : int
        Generated tokens kept per round, and the tokens between rounds: a round runs once a row holds more than
        ``budget`` generated tokens and ``beta`` arrived since its last round, so it never holds more than
        ``budget + beta``.
    mode : str
        ``"per_head"`` (the default), ``"union"`` or ``"per_layer_perhead"`` (``kvops.compaction.MODES``).
    sink_tokens, recent_window, recent_layers, recency_prior
        The keep policy (``kvops.config.TriAttentionConfig``): the first `sink_tokens` and newest
        `recent_window` generated tokens always stay (inside the budget), the layers in `recent_layers` keep
        their newest tokens instead of the scored ones, and the scores lean to recent tokens by `recency_prior`
        (``TriAttentionSelector``). Each left at None takes the mode's measured default
        (``kvops.config.resolve_keep_policy``); 0, 0, () and 0.0 give bare scoring.
    compaction_order : str
        ``"fill"`` (only the kept tokens past the new length move; attention is over a set, so slot order does
        not matter) or ``"ordered"`` (``kvops.compaction.ORDERS``).
    cuda_graphs : bool
        Replay each round size from a CUDA graph on the GPU (as ``TriAttentionManager`` does).
    layer_split : bool or kvops.config.LayerSplit
        Per-layer budgets: the same ``num_layers x budget`` decode tokens split by what each layer's attention
        needs (docs/triattention.md, "Per-layer budgets"). True takes the split the calibration's measured layer
        sensitivity gives (``kvops.config.layer_split``; ``kvops calibrate`` writes the sensitivity); a
        ``LayerSplit`` gives it. Its local layers keep their newest ``local_budget`` generated tokens, with
        rounds of their own, in pools sized to that; the other layers are scored under the keep policy for
        ``split.budget`` (its recent layers are the split's local ones). The model must first pass through
        ``install_layer_masks``, which hands each local layer its own attention mask.
    round_history : int or None
        How many of the last rounds ``rounds`` keeps (what each kept, on the device: ``batch x list rows x
        budget`` int64, 289 rows a request for Qwen3-8B in per_layer_perhead), None for every round;
        ``num_rounds`` counts them all.
    static : bool
        Static shapes for ``torch.compile`` of the decode step (see the module's docstring): attention reads all
        ``prompt + budget + beta + 1`` slots under a mask instead of the held ones.

    Notes
    -----
    A cache serves one batch (the first step's batch size, KV dtype and device) of the model its config
    describes. A step is checked before anything changes: its length against the slots free after a due round,
    and no row offloaded, when its masks are sized; its K/V against the config and the pools (batch size, heads,
    head_dim, dtype, device) at every layer. A due round runs once those checks passed (at the step's first layer;
    in a static cache when the masks are sized, which cannot see the batch size), and stays if a later layer is
    refused. A step's tokens count as held once its last layer has written them: a step refused at any layer, or
    a forward that stops half-way (it raised), holds nothing. A first step that stops half-way can also be a model
    with fewer layers than the config's: the next call then raises and the cache is empty again. A write to layer
    ``num_layers`` right after the first step's last layer (a model with more layers) is refused and empties the
    cache, so a cache built for fewer layers than its model holds nothing.
    """

    def __init__(self, config, calibration, *, budget: int = 2048, beta: int = 128, mode: str = DEFAULT_MODE,
                 sink_tokens: int | None = None, recent_window: int | None = None,
                 recent_layers: tuple[int, ...] | None = None, recency_prior: float | None = None,
                 compaction_order: str = "fill", cuda_graphs: bool = True, static: bool = False,
                 layer_split: bool | LayerSplit = False, round_history: int | None = 1):
        what = "TriAttentionCache"
        check_round_sizes(what, budget, beta)
        if round_history is not None:
            check_int(what, "round_history", round_history, 0, sys.maxsize)  # a deque's maxlen
        check_choice(what, "mode", mode, MODES)
        check_choice(what, "compaction_order", compaction_order, ORDERS)
        check_bool(what, "cuda_graphs", cuda_graphs)
        check_bool(what, "static", static)
        if isinstance(config, _transformers_module.PretrainedConfig):
            model_config = config.to_dict()
        elif isinstance(config, Mapping):
            model_config = dict(config)
        else:
            raise TypeError(f"{what}: config must be a transformers PretrainedConfig or its to_dict(), got "
                            f"{type(config).__name__}")
        if isinstance(calibration, Calibration):
            validate_calibration(calibration, model_config, what=what)
        elif isinstance(calibration, (str, os.PathLike, Mapping)):
            calibration = load_calibration(calibration, model_config)
        else:
            raise TypeError(f"{what}: calibration must be a shipped name, a path, a loaded dict or a Calibration, "
                            f"got {type(calibration).__name__}")
        layer_types = model_config.get("layer_types") or ()
        if not isinstance(layer_types, (list, tuple)):
            raise TypeError(f"{what}: config layer_types must be a list of layer kinds, got "
                            f"{type(layer_types).__name__} {layer_types!r}")
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"{what}: the model has {sorted(set(layer_types))} layers; this cache holds "
                             f"full-attention layers only (sliding-window layers need their own eviction)")
        self.num_layers = calibration.num_layers
        self.num_kv_heads, self.head_dim = calibration.num_kv_heads, calibration.head_dim
        super().__init__(layers=[_PoolLayer(self, i) for i in range(self.num_layers)])
        split = self._layer_split(layer_split, calibration, budget, recent_layers)
        self.layer_split = split if split.local_layers else None
        self.local_layers = split.local_layers
        # the scored layers (every layer without a split): the round's layers, calibration and budget
        self.scored_layers = tuple(layer for layer in range(self.num_layers) if layer not in self.local_layers)
        budget, self.local_budget = split.budget, split.local_budget
        if self.local_layers:
            calibration = calibration.for_layers(list(self.scored_layers))
        # the generated tokens a row can hold (a step may overshoot a due round by one): all of them are scored,
        # so no token past max_decode is ever dropped unscored
        self.max_generated = budget + beta + 1
        self.max_local_generated = self.local_budget + beta + 1  # the same of a layer split's local layers
        # the keep policy for the scored layers (checked before anything is allocated)
        policy = resolve_keep_policy(what, mode, budget, beta, calibration.num_layers, sink_tokens, recent_window,
                                     () if self.local_layers else recent_layers, recency_prior)
        self.selector = policy_selector(what, calibration, budget, mode, self.max_generated, *policy)
        self.sink_tokens, self.recent_window, self.recent_layers, self.recency_prior = policy
        # slot bookkeeping per compaction list row: the decision rows, and the window row of the recent layers
        self._list_rows = decision_rows(mode, calibration.num_layers, self.num_kv_heads) + bool(self.recent_layers)
        self.budget, self.beta, self.cuda_graphs = budget, beta, cuda_graphs
        self.order = round_order(compaction_order, self.recent_window, beta)
        self.local_order = compaction_order  # the local layers' rounds: rings in fill order
        self.round_history = round_history
        self.static = static
        self._host: torch.Tensor | None = None
        self._offloaded: set[int] = set()
        self._reset()

    def _layer_split(self, split, calibration: Calibration, budget: int, recent_layers) -> LayerSplit:
        """The cache's `layer_split` argument as a LayerSplit (no local layers: every layer at `budget`)."""
        what = "TriAttentionCache"
        if split is False:
            return LayerSplit((), budget, budget)
        if split is True:
            if calibration.layer_sensitivity is None:
                raise ValueError(f"{what}: layer_split=True needs the calibration's layer sensitivity, which this "
                                 f"calibration lacks (kvops calibrate measures it); or pass a LayerSplit")
            split = layer_split(calibration.layer_sensitivity, budget)
        elif not isinstance(split, LayerSplit):
            raise TypeError(f"{what}: layer_split must be a bool or a kvops.config.LayerSplit, got "
                            f"{type(split).__name__} {split!r}")
        local = check_recent_layers(f"{what}: layer_split", split.local_layers, self.num_layers)
        for name in ("local_budget", "budget"):
            check_int(f"{what}: layer_split", name, getattr(split, name), 1, MAX_POSITIONS)
        if local and recent_layers:
            raise ValueError(f"{what}: recent_layers {list(recent_layers)} and a layer split both name layers on "
                             f"recency; the split's local layers {list(local)} are them (leave recent_layers None)")
        return split._replace(local_layers=local)

    def _reset(self) -> None:
        """The state of a cache that holds nothing (no pools, no rounds)."""
        # static: the slot the next token is written to (= held) and the logical length, on the device
        self._offset: torch.Tensor | None = None
        self._logical: torch.Tensor | None = None
        self.pools: list[torch.Tensor] | None = None  # per layer [batch, 2, kv_head, capacity, dim]
        self._held = 0             # tokens each row holds (physical; mirrors _offset in a static cache)
        self.evicted = 0           # tokens each row has dropped (logical length = held + evicted)
        self.prompt = 0            # the first step's length: never evicted
        self._round_held = 0       # what each row held after the prompt or the last round
        # the same of a layer split's local layers (their own rounds; static: their write offset on the device)
        self._local_offset: torch.Tensor | None = None
        self._local_held = self.local_evicted = self._local_round_held = 0
        self.num_local_rounds = 0
        self._masked = -1          # the last layer install_layer_masks' hook handed its mask (eager steps)
        # logical position of each slot, [batch, list rows, capacity]
        self.slot_positions: torch.Tensor | None = None
        # the last round_history rounds (all with None): (the logical position of the first token after it, the
        # kept logical positions of its generated tokens [batch, list rows, budget] in slot order), on the
        # device; and how many rounds ran
        self.rounds: collections.deque[tuple[int, torch.Tensor]] = collections.deque(maxlen=self.round_history)
        self.num_rounds = 0
        self._round: TriAttentionRound | None = None
        self._local_round: TriAttentionRound | None = None  # a layer split's local layers'
        # with a recency prior: the round's table of slot positions, a seat per row (TriAttentionRound)
        self._seat_positions: torch.Tensor | None = None
        self._step: _Step | None = None  # an eager step between its first and last layer
        self._last = False  # whether the call before was the first step's last layer

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

    @property
    def local_held(self) -> int:
        """Tokens each row holds in a layer split's local layers (``held`` without a split)."""
        if not self.local_layers:
            return self.held
        if self.static and self._local_offset is not None:
            self._local_held = int(self._local_offset)
        return self._local_held

    def _held_by(self, layer_idx: int) -> int:
        return self.local_held if layer_idx in self.local_layers else self.held

    def get_seq_length(self, layer_idx: int = 0):
        """The logical length: every token seen (evicted ones too), from which the model takes RoPE positions (a
        device tensor once a static cache holds tokens)."""
        if self.static and self._logical is not None:
            return self._logical
        return self.held + self.evicted

    def get_query_offset(self, layer_idx: int = 0):
        """The slot of the next token: the held tokens precede it, after a due round (a device tensor in a static
        cache)."""
        self._entry()
        if self.static and self._offset is not None:
            return self._offset
        return self._held if self._offloaded else self._after_round(self._held)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """Sizes the next step's mask, after checking the step's length (the slots free after a due round) and
        that no row is offloaded. A static cache runs a due round here, where the host last sees the cache before a
        compiled step writes (generate builds the mask outside the graph); an eager one at the step's first
        layer, after checking its K/V."""
        q = _tokens(query_length)
        if q == 0 and self.pools is not None:  # generate slices off the tokens the cache already holds
            raise ValueError(f"TriAttentionCache.get_mask_sizes: a step of no new tokens: the cache already holds "
                             f"a sequence of {self.get_seq_length()} tokens, as long as this input or longer; call "
                             f"reset() (or build a new cache) to start a new prompt")
        q = check_int("TriAttentionCache.get_mask_sizes", "query_length", q, 1)
        self._entry()
        if self.pools is not None or self._offloaded:
            held = self._check_step(q)
            if self.static:
                self._settle(held)
        return self._mask_sizes(q), 0

    def _mask_sizes(self, q: int) -> int:
        if self.static:  # every slot; the first step (the prompt) allocates q + max_generated of them
            return self._capacity() if self.pools is not None else q + self.max_generated
        return (self._held if self._offloaded else self._after_round(self._held)) + q

    def _capacity(self, local: bool = False) -> int:
        """The slots of a scored layer's pool (a local one's with `local`)."""
        return self.pools[self.local_layers[0] if local else self.scored_layers[0]].shape[3]

    @property
    def device(self) -> torch.device:
        if self.pools is None:
            raise RuntimeError("TriAttentionCache.device: the cache holds no device pools (no step yet, or every row "
                               "offloaded)")
        return self.pools[0].device

    def views(self) -> list[torch.Tensor]:
        """The per-layer pools as kvops' 5-D [page, plane, head, token, dim] views (a page is a batch row)."""
        return self.pools

    def reset(self) -> None:
        """Empty the cache: no pools, no rounds, no host tier; the next step is a new prompt."""
        self._host, self._offloaded = None, set()
        self._reset()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: batch row i takes what row ``beam_idx[i]`` holds (every row holds as many tokens, so the
        counters stay). `beam_idx`: an integer tensor of one index per row, each in [0, batch) (read back: one
        sync)."""
        what = "TriAttentionCache.reorder_cache"
        if self._offloaded:
            raise RuntimeError(f"{what}: rows {sorted(self._offloaded)} are offloaded; onboard them first")
        if self.pools is None:
            raise ValueError(f"{what}: the cache holds no tokens yet")
        B = self.pools[0].shape[0]
        if not isinstance(beam_idx, torch.Tensor) or beam_idx.dim() != 1 or beam_idx.shape[0] != B or \
                beam_idx.dtype.is_floating_point or beam_idx.dtype.is_complex or beam_idx.dtype == torch.bool:
            raise ValueError(f"{what}: beam_idx must be a 1-D integer tensor of {B} row indices, got "
                             f"{getattr(beam_idx, 'dtype', type(beam_idx).__name__)} "
                             f"{tuple(getattr(beam_idx, 'shape', ()))}")
        check_device(what, beam_idx=beam_idx)  # not meta
        # read back (beam search syncs at every step anyway): an index out of range would fail half-way on the CPU
        # and trip a device assert on the GPU
        bad = (beam_idx < 0) | (beam_idx >= B)
        if bool(bad.any()):
            raise ValueError(f"{what}: beam_idx must hold row indices in [0, {B}), got {beam_idx.tolist()}")
        self._entry()
        idx = beam_idx.to(self.device, torch.long)
        for t in (*self.pools, self.slot_positions, self._seat_positions):
            if t is not None:
                t.copy_(t.index_select(0, idx))
        self.rounds = collections.deque(((end, kept.index_select(0, idx)) for end, kept in self.rounds),
                                        maxlen=self.round_history)  # each round's history is per row too

    def _unsupported(self, name: str):
        raise NotImplementedError(f"TriAttentionCache.{name}: not supported; the cache holds one batch that advances "
                                  f"in lockstep and evicts tokens (assisted or speculative decoding and contrastive "
                                  f"search need a cache that can take tokens back or change its batch)")

    def crop(self, *args, **kwargs):
        self._unsupported("crop")

    def batch_repeat_interleave(self, *args, **kwargs):
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, *args, **kwargs):
        self._unsupported("batch_select_indices")

    def early_initialization(self, *args, **kwargs):
        raise NotImplementedError("TriAttentionCache.early_initialization: not supported; the first step (the "
                                  "prompt) sizes the pools")

    def layer_mask(self, layer_idx: int, mask):
        """Layer `layer_idx`'s attention mask, from the mask transformers built for every layer
        (``install_layer_masks`` calls it before the layer's attention). A scored layer's is that mask; a layer
        split's local layer holds another count, so its columns are mask columns of the same kind: a held prompt
        slot's own column (the prompt, with its padding, comes first in both), another held slot the column of a
        held generated token (every query sees them all: the scored layers' last held one), and the step's new
        tokens the mask's new-token columns, which follow the scored layers' held ones. A 4-D tensor mask (bool,
        or additive) maps; no mask stays none."""
        local = layer_idx in self.local_layers
        if not torch.compiler.is_compiling():
            if isinstance(layer_idx, int) and not isinstance(layer_idx, bool) and layer_idx >= self.num_layers:
                self._check_layer(layer_idx, "TriAttentionCache.layer_mask")  # raises, as update would
            check_int("TriAttentionCache.layer_mask", "layer_idx", layer_idx, 0, self.num_layers - 1)
            if local and mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
                raise TypeError(f"TriAttentionCache.layer_mask: a layer split's local layers need a 4-D mask "
                                f"tensor (eager, sdpa or kvops attention), got {type(mask).__name__}")
            self._masked = layer_idx  # only once the mask is taken: a refused call marks nothing
        if not local or mask is None:
            return mask
        q, width = mask.shape[-2], mask.shape[-1]
        if self.static and self.pools is None:  # the first step (the prompt) sizes the pools
            scored, local, slots = 0, 0, q + self.max_local_generated
        elif self.static:  # every slot, the offsets on the device: the step's new tokens at [offset, offset + q)
            scored, local, slots = self._offset, self._local_offset, self._capacity(True)
        else:  # the held tokens after a due round (the step's first layer runs it: maybe after this one)
            scored = width - q
            local = self._step.local_start if self._step is not None else self._after_round(self._local_held, True)
            slots = local + q
        slot = torch.arange(slots, device=mask.device)
        # a held generated local slot implies a held generated scored one: slot >= prompt makes scored > prompt
        column = torch.where(slot < local, slot.clamp_max(scored - 1), slot - local + scored).clamp(0, width - 1)
        mapped = mask.index_select(-1, column)
        if not self.static:
            return mapped
        hidden = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        return mapped.masked_fill(slot >= local + q, hidden)  # past the step's tokens: the clamp's columns

    # -- storage ----------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write a step's K and V (``[batch, kv_head, tokens, head_dim]``) of layer `layer_idx`; returns the
        layer's K and V for attention. A step writes layers 0 to num_layers - 1 in order."""
        return self._write(layer_idx, key_states, value_states)

    def _allocate(self, key_states: torch.Tensor) -> None:
        """The first step's pools, sized by its length (the prompt); nothing is kept if an allocation fails."""
        B, H, q, D = key_states.shape
        capacity = q + self.max_generated
        local_capacity = q + self.max_local_generated
        if max(capacity, local_capacity) > MAX_POSITIONS:
            raise ValueError(f"TriAttentionCache.update: the prompt ({q} tokens) + budget + beta + 1 must be at most "
                             f"{MAX_POSITIONS} slots (int32 cache positions), got {max(capacity, local_capacity)}")
        device = key_states.device
        pools = [torch.zeros(B, 2, H, local_capacity if layer in self.local_layers else capacity, D,
                             dtype=key_states.dtype, device=device) for layer in range(self.num_layers)]
        slot_positions = torch.arange(capacity, device=device).expand(B, self._list_rows, capacity).clone()
        # static: the write offset, the logical length, and a layer split's local layers' write offset
        counters = [torch.zeros((), dtype=torch.long, device=device) if i < 2 or self.local_layers else None
                    for i in range(3)] if self.static else None
        self.pools, self.slot_positions, self.prompt, self._round_held = pools, slot_positions, q, q
        self._local_round_held = q
        if self.static:
            self._offset, self._logical, self._local_offset = counters
            self._mark_static()

    def _mark_static(self) -> None:
        """What a compiled step writes in place keeps its address (cudagraphs replay on it)."""
        if not torch.compiler.is_compiling():
            for t in (*self.pools, self._offset, self._logical, self._local_offset, self.slot_positions):
                if t is not None:
                    torch._dynamo.mark_static_address(t)

    def _write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.static and torch.compiler.is_compiling():  # the host checked the step (get_mask_sizes)
            if not 0 <= layer_idx < self.num_layers:
                raise ValueError(f"TriAttentionCache.update: layer_idx {layer_idx} is out of range: the cache "
                                 f"holds {self.num_layers} layer(s)")
            return self._write_static(layer_idx, key_states, value_states)
        self._check_layer(layer_idx)
        local = layer_idx in self.local_layers
        if local:
            masked, self._masked = self._masked, -1  # consumed: each step's hook marks the layer again
            if masked != layer_idx:  # it would attend under the scored layers' mask
                self._abandon()
                raise RuntimeError(f"TriAttentionCache.update: layer {layer_idx} keeps a layer split's local count "
                                   f"and needs its own attention mask: pass the model through "
                                   f"install_layer_masks(model) (kvops.integrations.transformers) first")
        if layer_idx == 0:
            self._begin_step(key_states, value_states)
        else:
            self._continue_step(layer_idx, key_states, value_states)
        try:
            if self.static:
                out = self._write_static(layer_idx, key_states, value_states)
            else:
                start = self._step.local_start if local else self._step.start
                end = start + self._step.tokens
                pool = self.pools[layer_idx]
                pool[:, 0, :, start:end] = key_states
                pool[:, 1, :, start:end] = value_states
                out = pool[:, 0, :, :end], pool[:, 1, :, :end]
        except BaseException:
            self._abandon()  # nothing of a step that failed to write stays
            raise
        if layer_idx == self.num_layers - 1:
            self._commit()
        else:
            self._step.layer = layer_idx + 1
        return out

    def _write_static(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Tensor ops on device-side offsets only: the same graph every step, no host read."""
        q, pool = key_states.shape[2], self.pools[layer_idx]
        steps = torch.arange(q, device=pool.device)
        _write_slots(pool, steps + (self._local_offset if layer_idx in self.local_layers else self._offset),
                     key_states, value_states)
        if layer_idx == self.num_layers - 1:
            slots = steps + self._offset
            logical = (steps + self._logical).expand(*self.slot_positions.shape[:2], q)
            self.slot_positions.index_copy_(2, slots, logical)
            self._offset.add_(q)
            self._logical.add_(q)
            if self.local_layers:
                self._local_offset.add_(q)
        return pool[:, 0], pool[:, 1]

    def _check_layer(self, layer_idx, what: str = "TriAttentionCache.update") -> None:
        """A write's layer_idx, or the refusal of its step (past a first step's last layer: the cache emptied)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            self._abandon()
            raise TypeError(f"{what}: layer_idx must be an int, got {type(layer_idx).__name__} {layer_idx!r}")
        if not 0 <= layer_idx < self.num_layers:
            if self._last and layer_idx == self.num_layers:
                self._reset()  # the model goes on past the first step's last layer: a cache for fewer layers
            self._abandon()
            raise ValueError(f"{what}: layer_idx {layer_idx} is out of range: the cache holds {self.num_layers} "
                             f"layer(s) (its config's num_hidden_layers); build it from the model's config")
        if layer_idx > 0 and (self._step is None or self._step.layer != layer_idx):
            expect = "a step's first write (layer 0)" if self._step is None else f"layer {self._step.layer}"
            self._abandon()
            raise ValueError(f"{what}: a step starts at layer 0 and writes its layers in order; the next write is "
                             f"{expect}, got layer_idx {layer_idx}")

    def _check_kv(self, layer_idx: int, key_states, value_states, shape: torch.Size | None = None) -> int:
        """A step's K and V at a layer: 4-D, the config's KV heads and head_dim, bfloat16 or float16, and (once
        the pools exist) their batch size, dtype and device; `shape`: the step's first layer's. Returns the
        step's token count."""
        what = f"TriAttentionCache.update (layer_idx {layer_idx})"
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        check_device(what, key_states=key_states, value_states=value_states)
        if key_states.dim() != 4:
            raise ValueError(f"{what}: key_states must be 4-D [batch, kv_heads, tokens, head_dim], got shape "
                             f"{tuple(key_states.shape)}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"{what}: value_states must have key_states' shape {tuple(key_states.shape)}, got "
                             f"{tuple(value_states.shape)}")
        B, H, q, D = key_states.shape
        if (H, D) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"{what}: key_states has {H} KV heads of head_dim {D}; the config describes "
                             f"{self.num_kv_heads} KV heads of head_dim {self.head_dim} (build the cache from the "
                             f"model's config)")
        if B < 1 or q < 1:
            raise ValueError(f"{what}: key_states must hold at least one row and one token, got shape "
                             f"{tuple(key_states.shape)}")
        if key_states.dtype not in _KV_DTYPES or value_states.dtype != key_states.dtype:
            raise TypeError(f"{what}: the kvops kernels hold bfloat16 or float16 KV, got key_states "
                            f"{key_states.dtype} and value_states {value_states.dtype}; load the model in one of "
                            f"them")
        if self.pools is not None:
            pool = self.pools[layer_idx]
            if B != pool.shape[0]:
                raise ValueError(f"{what}: key_states has batch size {B}; the cache holds {pool.shape[0]} rows (a "
                                 f"cache serves one batch: build another for another batch size)")
            if key_states.dtype != pool.dtype or key_states.device != pool.device:
                raise ValueError(f"{what}: key_states is {key_states.dtype} on {key_states.device}; the cache "
                                 f"holds {pool.dtype} on {pool.device}")
        if shape is not None and key_states.shape != shape:
            raise ValueError(f"{what}: key_states has shape {tuple(key_states.shape)}; the step's layer 0 had "
                             f"{tuple(shape)}")
        return q

    def _check_step(self, q: int) -> int:
        """That a step of q tokens may run: no row offloaded, and it fits the slots free after a due round.
        Returns what each row holds now (read once: a device read in a static cache)."""
        if self._offloaded:
            raise RuntimeError(f"TriAttentionCache: rows {sorted(self._offloaded)} are offloaded; onboard them "
                               f"before generating")
        held = self.held
        groups = [(self._after_round(held), self._capacity(), "")]
        if self.local_layers:
            groups.append((self._after_round(self.local_held, True), self._capacity(True), "local layers "))
        for after, capacity, which in groups:
            if after + q > capacity:
                raise ValueError(f"TriAttentionCache: {after + q} tokens do not fit the {which}{capacity} slots "
                                 f"(prompt + budget + beta + 1): a row holds {after} after any due round, so this "
                                 f"step may add at most {capacity - after} tokens, not {q}; split it into shorter "
                                 f"steps (a round runs before a step once beta tokens came since the last)")
        return held

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The host's side of a step at its first layer's write (eager, or a static cache's uncompiled step):
        every check, then the pools (the first step), or a due round (an eager cache)."""
        self._entry()
        if self._offloaded:
            self._check_step(1)  # raises
        q = self._check_kv(0, key_states, value_states)
        first = self.pools is None
        if first:
            self._allocate(key_states)
            start = 0
        else:
            start = self._settle(self._check_step(q))
        self._step = _Step(start, self._local_held if self.local_layers else start, q, key_states.shape, first)

    def _continue_step(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        step, pool = self._step, self.pools[layer_idx]
        if not (key_states.shape == step.shape and value_states.shape == step.shape and
                key_states.dtype == value_states.dtype == pool.dtype and
                key_states.device == value_states.device == pool.device):
            try:
                self._check_kv(layer_idx, key_states, value_states, step.shape)
            except BaseException:
                self._abandon()  # a refused layer voids its step
                raise

    def _commit(self) -> None:
        step, end = self._step, self._step.start + self._step.tokens
        if not self.static:  # the static write set them on the device
            logical = step.start + self.evicted
            self.slot_positions[..., step.start:end] = torch.arange(logical, logical + step.tokens,
                                                                    device=self.slot_positions.device)
        self._held, self._step, self._last = end, None, step.first
        self._local_held = step.local_start + step.tokens

    def _abandon(self) -> None:
        """Drop the step in progress: nothing of it stays (a first step takes its pools with it)."""
        step, self._step = self._step, None
        if step is not None and step.first:
            self._reset()

    def _entry(self) -> None:
        """At every call but a step's later layers: the step the last forward left half-way is dropped (it
        raised). A first step left half-way may also be a model with fewer layers than the cache's config: the
        cache is emptied and this call raises."""
        self._last = False
        step = self._step
        if step is None:
            return
        self._abandon()
        if step.first:
            raise RuntimeError(f"TriAttentionCache: the last forward wrote {step.layer} of the cache's "
                               f"{self.num_layers} layers and stopped: the model has fewer layers than the config "
                               f"the cache was built from, or that forward raised; the cache holds nothing")

    # -- eviction ---------------------------------------------------------------------------------------------
    def _due(self, held: int, local: bool = False) -> bool:
        """Whether a round is due in the scored layers holding `held` (in the local ones, with `local`)."""
        budget, since = (self.local_budget, self._local_round_held) if local else (self.budget, self._round_held)
        return held - self.prompt > budget and held - since >= self.beta

    def _after_round(self, held: int, local: bool = False) -> int:
        """What each row holds once a due round has run."""
        return self.prompt + (self.local_budget if local else self.budget) if self._due(held, local) else held

    def _settle(self, held: int) -> int:
        """Run the due rounds and return the tokens each row then holds in the scored layers. They run before the
        next step writes (at the step's first layer, or in a static cache when the next forward sizes its masks),
        so every layer of a step sees the same held tokens."""
        if self.local_layers and self._due(self.local_held, True):
            self._keep_newest()
        return self._compress(held) if self._due(held) else held

    def _keep_newest(self) -> None:
        """A round of the local layers over the whole batch: each keeps the prompt and its newest local_budget
        generated tokens, through the compaction with every layer a window (``TriAttentionRound`` with no
        selector, as the manager's local round; in fill order the window is a ring, so a round moves only the
        tokens since the last one)."""
        B, held, end = self.pools[0].shape[0], self.local_held, self.prompt + self.local_budget
        if self._local_round is None:
            local = _Layers([self.pools[layer] for layer in self.local_layers], self.device)
            self._local_round = TriAttentionRound(None, local, B, 1, 0, self.cuda_graphs, self.local_order,
                                                  window=self.local_budget)
        table = torch.arange(B, dtype=torch.int32)[:, None]
        self._local_round.run(table, [held] * B, [self.prompt] * B, [0] * B, [held + self.local_evicted] * B)
        self.num_local_rounds += 1
        self.local_evicted += held - end
        self._local_held = self._local_round_held = end
        if self.static:
            self._local_offset.fill_(end)

    def _compress(self, held: int) -> int:
        """One round over the whole batch, before the next token is written: keep `budget` of the generated tokens
        of the `held` each row holds (the sinks join the prompt, the newest recent_window are the round's tail).
        Returns what each row holds after it."""
        B, W = self.pools[0].shape[0], self.recent_window
        selector, tracked = self.selector, bool(self.selector.recency_prior)
        if self._round is None:
            if tracked and self._seat_positions is None:  # kept when the round rebinds (an onboard)
                self._seat_positions = torch.zeros(B, selector.rows, selector.budget + W, dtype=torch.int32,
                                                   device=self.device)
            scored = _Layers([self.pools[layer] for layer in self.scored_layers], self.device)
            self._round = TriAttentionRound(selector, scored, B, 1, W, self.cuda_graphs, self.order,
                                            self.recent_layers, self._seat_positions)
        table = torch.arange(B, dtype=torch.int32)[:, None]
        protected = self.prompt + self.sink_tokens
        seats = list(range(B)) if tracked else []
        stored = [selector.budget + W if self.num_rounds else 0] * B if tracked else []
        self._round.run(table, [held - W] * B, [protected] * B, [W] * B, [held + self.evicted] * B, seats, stored)
        # what landed at protected + m came from slot sources[m] (the move's own lists): follow the logical
        # positions. A row no layer reads (per_layer_perhead's rows of the recent layers) has no list: -1.
        landed = self._round.params.sources[:B, :, :self.selector.budget + W].long()
        end = self.prompt + self.budget
        self.slot_positions[..., protected:end] = torch.where(
            landed >= 0, self.slot_positions.gather(-1, landed.clamp_min(0)), -1)
        if self.round_history != 0:
            self.rounds.append((held + self.evicted, self.slot_positions[..., self.prompt:end].clone()))
        self.num_rounds += 1
        self.evicted += held - end
        self._held = self._round_held = end
        if self.static:
            self._offset.fill_(end)
        return end

    # -- host tier --------------------------------------------------------------------------------------------
    def _codec(self, pools) -> PageBlobCodec:
        return PageBlobCodec(pools, [RowSpec.full(self.head_dim, plane_dim=1)] * self.num_layers)

    def _row(self, what: str, row) -> int:
        """A batch row: a Python int below the batch size."""
        if isinstance(row, bool) or not isinstance(row, int):
            check_int(what, "row", row)  # raises TypeError
        if self.pools is None and self._host is None:
            raise ValueError(f"{what}: the cache holds no tokens yet")
        rows = self.pools[0].shape[0] if self.pools is not None else self._shapes[0][0][0]
        return check_int(what, "row", row, 0, rows - 1)

    def offload(self, row: int) -> None:
        """Encode batch row `row` into pinned host memory (NVFP4); the device pools go once every row is out."""
        what = "TriAttentionCache.offload"
        row = self._row(what, row)
        self._entry()
        if self.pools is None or row in self._offloaded:
            raise ValueError(f"{what}: row {row} is not a resident batch row (offloaded: {sorted(self._offloaded)})")
        codec = self._codec(self.pools)
        host = self._host if self._host is not None else codec.allocate(self.pools[0].shape[0])
        pairs = torch.tensor([[row, row]], dtype=torch.int32, device=self.device)
        codec.encode(self.pools, host, pairs)
        self._host = host
        self._offloaded.add(row)
        if len(self._offloaded) == self.pools[0].shape[0]:
            torch.cuda.synchronize() if self.device.type == "cuda" else None
            self._shapes = [(p.shape, p.dtype, p.device) for p in self.pools]
            self.pools = None

    def onboard(self, row: int) -> None:
        """Decode batch row `row` back from the host tier into the device pools (reallocated if released). The
        host copy is validated first: a corrupt one raises ValueError and changes nothing."""
        what = "TriAttentionCache.onboard"
        row = self._row(what, row)
        self._entry()
        if row not in self._offloaded:
            raise ValueError(f"{what}: row {row} is not offloaded (offloaded: {sorted(self._offloaded)})")
        pools = self.pools if self.pools is not None else \
            [torch.zeros(s, dtype=t, device=d) for s, t, d in self._shapes]
        pairs = torch.tensor([[row, row]], dtype=torch.int32, device=pools[0].device)
        try:  # validate: a blob without valid global scales raises before any page is written
            self._codec(pools).decode(self._host, pools, pairs, validate=True)
        except ValueError as e:
            raise ValueError(f"{what}: row {row}'s host copy cannot be decoded: {e}") from e
        if self.pools is None:
            self.pools = pools
            self._round = self._local_round = None  # their buffers were bound to the released pools
            if self.static:
                self._mark_static()
        self._offloaded.discard(row)


GROUPED_SDPA = "kvops_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa`` attention, except that grouped-query heads under a mask shared by the heads read K
    and V without repeating them.

    A static cache needs a mask (it hides the slots past the held tokens), and transformers' ``sdpa`` then repeats K
    and V once per query head: G times the cache's bytes written and read again per layer, at a decode step and at
    every prefill chunk (at batch 221 of Qwen3-8B's 3201 slots a chunk's repeat takes 12 GB). Here one query token
    packs the G query heads of a KV head as G query rows of it under the row's mask; several tokens take one call
    per group member g (query head h * G + g of each KV head h), each under the mask as it is, so neither K and V
    nor the mask is copied. Select it with ``model.set_attn_implementation(GROUPED_SDPA)``; every other case is
    ``sdpa``'s own, but attention sinks (``s_aux``) and a soft cap (``softcap``) raise ``ValueError``.
    """
    for name, what in (("softcap", "a soft cap"), ("s_aux", "attention sinks")):
        # a result that ignored either would be wrong: some transformers releases' sdpa ignore a soft cap, and
        # none applies sinks
        if kwargs.get(name) is not None:
            raise ValueError(f"grouped_sdpa: sdpa attention does not apply {what} ({name}); use eager or "
                             f"flex_attention")
    groups = getattr(module, "num_key_value_groups", 1)
    B, Hq, q, D = query.shape
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or groups == 1 or \
            Hq != key.shape[1] * groups or kwargs.get("position_bias") is not None:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)  # a mask per head would need packing too
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, attn_mask=attention_mask,
                             dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"))
    if q == 1:
        out = sdpa(query.reshape(B, Hq // groups, groups, D), key, value)
    else:
        grouped = query.reshape(B, Hq // groups, groups, q, D)
        out = torch.stack([sdpa(grouped[:, :, g], key, value) for g in range(groups)], dim=2)
    return out.reshape(B, Hq, q, value.shape[-1]).transpose(1, 2).contiguous(), None


KVOPS_ATTENTION = "kvops_decode"


def kvops_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention whose decode steps (one query token per row) run kvops' decode attention
    (``kvops.attention.decode_attention``): grouped-query heads read K and V once, the KV length is split across
    the SMs, and each row reads only the slots its mask admits. Any cache's layers serve as a dense paged cache
    of one page per row (``TriAttentionCache``'s pools, ``StaticCache``, ``DynamicCache``).

    A row's mask (transformers' padding and causal mask at a decode step) is read on the device, so a compiled
    step keeps one graph: each token is its own page, the page of a slot the mask leaves out is -1 (which the
    kernel skips), and the row's first and last admitted slots bound what it reads. A mask with holes (right
    padding, zeros inside ``attention_mask``) reads exactly its admitted slots, eager and compiled. Every other
    case (prefill, a float mask, dropout, a head_dim or dtype the kernels do not serve, K and V of unlike strides)
    is ``grouped_sdpa``'s, which refuses attention sinks and a soft cap.
    Select it with ``model.set_attn_implementation(KVOPS_ATTENTION)``.
    """
    B, Hq, q, D = query.shape
    N = key.shape[2]
    if q != 1 or kwargs.get("dropout", 0.0) or kwargs.get("position_bias") is not None or \
            kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None or kwargs.get("sliding_window") or \
            D not in HEAD_DIMS or value.shape[-1] != D or query.dtype not in QUERY_DTYPES or \
            (attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or
                                             attention_mask.shape[0] not in (1, B) or
                                             attention_mask.shape[1:] != (1, 1, N))):  # one mask row per batch row
        return grouped_sdpa(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is None:
        table = torch.arange(B, dtype=torch.int32, device=query.device)[:, None]
        lengths, starts = torch.full((B,), N, dtype=torch.int32, device=query.device), None
    else:
        pages = _token_pages(key, value)
        if pages is None:
            return grouped_sdpa(module, query, key, value, attention_mask, **kwargs)
        key, value, per_row = pages
        admitted = attention_mask[:, 0, -1].expand(B, N)
        # int64 throughout: with N symbolic (a compiled step), an int32 where(..., N) made inductor emit a
        # reduction whose accumulator changes type in its loop (a Triton compile error, torch 2.11)
        slot = torch.arange(N, device=query.device)
        lengths = torch.where(admitted, slot + 1, 0).amax(-1).to(torch.int32)
        starts = torch.where(admitted, slot, N).amin(-1).to(torch.int32)
        row = torch.arange(B, device=query.device)[:, None]
        table = torch.where(admitted, row * per_row + slot, -1).to(torch.int32)
    out = decode_attention(query, key, value, table, lengths, starts=starts, scale=kwargs.get("scaling"))
    return out, None


def _token_pages(key: torch.Tensor, value: torch.Tensor):
    """`key` and `value` ``[B, kv_heads, N, head_dim]`` as caches of one-token pages ``[pages, kv_heads, 1,
    head_dim]`` (views, nothing copied): slot n of row b is page ``b * per_row + n``. Returns the two views and
    per_row, or None when their strides allow no such view (K and V strided unlike each other, or a row not a
    whole number of token rows)."""
    B, H, N, D = key.shape
    stride = key.stride()
    if value.stride() != stride or stride[3] != 1 or (N > 1 and stride[2] < D):
        return None
    token = stride[2] if N > 1 else D
    if B > 1 and stride[0] % token:
        return None
    per_row = stride[0] // token if B > 1 else N
    pages = (B - 1) * per_row + N
    return tuple(t.as_strided((pages, H, 1, D), (token, stride[1], token, 1)) for t in (key, value)) + (per_row,)


_sdpa = _transformers_module.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"]
for _name, _function in ((GROUPED_SDPA, grouped_sdpa), (KVOPS_ATTENTION, kvops_attention)):
    _transformers_module.AttentionInterface.register(_name, _function)
    _transformers_module.masking_utils.AttentionMaskInterface.register(
        _name, _transformers_module.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks


def install_layer_masks(model):
    """Let a ``TriAttentionCache`` with a layer split hand each of its local layers their own attention mask.

    transformers builds one mask for every full-attention layer, sized by what the scored layers hold; a local
    layer holds fewer tokens. A forward pre-hook on each attention module passes its mask through the cache the
    layer is called with (``TriAttentionCache.layer_mask``), which maps the mask's columns onto the layer's slots;
    with any other cache, or none, it changes nothing. Installed once per model (a second call does nothing);
    returns the model. The attention must take a 4-D mask or none (eager, sdpa, kvops' own; flash attention's
    causal alignment needs none)."""
    from ..calibrate import attention_modules

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"install_layer_masks: model must be a transformers model, got {type(model).__name__}")

    def hook(layer, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, TriAttentionCache) or "attention_mask" not in kwargs:
            return None
        return args, {**kwargs, "attention_mask": cache.layer_mask(layer, kwargs["attention_mask"])}

    for layer, attention in attention_modules(model).items():
        if not getattr(attention, "_kvops_layer_masks", False):
            attention.register_forward_pre_hook(functools.partial(hook, layer), with_kwargs=True)
            attention._kvops_layer_masks = True
    return model


def cache_keyword(model) -> str:
    """The keyword ``generate`` and ``forward`` take a cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_bytes(cache: TriAttentionCache) -> int:
    """Bytes of K and V the cache holds on the device (the held slots of every layer)."""
    if cache.pools is None:
        return 0
    p = cache.pools[0]
    held = len(cache.scored_layers) * cache.held + len(cache.local_layers) * cache.local_held
    return held * p.shape[0] * 2 * p.shape[2] * p.shape[4] * p.dtype.itemsize


__all__ = ["GROUPED_SDPA", "KVOPS_ATTENTION", "TriAttentionCache", "cache_keyword", "grouped_sdpa",
           "install_layer_masks", "kv_bytes", "kvops_attention"]
