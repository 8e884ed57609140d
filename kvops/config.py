"""Compression configs: one method per config, validated at construction, round-tripping through dict/JSON.

An engine reads the block from its own config file (``config_from_dict``); the admission contract
(``changes_physical_kv_length``, ``supports_block_reuse``, ``supports_speculative_decoding``) tells it what the
method does to its cache before anything runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, NamedTuple

import torch

from ._checks import INT32_MAX, check_bool, check_choice, check_int, check_number
from .nvfp4.layout import DEFAULT_SCALE, MAX_MIDDLE_DIMS, RowSpec, _check_spec
from .triattention.calibration import SHIPPED, LayerSensitivity, calibration_file
from .compaction.compact import MODES, ORDERS

# The eviction mode a TriAttention config or cache takes by default: the best on a trained model, with its keep
# policy (resolve_keep_policy; benchmarks/RESULTS.md, "Eviction quality")
DEFAULT_MODE = "per_head"
# Cache positions are int32 in every kernel: a round scores up to budget + 2*beta decode tokens past the prompt.
MAX_POSITIONS = INT32_MAX


@dataclass(frozen=True)
class KVCacheCompressionConfig:
    """Base of every method config. Subclasses set `algorithm` and the admission contract."""

    algorithm: ClassVar[str] = ""
    changes_physical_kv_length: ClassVar[bool] = False

    def supports_block_reuse(self) -> bool:
        return True

    def supports_speculative_decoding(self) -> bool:
        return True

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class NVFP4ColdPageConfig(KVCacheCompressionConfig):
    """Cold pages in NVFP4 (kvops.nvfp4): rows of `row_size` elements, RoPE dims at `rope_range` (start,
    length) kept lossless (`skip_rope_quantization`) or carrying a 2FP4 residual on their first `residual_dim`
    dims, one global scale policy. The hot KV length is unchanged; only pages leaving the GPU shrink."""

    algorithm: ClassVar[str] = "nvfp4_cold_page"
    row_size: int = 128
    rope_range: tuple[int, int] | None = None
    skip_rope_quantization: bool = False
    residual_dim: int = 0
    global_scale: str | float = DEFAULT_SCALE
    plane_dim: int | None = 1

    def __post_init__(self):
        what = "NVFP4ColdPageConfig"
        check_int(what, "row_size", self.row_size, 16)
        if self.rope_range is not None:
            rope = self.rope_range
            if not isinstance(rope, (tuple, list)) or len(rope) != 2:
                raise ValueError(f"{what}.rope_range: must be (start, length) or None, got {rope!r}")
            for name, v in zip(("start", "length"), rope):
                check_int(what, f"rope_range {name}", v)
            object.__setattr__(self, "rope_range", tuple(rope))
        check_bool(what, "skip_rope_quantization", self.skip_rope_quantization)
        check_int(what, "residual_dim", self.residual_dim)
        if self.plane_dim is not None:
            check_int(what, "plane_dim", self.plane_dim, 1)
            if self.plane_dim > MAX_MIDDLE_DIMS:
                raise ValueError(f"{what}.plane_dim: the pool dim holding K/V lies between the page dim (0) and the "
                                 f"row (last), and the codec takes at most {MAX_MIDDLE_DIMS} dims between them, so "
                                 f"plane_dim must be in [1, {MAX_MIDDLE_DIMS}] (or None), got {self.plane_dim}")
        g = self.global_scale
        if isinstance(g, bool) or not isinstance(g, (str, int, float)):
            raise TypeError(f"{what}.global_scale: must be a policy name (str) or a positive float, got "
                            f"{type(g).__name__} {g!r}")
        self.row_spec()  # raises ValueError naming the field

    def row_spec(self) -> RowSpec:
        def bad(field, msg):
            raise ValueError(f"NVFP4ColdPageConfig.{field}: {msg}")

        if self.row_size % 16:
            bad("row_size", f"must be a positive multiple of 16, got {self.row_size!r}")
        if self.residual_dim % 16:
            bad("residual_dim", f"must be a non-negative multiple of 16, got {self.residual_dim!r}")
        rope = self.rope_range
        if self.residual_dim and (not rope or self.residual_dim > rope[1]):
            bad("residual_dim", f"{self.residual_dim} needs RoPE dims at least that long (rope_range={rope})")
        # a pool [page, (1,) * (plane_dim - 1), plane, row] checks the spec as the codec will
        shape = (1, *[1] * (self.plane_dim - 1), 2, self.row_size) if self.plane_dim else (1, self.row_size)
        try:
            _check_spec(0, shape, torch.bfloat16, RowSpec(global_scale=self.global_scale, plane_dim=self.plane_dim))
        except ValueError as e:
            bad("global_scale", str(e))
        try:
            spec = RowSpec.for_rope(self.row_size, rope, skip_rope_quantization=self.skip_rope_quantization,
                                    rope_residual=bool(self.residual_dim), global_scale=self.global_scale,
                                    plane_dim=self.plane_dim)
            if self.residual_dim:
                spec = dataclasses.replace(spec, residual_range=(rope[0], self.residual_dim))
            _check_spec(0, shape, torch.bfloat16, spec)
        except ValueError as e:
            bad("rope_range", str(e))
        return spec


@dataclass(frozen=True)
class TriAttentionConfig(KVCacheCompressionConfig):
    """TriAttention eviction (kvops.triattention): every `beta` generated tokens past `budget`, keep `budget`
    generated tokens per row of `eviction_mode`, then compact the cache in place: the first `sink_tokens` and the
    newest `recent_window` of them always, and the best-scored others, the scores leaning to recent tokens by
    `recency_prior`. Layers in `recent_layers` keep their newest tokens instead of the scored ones
    (docs/triattention.md, "Keep policy"). The keep policy's fields left at None take the measured defaults of
    `eviction_mode` (``resolve_keep_policy``); 0, 0, () and 0.0 give bare scoring. `layer_split`: per-layer
    budgets by the calibration's measured layer sensitivity (``layer_groups``; docs/triattention.md, "Per-layer
    budgets"), whose local layers are the layers on recency (recent_layers stays None).
    `calibration_path`: a calibration file or a shipped name (``kvops.triattention.SHIPPED``, e.g. "qwen3-8b")."""

    algorithm: ClassVar[str] = "triattention"
    changes_physical_kv_length: ClassVar[bool] = True
    budget: int = 2048
    beta: int = 128
    eviction_mode: str = DEFAULT_MODE
    normalize_scores: bool = True
    calibration_path: str | None = None
    # "fill" moves only the kept tokens that sit past the new length (full attention ignores slot order; window
    # layers stay in order); "ordered" keeps every layer in token order (kvops.compaction.ORDERS)
    compaction_order: str = "fill"
    sink_tokens: int | None = None
    recent_window: int | None = None
    recent_layers: tuple[int, ...] | None = None
    recency_prior: float | None = None
    layer_split: bool = False

    def __post_init__(self):
        what = "TriAttentionConfig"
        check_round_sizes(what, self.budget, self.beta)
        check_choice(what, "eviction_mode", self.eviction_mode, MODES)
        # checked now as far as it can be without the model (keep_policy() resolves it for one)
        policy = resolve_keep_policy(what, self.eviction_mode, self.budget, self.beta, MAX_POSITIONS,
                                     self.sink_tokens, self.recent_window, self.recent_layers, self.recency_prior)
        if self.recent_layers is not None:
            object.__setattr__(self, "recent_layers", policy.recent_layers)
        check_bool(what, "normalize_scores", self.normalize_scores)
        check_bool(what, "layer_split", self.layer_split)
        if self.layer_split and self.recent_layers:
            raise ValueError(f"{what}: recent_layers {list(self.recent_layers)} and layer_split both name layers on "
                             f"recency; the split's local layers are them (leave recent_layers None)")
        check_choice(what, "compaction_order", self.compaction_order, ORDERS)
        if self.calibration_path is None:
            raise ValueError("TriAttentionConfig.calibration_path: a calibration file is required")
        if not isinstance(self.calibration_path, (str, os.PathLike)):
            raise TypeError(f"TriAttentionConfig.calibration_path: must be a path or a shipped name "
                            f"{sorted(SHIPPED)}, got {type(self.calibration_path).__name__}")
        object.__setattr__(self, "calibration_path", os.fspath(self.calibration_path))  # JSON-serializable
        path = calibration_file(self.calibration_path)
        if not os.path.isfile(path):
            raise ValueError(f"TriAttentionConfig.calibration_path: no file at {self.calibration_path!r} (and not "
                             f"one of the shipped calibrations {sorted(SHIPPED)})")
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"TriAttentionConfig.calibration_path: {self.calibration_path!r} is not a readable "
                             f"calibration file: {e}") from e
        if not isinstance(data, Mapping) or not ("stats" in data or "E_q" in data):
            raise ValueError(f"TriAttentionConfig.calibration_path: {self.calibration_path!r} holds no calibration "
                             "statistics ('stats' or 'E_q')")
        if self.layer_split and data.get("layer_sensitivity") is None:
            raise ValueError(f"TriAttentionConfig.layer_split: {self.calibration_path!r} holds no layer sensitivity "
                             f"(kvops calibrate measures it)")

    def keep_policy(self, num_layers: int, split: LayerSplit | None = None) -> KeepPolicy:
        """The keep policy for a model of `num_layers` layers: the fields given, the mode's defaults for the
        others (``resolve_keep_policy``). Under a layer split (``layer_groups``), the scored layers' policy: for
        their budget, with no recent layers of their own."""
        budget, layers, recent = self.budget, num_layers, self.recent_layers
        if split is not None and split.local_layers:
            budget, layers, recent = split.budget, num_layers - len(split.local_layers), ()
        return resolve_keep_policy("TriAttentionConfig", self.eviction_mode, budget, self.beta, layers,
                                   self.sink_tokens, self.recent_window, recent, self.recency_prior)

    def layer_groups(self, calibration) -> LayerSplit:
        """The model's layer groups under this config: with `layer_split`, ``layer_split(calibration's layer
        sensitivity, budget)`` (`calibration`: this config's, loaded for the model: ``load_calibration``); else
        every layer scored at `budget`. An engine sizes a KV cache per group from it (the local layers', the
        scored layers') before it creates the manager."""
        if not self.layer_split:
            return LayerSplit((), self.budget, self.budget)
        sensitivity = getattr(calibration, "layer_sensitivity", None)
        if sensitivity is None:
            raise TypeError(f"TriAttentionConfig.layer_groups: calibration must be this config's Calibration, "
                            f"loaded with its layer sensitivity (load_calibration), got {type(calibration).__name__}")
        return layer_split(sensitivity, self.budget)

    def supports_block_reuse(self) -> bool:
        return False  # compaction rewrites pages that a prefix cache could share

    def supports_speculative_decoding(self) -> bool:
        return False  # a round may move tokens that draft verification still refers to

    def load_calibration(self, model_config: Mapping[str, Any]):
        """The validated calibration for this model (raises on a geometry mismatch)."""
        from .triattention import load_calibration
        return load_calibration(self.calibration_path, model_config)


def check_round_sizes(what: str, budget, beta) -> None:
    """`budget` and `beta`: ints >= 1 whose round (up to budget + 2 * beta decode tokens scored) fits int32 cache
    positions."""
    check_int(what, "budget", budget, 1, MAX_POSITIONS)
    check_int(what, "beta", beta, 1, MAX_POSITIONS)
    if budget + 2 * beta > MAX_POSITIONS:
        raise ValueError(f"{what}: budget + 2 * beta (the decode tokens a round scores) must be at most "
                         f"{MAX_POSITIONS} (int32 cache positions), got {budget + 2 * beta}")


def check_keep_policy(what: str, budget: int, sink_tokens, recent_window, recent_layers,
                      recency_prior=0.0) -> tuple[int, ...]:
    """TriAttention's keep policy: ints `sink_tokens`, `recent_window` >= 0 that leave the scores at least one
    of the `budget` tokens, `recent_layers` distinct layer indices >= 0 (a list or tuple; returned as a sorted
    tuple) and a finite `recency_prior` >= 0. The model's layer count is checked where the model is known."""
    check_int(what, "sink_tokens", sink_tokens)
    check_int(what, "recent_window", recent_window)
    check_number(what, "recency_prior", recency_prior, 0)
    if sink_tokens + recent_window >= budget:
        raise ValueError(f"{what}: sink_tokens + recent_window ({sink_tokens} + {recent_window}) must be below the "
                         f"budget {budget}, so that the scores choose at least one token")
    return check_recent_layers(what, recent_layers)


def check_recent_layers(what: str, recent_layers, num_layers: int | None = None) -> tuple[int, ...]:
    """Layers on recency: distinct layer indices >= 0 (a list or tuple; returned as a sorted tuple), and with
    `num_layers` (the model's, where it is known) inside the model and not all of its layers."""
    if not isinstance(recent_layers, (list, tuple)):
        raise TypeError(f"{what}: recent_layers must be a list or tuple of layer indices, got "
                        f"{type(recent_layers).__name__} {recent_layers!r}")
    for i, layer in enumerate(recent_layers):
        check_int(what, f"recent_layers[{i}]", layer)
    if len(set(recent_layers)) != len(recent_layers):
        raise ValueError(f"{what}: recent_layers has a layer twice: {list(recent_layers)}")
    layers = tuple(sorted(recent_layers))
    if num_layers is not None and layers and layers[-1] >= num_layers:
        raise ValueError(f"{what}: recent_layers {list(layers)} names layers past the model's {num_layers}")
    if num_layers is not None and len(layers) == num_layers:
        raise ValueError(f"{what}: recent_layers names every layer; nothing would be scored (a plain window cache "
                         f"does that)")
    return layers


# each mode's default recency prior (resolve_keep_policy)
RECENCY_PRIORS = {"per_head": 0.0, "union": 8.0, "per_layer_perhead": 16.0}


class KeepPolicy(NamedTuple):
    """What a TriAttention round keeps besides its scored tokens, and how the scores lean to recent tokens
    (docs/triattention.md, "Keep policy")."""
    sink_tokens: int
    recent_window: int
    recent_layers: tuple[int, ...]
    recency_prior: float


def resolve_keep_policy(what: str, mode: str, budget: int, beta: int, num_layers: int, sink_tokens=None,
                        recent_window=None, recent_layers=None, recency_prior=None) -> KeepPolicy:
    """The keep policy of rounds every `beta` tokens in `mode` for a model of `num_layers` layers: each field
    given (checked by ``check_keep_policy``), and for each left at None the default measured for the mode on a
    trained model (benchmarks/RESULTS.md, "Eviction quality"):

    - every mode: the newest ``min(budget // 4, beta)`` tokens kept (a window past beta needs ordered rounds,
      ``kvops.manager.round_order``, 2-3x the round's cost), and layer 0 keeps its newest tokens instead of scored
      ones (when the model has another layer);
    - per_head: no sinks, no recency prior;
    - union and per_layer_perhead: 4 sink tokens (fewer when the budget leaves no room: the scores choose at least
      one token) and a recency prior of 8 and 16: without it they lose to a plain window.
    """
    check_choice(what, "mode", mode, MODES)
    check_round_sizes(what, budget, beta)
    per_head = mode == "per_head"

    def given(value) -> int:  # a given int, else 0 (check_keep_policy refuses a bad one below)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    if recent_window is None:
        recent_window = max(0, min(budget // 4, beta, budget - given(sink_tokens) - 1))
    if sink_tokens is None:
        sink_tokens = max(0, min(0 if per_head else 4, budget - given(recent_window) - 1))
    if recent_layers is None:
        recent_layers = (0,) if num_layers > 1 else ()
    if recency_prior is None:
        recency_prior = RECENCY_PRIORS[mode]
    # the layers against the model's: policy_selector
    layers = check_keep_policy(what, budget, sink_tokens, recent_window, recent_layers, recency_prior)
    return KeepPolicy(sink_tokens, recent_window, layers, float(recency_prior))


# The per-layer budget rule (layer_split), measured on a trained model (benchmarks/RESULTS.md, "Per-layer
# budgets by layer sensitivity"): a local layer keeps LOCAL_SHARE of a budget (a quarter measured about the same);
# a layer is local when its loss on that window is at most LOCAL_THRESHOLD of the most sensitive layer's.
LOCAL_SHARE = 0.5
LOCAL_THRESHOLD = 0.1


class LayerSplit(NamedTuple):
    """Decode tokens per layer, the same total as `budget` in every layer: the local layers keep their newest
    `local_budget`, every other layer `budget` (scored)."""
    local_layers: tuple[int, ...]
    local_budget: int
    budget: int


def layer_split(sensitivity, budget: int, share: float = LOCAL_SHARE,
                threshold: float = LOCAL_THRESHOLD) -> LayerSplit:
    """Split ``L x budget`` decode tokens over a model's L layers by what each layer's attention needs beyond its
    recent tokens (`sensitivity`: a ``kvops.triattention.LayerSensitivity``, which ``kvops calibrate`` measures
    on the calibration text). A layer whose loss on a recent window of ``share x budget`` tokens is at most
    `threshold` of the most sensitive layer's is local: it keeps its newest ``max(1, int(share x budget))``
    tokens, and the other layers share what the local ones leave. With no layer that far below the most
    sensitive one (or none above 0 nats), nothing is local: ``LayerSplit((), budget, budget)``."""
    what = "layer_split"
    if not isinstance(sensitivity, LayerSensitivity):
        raise TypeError(f"{what}: sensitivity must be a LayerSensitivity (Calibration.layer_sensitivity), got "
                        f"{type(sensitivity).__name__}")
    check_int(what, "budget", budget, 1)
    for name, value in (("share", share), ("threshold", threshold)):
        if check_number(what, name, value, 0, strict=True) >= 1:
            raise ValueError(f"{what}: {name} must be below 1, got {value!r}")
    nats = sensitivity.at(max(1, int(share * budget)))
    most = float(nats.max())
    local = tuple(i for i, v in enumerate(nats.tolist()) if v <= threshold * most) if most > 0 else ()
    return split_budget(local, budget, nats.numel(), share)  # (not every layer: the most sensitive is not local)


def split_budget(local_layers: tuple[int, ...], budget: int, num_layers: int, share: float) -> LayerSplit:
    """``num_layers x budget`` decode tokens with `local_layers` (some, not all, of the layers; none: the even
    split) at their newest ``max(1, int(share x budget))`` and the other layers sharing the rest evenly (at least
    one token each)."""
    what = "split_budget"
    check_int(what, "budget", budget, 1)
    local_layers = check_recent_layers(what, local_layers, check_int(what, "num_layers", num_layers, 1))
    check_number(what, "share", share, 0, strict=True)
    if not local_layers:
        return LayerSplit((), budget, budget)
    local_budget, n = max(1, int(share * budget)), len(local_layers)
    rest = (num_layers * budget - n * local_budget) // (num_layers - n)
    if rest < 1:
        raise ValueError(f"{what}: {n} layers at {local_budget} tokens leave the other {num_layers - n} none of "
                         f"{num_layers} x {budget}")
    return LayerSplit(local_layers, local_budget, rest)


CONFIGS = {cls.algorithm: cls for cls in (NVFP4ColdPageConfig, TriAttentionConfig)}


def config_from_dict(data: Mapping[str, Any]) -> KVCacheCompressionConfig:
    """The config a dict describes (its "algorithm" picks the class); unknown fields raise."""
    if not isinstance(data, Mapping) or "algorithm" not in data:
        raise ValueError("config_from_dict: expected a dict with an 'algorithm' field")
    algorithm = data["algorithm"]
    if not isinstance(algorithm, str):
        raise TypeError(f"config_from_dict: algorithm must be a str, one of {sorted(CONFIGS)}, got "
                        f"{type(algorithm).__name__} {algorithm!r}")
    if algorithm not in CONFIGS:
        raise ValueError(f"config_from_dict: algorithm {algorithm!r} is not one of {sorted(CONFIGS)}")
    cls = CONFIGS[algorithm]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(repr, set(data) - fields - {"algorithm"}))  # repr: keys of any type sort
    if unknown:
        raise ValueError(f"config_from_dict: {cls.__name__} has no field(s) {', '.join(unknown)}")
    return cls(**{k: v for k, v in data.items() if k != "algorithm"})


def config_from_json(text: str) -> KVCacheCompressionConfig:
    if not isinstance(text, (str, bytes, bytearray)):
        raise TypeError(f"config_from_json: text must be a JSON string, got {type(text).__name__}")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"config_from_json: not valid JSON: {e}") from e
    return config_from_dict(data)
