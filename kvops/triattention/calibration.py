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

from .._checks import check_int
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
class Calibration:
    q_mean: torch.Tensor         # complex64 [L, Hq, F]: E[q_f] of the pre-RoPE query
    q_abs_mean: torch.Tensor     # float32 [L, Hq, F]: E|q_f|
    omega: torch.Tensor          # float32 [F]: RoPE inverse frequencies
    freq_scale_sq: torch.Tensor  # float32 [F]: squared attention scaling of each frequency
    num_kv_heads: int
    head_dim: int

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

    def to(self, device: torch.device | str) -> "Calibration":
        return replace(self, q_mean=self.q_mean.to(device), q_abs_mean=self.q_abs_mean.to(device),
                       omega=self.omega.to(device), freq_scale_sq=self.freq_scale_sq.to(device))


def _geometry(config: Mapping[str, Any], caller: str = "load_calibration", name: str = "model_config"
              ) -> tuple[int, int, int, int, int]:
    """(layers, query heads, KV heads, head_dim, RoPE frequencies) of a Hugging Face config dict; errors name
    `caller` and the argument `name`."""
    what = f"{caller}: {name}"
    if not isinstance(config, Mapping):
        raise TypeError(f"{what} must be a dict (a Hugging Face config's to_dict()), got {type(config).__name__}")
    for key in ("num_hidden_layers", "num_attention_heads"):
        if key not in config:
            raise ValueError(f"{what} needs {key!r}")
        check_int(what, key, config[key], 1)
    L, Hq = config["num_hidden_layers"], config["num_attention_heads"]
    Hkv = config.get("num_key_value_heads")
    Hkv = Hq if Hkv is None else check_int(what, "num_key_value_heads", Hkv, 1)  # absent: multi-head attention
    D = head_dim_of(config)
    if Hq % Hkv:
        raise ValueError(f"{what}: num_attention_heads {Hq} is not a multiple of num_key_value_heads {Hkv}")
    return L, Hq, Hkv, D, rotary_dim(config) // 2


def _tensor(value: Any, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"load_calibration: {what} must be a tensor, got {type(value).__name__}")
    if value.is_complex() != dtype.is_complex or not (value.is_floating_point() or value.is_complex()):
        raise ValueError(f"load_calibration: {what} must be a {'complex' if dtype.is_complex else 'real'} "
                         f"floating-point tensor, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"load_calibration: {what} has shape {tuple(value.shape)}, the model needs {shape}")
    if not torch.isfinite(torch.view_as_real(value) if value.is_complex() else value).all():
        raise ValueError(f"load_calibration: {what} holds NaN or Inf")
    return value.to(dtype)


def _official(data: Mapping[str, Any], L: int, Hq: int, D: int, F: int) -> tuple[torch.Tensor, torch.Tensor]:
    meta, stats = data.get("metadata") or {}, data["stats"]
    if not isinstance(stats, Mapping):
        raise ValueError("load_calibration: 'stats' must be a dict of per-head statistics")
    for key, want in (("head_dim", D), ("num_layers", L), ("num_attention_heads", Hq)):
        if key in meta and int(meta[key]) != want:
            raise ValueError(f"load_calibration: the file's metadata {key}={meta[key]} does not match the model ({want})")
    expected = {f"layer{layer:02d}_head{head:02d}" for layer in range(L) for head in range(Hq)}
    extra = sorted(set(stats) - expected)
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
        Validated against the model's geometry; raises ValueError (TypeError for a wrong kind of argument) naming
        what does not match.
    """
    L, Hq, Hkv, D, F = _geometry(model_config)
    if isinstance(source, (str, os.PathLike)):
        source = calibration_file(source)
        try:
            data = torch.load(source, map_location="cpu", weights_only=True)
        except FileNotFoundError as e:
            raise ValueError(f"load_calibration: no calibration file at {os.fspath(source)!r}") from e
        except Exception as e:  # corrupt, truncated, or not a weights-only pickle
            raise ValueError(f"load_calibration: cannot read {os.fspath(source)!r} as a calibration file: {e}") from e
    else:
        data = source
    if not isinstance(data, Mapping):
        raise ValueError(f"load_calibration: expected a dict, got {type(data).__name__}")
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
        rope_omega, rope_fss = rope_parameters(model_config)
        omega = rope_omega if omega is None else omega
        freq_scale_sq = rope_fss if freq_scale_sq is None else freq_scale_sq
    omega = _tensor(omega, "omega", (F,), torch.float32)
    freq_scale_sq = _tensor(freq_scale_sq, "freq_scale_sq", (F,), torch.float32)
    return Calibration(q_mean, q_abs, omega, freq_scale_sq, Hkv, D)


def check_calibration(calibration: Calibration, model_config: Mapping[str, Any], caller: str = "check_calibration",
                      config_name: str = "model_config") -> Calibration:
    """Check a loaded Calibration against a model's config (``model_config`` as for ``load_calibration``): its
    layers, query heads, KV heads, head_dim and RoPE frequency count must be the model's, its tensors of the dtypes
    and shapes ``load_calibration`` makes. Raises TypeError/ValueError naming `caller`, the config argument
    `config_name` and what does not match; returns the calibration. The RoPE frequencies themselves (omega,
    freq_scale_sq) are the calibration's own, as ``load_calibration`` lets a file or the caller set them."""
    if not isinstance(calibration, Calibration):
        raise TypeError(f"{caller}: calibration must be a Calibration (load_calibration), got "
                        f"{type(calibration).__name__}")
    L, Hq, Hkv, D, F = _geometry(model_config, caller, config_name)
    for name, t, dtype, shape in (("q_mean", calibration.q_mean, torch.complex64, 3),
                                  ("q_abs_mean", calibration.q_abs_mean, torch.float32, 3),
                                  ("omega", calibration.omega, torch.float32, 1),
                                  ("freq_scale_sq", calibration.freq_scale_sq, torch.float32, 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != shape:
            raise ValueError(f"{caller}: calibration.{name} must be a {shape}-D {dtype} tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    have = dict(layers=calibration.num_layers, query_heads=calibration.num_query_heads,
                kv_heads=calibration.num_kv_heads, head_dim=calibration.head_dim, freqs=calibration.num_freqs)
    want = dict(layers=L, query_heads=Hq, kv_heads=Hkv, head_dim=D, freqs=F)
    if have != want:
        def say(g):
            return (f"{g['layers']} layers, {g['query_heads']} query heads, {g['kv_heads']} KV heads, "
                    f"head_dim {g['head_dim']}, {g['freqs']} RoPE frequencies")
        raise ValueError(f"{caller}: the calibration describes a model of {say(have)}; the model has {say(want)}")
    for name, t, shape in (("q_abs_mean", calibration.q_abs_mean, (L, Hq, F)), ("omega", calibration.omega, (F,)),
                           ("freq_scale_sq", calibration.freq_scale_sq, (F,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{caller}: calibration.{name} has shape {tuple(t.shape)}, the model needs {shape}")
    return calibration
