"""TriAttention calibration: offline per-head query statistics, validated against the model at load.

Two file formats (both read with ``torch.load(weights_only=True)``):

- official (WeianMao/triattention): ``{"metadata": {"head_dim", "sampled_heads", ...}, "stats":
  {"layer{LL:02d}_head{HH:02d}": {"q_mean_real", "q_mean_imag", "q_abs_mean"}}}``, f32 tensors of F;
- flat: ``{"E_q": complex64 [L, Hq, F], "E_q_norm": f32 [L, Hq, F], "omega": f32 [F],
  "freq_scale_sq": f32 [F]}``.

``F = rotary_dim / 2``; frequency f pairs dims f and f + F ("half" RoPE). Nothing is fitted at run time.

Shipped calibrations (``kvops/data/triattention``, Apache-2.0, see its NOTICE.md) are named in ``SHIPPED``: pass
the name wherever a calibration path is taken (``load_calibration("qwen3-8b", ...)``,
``TriAttentionConfig(calibration_path="qwen3-8b")``). ``kvops calibrate`` (kvops/calibrate.py) makes new ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from .._checks import as_device, check_device, check_int
from .rope import head_dim_of, rope_parameters, rotary_dim


DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "triattention")


@dataclass(frozen=True)
class ShippedCalibration:
    """A calibration file in the package and the Hugging Face config fields of the model it describes."""

    file: str
    model_config: Mapping[str, Any]

    @property
    def path(self) -> str:
        return os.path.join(DATA_DIR, self.file)


SHIPPED = {
    "qwen3-8b": ShippedCalibration("qwen3_8b_aime25.pt", dict(
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6)),
    "gpt-oss-120b": ShippedCalibration("gpt_oss_120b.pt", dict(
        num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64, rope_theta=150000,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096})),
}


def calibration_file(source: str | os.PathLike) -> str:
    """The file behind a calibration source: a shipped name (``SHIPPED``) or a path, returned as a string."""
    if isinstance(source, str) and source in SHIPPED:
        return SHIPPED[source].path
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"calibration: expected a path or one of {sorted(SHIPPED)}, got {type(source).__name__}")
    return os.fspath(source)


@dataclass(frozen=True)
class LayerSensitivity:
    """What each layer's attention needs beyond its recent tokens (``kvops.calibrate.layer_sensitivity``): the
    loss, in nats per token, the model adds when layer l alone attends only to its first `sinks` and newest
    recent[i] tokens is nats[i, l]. The per-layer budget rule reads it (``kvops.config.layer_split``)."""

    recent: tuple[int, ...]      # increasing window sizes
    nats: torch.Tensor           # float32 [len(recent), L], on the CPU
    sinks: int

    def __post_init__(self):
        what = "LayerSensitivity"
        if not isinstance(self.recent, tuple) or not self.recent:
            raise TypeError(f"{what}: recent must be a non-empty tuple of window sizes, got {self.recent!r}"[:300])
        for i, r in enumerate(self.recent):
            check_int(what, f"recent[{i}]", r, 1)
        if list(self.recent) != sorted(set(self.recent)):
            raise ValueError(f"{what}: recent must be increasing, got {self.recent}")
        check_int(what, "sinks", self.sinks)
        nats = self.nats
        if not isinstance(nats, torch.Tensor) or nats.dtype != torch.float32 or nats.device.type != "cpu":
            raise TypeError(f"{what}: nats must be a float32 CPU tensor, got {type(nats).__name__} "
                            f"{getattr(nats, 'dtype', '')} {getattr(nats, 'device', '')}")
        if nats.dim() != 2 or nats.shape[0] != len(self.recent) or nats.shape[1] == 0:
            raise ValueError(f"{what}: nats must be [{len(self.recent)} windows, layers >= 1], got shape "
                             f"{tuple(nats.shape)}")
        if not bool(torch.isfinite(nats).all()):
            raise ValueError(f"{what}: nats holds NaN or Inf")

    def at(self, window: int) -> torch.Tensor:
        """float32 [L]: each layer's loss at the largest measured window not above `window` (the smallest
        one's where `window` is below every one: the loss only grows as the window shrinks)."""
        i = max([i for i, r in enumerate(self.recent) if r <= window], default=0)
        return self.nats[i]


@dataclass(frozen=True)
class Calibration:
    q_mean: torch.Tensor         # complex64 [L, Hq, F]: E[q_f] of the pre-RoPE query
    q_abs_mean: torch.Tensor     # float32 [L, Hq, F]: E|q_f|
    omega: torch.Tensor          # float32 [F]: RoPE inverse frequencies
    freq_scale_sq: torch.Tensor  # float32 [F]: squared attention scaling of each frequency
    num_kv_heads: int
    head_dim: int
    layer_sensitivity: LayerSensitivity | None = None  # None: not measured (the shipped files)

    @property
    def num_layers(self) -> int:
        return self.q_mean.shape[0]

    @property
    def num_query_heads(self) -> int:
        return self.q_mean.shape[1]

    @property
    def num_freqs(self) -> int:
        return self.q_mean.shape[2]

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    def score_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qr, qi, e) float32 [L, Hq, F], each times freq_scale_sq: s = sum_f kr (qr C - qi S) + ki (qr S + qi C)
        + e |k_f|, with e = E|q_f| - |E[q_f]| (docs/triattention.md)."""
        fss = self.freq_scale_sq
        extra = self.q_abs_mean - self.q_mean.abs()
        return tuple((x * fss).float().contiguous() for x in (self.q_mean.real, self.q_mean.imag, extra))

    def for_kv_heads(self, kv_heads: range) -> "Calibration":
        """The statistics a rank holding KV heads `kv_heads` (a range of step 1, tensor parallelism) scores with:
        those heads and the query heads that read them."""
        if not isinstance(kv_heads, range) or kv_heads.step != 1 or len(kv_heads) == 0 or kv_heads.start < 0 \
                or kv_heads.stop > self.num_kv_heads:
            raise ValueError(f"Calibration.for_kv_heads: kv_heads must be a non-empty range of step 1 inside "
                             f"[0, {self.num_kv_heads}), got {kv_heads!r}")
        q = slice(kv_heads.start * self.group_size, kv_heads.stop * self.group_size)
        return replace(self, q_mean=self.q_mean[:, q].contiguous(), q_abs_mean=self.q_abs_mean[:, q].contiguous(),
                       num_kv_heads=len(kv_heads))

    def for_layers(self, layers) -> "Calibration":
        """The statistics of the model's layers `layers` (a list, tuple or range of distinct indices, in order):
        what a selector scoring only those layers uses (the others keep their newest tokens instead,
        ``TriAttentionConfig.recent_layers``)."""
        what = "Calibration.for_layers"
        if not isinstance(layers, (list, tuple, range)):  # a bool list would index as a mask, a tensor likewise
            raise TypeError(f"{what}: layers must be a list, tuple or range of layer indices, got "
                            f"{type(layers).__name__} {layers!r}")
        layers = [check_int(what, f"layers[{i}]", x, 0, self.num_layers - 1) for i, x in enumerate(layers)]
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"{what}: layers must be distinct layer indices in [0, {self.num_layers}), got {layers!r}")
        sensitivity = self.layer_sensitivity and replace(self.layer_sensitivity,
                                                         nats=self.layer_sensitivity.nats[:, layers].contiguous())
        return replace(self, q_mean=self.q_mean[layers].contiguous(), q_abs_mean=self.q_abs_mean[layers].contiguous(),
                       layer_sensitivity=sensitivity)

    def to(self, device: torch.device | str) -> "Calibration":
        """The calibration with its tensors on `device` (a real one: on meta it would have no values)."""
        device = as_device("Calibration.to", device)
        if device.type == "meta":
            raise ValueError("Calibration.to: a calibration on the meta device has no values")
        return replace(self, q_mean=self.q_mean.to(device), q_abs_mean=self.q_abs_mean.to(device),
                       omega=self.omega.to(device), freq_scale_sq=self.freq_scale_sq.to(device))


def _geometry(what: str, config: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """(layers, query heads, KV heads, head_dim, frequencies) of a model config, every field type-checked."""
    if not isinstance(config, Mapping):
        raise TypeError(f"{what}: model_config must be a dict (a Hugging Face config's to_dict()), got "
                        f"{type(config).__name__}")
    for key in ("num_hidden_layers", "num_attention_heads"):
        if key not in config:
            raise ValueError(f"{what}: model_config needs {key!r}")
        check_int(f"{what}: model_config", key, config[key], 1)
    L, Hq = config["num_hidden_layers"], config["num_attention_heads"]
    Hkv = config.get("num_key_value_heads")
    Hkv = Hq if Hkv is None else check_int(f"{what}: model_config", "num_key_value_heads", Hkv, 1)  # absent: MHA
    if Hq % Hkv:
        raise ValueError(f"{what}: num_attention_heads {Hq} is not a multiple of num_key_value_heads {Hkv}")
    try:
        D, rotary = head_dim_of(config), rotary_dim(config)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from e
    if rotary < 2 or rotary % 2:
        raise ValueError(f"{what}: rotary dim (head_dim * partial_rotary_factor) must be even and > 0, got {rotary}")
    return L, Hq, Hkv, D, rotary // 2


def _tensor(value: Any, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`value` checked (a finite floating tensor of `shape`, complex iff `dtype` is, on a real device) and cast to
    `dtype` on the CPU, where load_calibration builds the Calibration."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"load_calibration: {what} must be a tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise ValueError(f"load_calibration: {what} is a meta tensor (loaded with map_location='meta'?); a "
                         "calibration needs its values")
    if value.is_complex() != dtype.is_complex or not (value.is_floating_point() or value.is_complex()):
        raise ValueError(f"load_calibration: {what} must be a {'complex' if dtype.is_complex else 'real'} "
                         f"floating-point tensor, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"load_calibration: {what} has shape {tuple(value.shape)}, the model needs {shape}")
    if not torch.isfinite(torch.view_as_real(value) if value.is_complex() else value).all():
        raise ValueError(f"load_calibration: {what} holds NaN or Inf")
    return value.to("cpu", dtype)


def _official(data: Mapping[str, Any], L: int, Hq: int, D: int, F: int) -> tuple[torch.Tensor, torch.Tensor]:
    meta, stats = data.get("metadata"), data["stats"]
    if not isinstance(stats, Mapping):
        raise ValueError("load_calibration: 'stats' must be a dict of per-head statistics")
    if meta is None:
        meta = {}
    if not isinstance(meta, Mapping):
        raise ValueError(f"load_calibration: 'metadata' must be a dict, got {type(meta).__name__}")
    for key, want in (("head_dim", D), ("num_layers", L), ("num_attention_heads", Hq)):
        if key in meta and check_int("load_calibration: the file's metadata", key, meta[key], 1) != want:
            raise ValueError(f"load_calibration: the file's metadata {key}={meta[key]} does not match the model ({want})")
    expected = {f"layer{layer:02d}_head{head:02d}" for layer in range(L) for head in range(Hq)}
    extra = sorted(map(repr, set(stats) - expected))
    if extra:
        raise ValueError(f"load_calibration: statistics for heads the model does not have: {extra[:4]} "
                         f"(model: {L} layers x {Hq} query heads)")
    q_mean = torch.empty(L, Hq, F, dtype=torch.complex64)
    q_abs = torch.empty(L, Hq, F, dtype=torch.float32)
    for layer in range(L):
        for head in range(Hq):
            key = f"layer{layer:02d}_head{head:02d}"
            if key not in stats:
                raise ValueError(f"load_calibration: head {key} is missing from the calibration file")
            s = stats[key]
            if not isinstance(s, Mapping):
                raise ValueError(f"load_calibration: {key} must be a dict of q_mean_real, q_mean_imag and "
                                 f"q_abs_mean tensors, got {type(s).__name__}")
            real = _tensor(s.get("q_mean_real"), f"{key}.q_mean_real", (F,), torch.float32)
            imag = _tensor(s.get("q_mean_imag"), f"{key}.q_mean_imag", (F,), torch.float32)
            q_mean[layer, head] = torch.complex(real, imag)
            q_abs[layer, head] = _tensor(s.get("q_abs_mean"), f"{key}.q_abs_mean", (F,), torch.float32)
    return q_mean, q_abs


def load_calibration(source: str | os.PathLike | Mapping[str, Any], model_config: Mapping[str, Any], *,
                     omega: torch.Tensor | None = None, freq_scale_sq: torch.Tensor | None = None) -> Calibration:
    """Load and validate calibration statistics for a model.

    Parameters
    ----------
    source : str, os.PathLike or dict
        A shipped name (``SHIPPED``, e.g. "qwen3-8b"), a file (loaded with ``torch.load(weights_only=True)``), or
        the loaded dict; official or flat format.
    model_config : dict
        Hugging Face config fields: num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (or
        hidden_size), rope_theta, partial_rotary_factor, rope_scaling / rope_parameters.
    omega, freq_scale_sq : torch.Tensor, optional
        float32 ``[F]``; when given they take precedence over the file's (flat format) and the config's RoPE.

    Returns
    -------
    Calibration
        On the CPU, checked as ``validate_calibration`` checks one; raises ValueError (TypeError for a wrong kind
        of argument) naming what does not match.
    """
    L, Hq, Hkv, D, F = _geometry("load_calibration", model_config)
    if isinstance(source, (str, os.PathLike)):
        source = calibration_file(source)
        try:
            data = torch.load(source, map_location="cpu", weights_only=True)
        except FileNotFoundError as e:
            raise ValueError(f"load_calibration: no calibration file at {os.fspath(source)!r}") from e
        except Exception as e:  # corrupt, truncated, or not a weights-only pickle
            raise ValueError(f"load_calibration: cannot read {os.fspath(source)!r} as a calibration file: {e}") from e
    elif isinstance(source, Mapping):
        data = source
    else:
        raise TypeError(f"load_calibration: source must be a shipped name ({', '.join(sorted(SHIPPED))}), a path or "
                        f"a loaded calibration dict, got {type(source).__name__}")
    if not isinstance(data, Mapping):
        raise ValueError(f"load_calibration: {os.fspath(source)!r} holds a {type(data).__name__}, expected a dict")
    if "stats" in data:
        q_mean, q_abs = _official(data, L, Hq, D, F)
    elif "E_q" in data:
        q_mean = _tensor(data["E_q"], "E_q", (L, Hq, F), torch.complex64)
        q_abs = _tensor(data.get("E_q_norm"), "E_q_norm", (L, Hq, F), torch.float32)
        omega = data.get("omega") if omega is None else omega
        freq_scale_sq = data.get("freq_scale_sq") if freq_scale_sq is None else freq_scale_sq
    else:
        raise ValueError("load_calibration: unknown format (expected 'stats' (official) or 'E_q' (flat))")
    if omega is None or freq_scale_sq is None:
        try:
            rope_omega, rope_fss = rope_parameters(model_config)
        except (TypeError, ValueError) as e:
            raise type(e)(f"load_calibration: {e}") from e
        omega = rope_omega if omega is None else omega
        freq_scale_sq = rope_fss if freq_scale_sq is None else freq_scale_sq
    omega = _tensor(omega, "omega", (F,), torch.float32)
    freq_scale_sq = _tensor(freq_scale_sq, "freq_scale_sq", (F,), torch.float32)
    sensitivity = _sensitivity(data.get("layer_sensitivity"), L)
    return _validate("load_calibration", Calibration(q_mean, q_abs, omega, freq_scale_sq, Hkv, D, sensitivity),
                     model_config)


def _sensitivity(entry: Any, L: int) -> LayerSensitivity | None:
    """A file's ``layer_sensitivity`` entry (``kvops.calibrate.layer_sensitivity``'s dict), checked; None if absent."""
    if entry is None:
        return None
    what = "the file's layer_sensitivity"
    if not isinstance(entry, Mapping) or not {"recent", "nats", "sinks"} <= set(entry):
        raise ValueError(f"load_calibration: {what} must be a dict of recent, nats and sinks")
    recent = entry["recent"]
    if not isinstance(recent, torch.Tensor) or recent.dtype != torch.int64 or recent.dim() != 1:
        raise ValueError(f"load_calibration: {what}.recent must be a 1-D int64 tensor of window sizes")
    nats = _tensor(entry["nats"], f"{what}.nats", (recent.numel(), L), torch.float32)
    try:
        return LayerSensitivity(tuple(recent.tolist()), nats, entry["sinks"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"load_calibration: {what}: {e}") from e


def validate_calibration(calibration: Calibration, model_config: Mapping[str, Any], *,
                         what: str = "validate_calibration") -> Calibration:
    """Check a Calibration against a model before it is used; returns it unchanged.

    The model's geometry (model_config as for ``load_calibration``: layers, query and KV heads, head_dim, the
    RoPE's rotary frequencies) must match the calibration's; q_mean must be complex64 and q_abs_mean, omega and
    freq_scale_sq float32, all on one real device (not meta) and finite, with q_abs_mean >= 0 (a mean of
    magnitudes), omega > 0 (inverse frequencies) and freq_scale_sq > 0 (a square; <= 0 would flip or erase every
    score); ``check_calibration`` checks all of that but the model's geometry. Raises TypeError for a wrong kind
    of argument or field, ValueError naming what does not match. Reads the values (a device sync when they sit on
    a GPU): call it once, where the calibration is taken. `what` names the caller in the messages.
    """
    return _validate(what, calibration, model_config)


def _validate(what: str, calibration: Calibration, model_config: Mapping[str, Any]) -> Calibration:
    cal = check_calibration(what, calibration)
    L, Hq, Hkv, D, F = _geometry(what, model_config)
    for name, t, shape in (("q_mean", cal.q_mean, (L, Hq, F)), ("q_abs_mean", cal.q_abs_mean, (L, Hq, F)),
                           ("omega", cal.omega, (F,)), ("freq_scale_sq", cal.freq_scale_sq, (F,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{what}: calibration.{name} has shape {tuple(t.shape)}; the model ({L} layers, {Hq} "
                             f"query heads, {F} rotary frequencies) needs {shape}")
    for name, value, want in (("num_kv_heads", cal.num_kv_heads, Hkv), ("head_dim", cal.head_dim, D)):
        if value != want:
            raise ValueError(f"{what}: calibration.{name} is {value}, the model's is {want}")
    return calibration


def check_calibration(what: str, calibration: Calibration) -> Calibration:
    """A Calibration's fields, without a model to compare them with (validate_calibration adds that): q_mean
    complex64 [L, Hq, F] and q_abs_mean float32 of its shape, omega and freq_scale_sq float32 [F], every dim >= 1,
    all on one real device; num_kv_heads an int dividing Hq; head_dim an int >= 2F (the rotary dims); finite
    values with q_abs_mean >= 0, omega > 0 and freq_scale_sq > 0. Reads the values (a device sync on a GPU: call it
    where the calibration is taken, as TriAttentionSelector does). Returns it unchanged."""
    if not isinstance(calibration, Calibration):
        raise TypeError(f"{what}: calibration must be a Calibration (load_calibration), got "
                        f"{type(calibration).__name__}")
    cal = calibration
    check_int(f"{what}: calibration", "num_kv_heads", cal.num_kv_heads, 1)
    check_int(f"{what}: calibration", "head_dim", cal.head_dim, 1)
    fields = {name: getattr(cal, name) for name in ("q_mean", "q_abs_mean", "omega", "freq_scale_sq")}
    for name, value in fields.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: calibration.{name} must be a tensor, got {type(value).__name__}")
    check_device(f"{what}: calibration", **fields)
    for name, dtype in (("q_mean", torch.complex64), ("q_abs_mean", torch.float32), ("omega", torch.float32),
                        ("freq_scale_sq", torch.float32)):
        if fields[name].dtype != dtype:
            raise ValueError(f"{what}: calibration.{name} must be {str(dtype).removeprefix('torch.')}, got "
                             f"{fields[name].dtype}")
    if cal.q_mean.dim() != 3 or 0 in cal.q_mean.shape:  # an empty dim would leave nothing to score with
        raise ValueError(f"{what}: calibration.q_mean must be [layers, query heads, frequencies], each >= 1, got "
                         f"shape {tuple(cal.q_mean.shape)}")
    L, Hq, F = cal.q_mean.shape
    for name, shape in (("q_abs_mean", (L, Hq, F)), ("omega", (F,)), ("freq_scale_sq", (F,))):
        if tuple(fields[name].shape) != shape:
            raise ValueError(f"{what}: calibration.{name} has shape {tuple(fields[name].shape)}; q_mean's "
                             f"{(L, Hq, F)} needs {shape}")
    sensitivity = cal.layer_sensitivity  # a LayerSensitivity checks its own fields
    if sensitivity is not None and (not isinstance(sensitivity, LayerSensitivity) or sensitivity.nats.shape[1] != L):
        raise ValueError(f"{what}: calibration.layer_sensitivity must be None or a LayerSensitivity whose nats are "
                         f"[windows, {L}] (one column per layer of q_mean)")
    if Hq % cal.num_kv_heads:
        raise ValueError(f"{what}: calibration.num_kv_heads {cal.num_kv_heads} must divide q_mean's {Hq} query heads")
    if cal.head_dim < 2 * F:
        raise ValueError(f"{what}: calibration.head_dim {cal.head_dim} is below the {2 * F} rotary dims of q_mean's "
                         f"{F} frequencies")
    for name, t, rule, ok in (("q_mean", torch.view_as_real(cal.q_mean), "finite", None),
                              ("q_abs_mean", cal.q_abs_mean, "finite and >= 0", lambda x: x >= 0),
                              ("omega", cal.omega, "finite and > 0", lambda x: x > 0),
                              ("freq_scale_sq", cal.freq_scale_sq, "finite and > 0", lambda x: x > 0)):
        good = torch.isfinite(t) if ok is None else torch.isfinite(t) & ok(t)
        if not bool(good.all()):
            where = (~good).nonzero()[0].tolist()
            raise ValueError(f"{what}: calibration.{name} must be {rule} everywhere; at {where} it is "
                             f"{t[tuple(where)].item()}")
    return calibration
