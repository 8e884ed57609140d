"""RoPE inverse frequencies (omega) and attention scaling from a Hugging Face-style config dict.

The arithmetic follows transformers' RoPE init functions step by step in float32 (default, linear,
llama3, yarn), so omega matches what the model used; tests compare against transformers when it is
installed. transformers is not a dependency.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .._checks import check_int, check_number

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _number(name: str, value: Any, low: float | None = None, *, above: bool = True) -> float:
    """A finite real number (int or float, not a bool), > low (>= low with above=False) when low is given."""
    return check_number("rope config", name, value, low, strict=above)


def _fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"rope config: the model config must be a dict (a Hugging Face config's to_dict()), got "
                        f"{type(config).__name__}")
    return config


def rotary_dim(config: Mapping[str, Any]) -> int:
    """head_dim times partial_rotary_factor (in (0, 1]; at the top level, or in rope_parameters where transformers 5
    keeps it), truncated as transformers does."""
    factor = _fields(config).get("partial_rotary_factor")
    if factor is None:
        scaling = config.get("rope_scaling") or config.get("rope_parameters")
        factor = scaling.get("partial_rotary_factor") if isinstance(scaling, Mapping) else None
    factor = 1.0 if factor is None else _number("partial_rotary_factor", factor, 0)
    if factor > 1:
        raise ValueError(f"rope config: partial_rotary_factor must be in (0, 1], got {factor!r}")
    return int(head_dim_of(config) * factor)


def head_dim_of(config: Mapping[str, Any]) -> int:
    """head_dim, or hidden_size // num_attention_heads when head_dim is absent (or None)."""
    if _fields(config).get("head_dim") is not None:
        return check_int("rope config", "head_dim", config["head_dim"], 1)
    if config.get("hidden_size") is None or config.get("num_attention_heads") is None:
        raise ValueError("rope config: needs head_dim, or hidden_size and num_attention_heads")
    return (check_int("rope config", "hidden_size", config["hidden_size"], 1)
            // check_int("rope config", "num_attention_heads", config["num_attention_heads"], 1))


def rope_parameters(config: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(omega f32 [F], freq_scale_sq f32 [F]) with F = rotary_dim / 2.

    freq_scale_sq is the square of the attention scaling RoPE applies to cos and sin (yarn's mscale), since
    it multiplies both q and k. Raises TypeError / ValueError naming the config field that is missing, of the
    wrong type or out of range.
    """
    scaling = _fields(config).get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rope config: rope_scaling / rope_parameters must be a dict, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ValueError(f"rope config: rope_scaling type {kind!r} is not supported; expected one of {ROPE_TYPES}")
    base = scaling.get("rope_theta", config.get("rope_theta"))
    if base is None:
        raise ValueError("rope config: needs rope_theta (at the top level or in rope_scaling / rope_parameters)")
    base = _number("rope_theta", base, 1)
    dim = rotary_dim(config)
    if dim <= 0 or dim % 2:
        raise ValueError(f"rope config: rotary dim (head_dim * partial_rotary_factor) must be even and > 0, got {dim}")

    def need(key, low=0):
        if scaling.get(key) is None:
            raise ValueError(f"rope config: rope_scaling type {kind!r} needs {key!r}")
        return _number(f"rope_scaling {key}", scaling[key], low)

    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (base ** exponents)
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / need("factor")
    elif kind == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
        if high <= low:  # the smoothing divides by high - low
            raise ValueError(f"rope config: rope_scaling high_freq_factor ({high}) must be > low_freq_factor ({low})")
        old_context = need("original_max_position_embeddings")
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, llama)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn(scaling, config, base, dim)
    omega = inv_freq.to(torch.float32)
    return omega, torch.full_like(omega, float(attention_factor) ** 2)


def _yarn(scaling, config, base, dim):
    def optional(key, low=0, above=True):
        value = scaling.get(key)
        return None if value is None else _number(f"rope_scaling {key}", value, low, above=above)

    original = scaling.get("original_max_position_embeddings")
    if original is None:  # as transformers' standardize_rope_params: the model's context before scaling
        original = config.get("max_position_embeddings")
        if original is None:
            raise ValueError("rope config: rope_scaling type 'yarn' needs 'original_max_position_embeddings' (or "
                             "the config's max_position_embeddings)")
        original = _number("max_position_embeddings", original, 0)
    else:
        original = _number("rope_scaling original_max_position_embeddings", original, 0)
    factor = optional("factor")
    if factor is None:
        if config.get("max_position_embeddings") is None or scaling.get("original_max_position_embeddings") is None:
            raise ValueError("rope config: rope_scaling type 'yarn' needs 'factor' (or max_position_embeddings and "
                             "rope_scaling original_max_position_embeddings, whose ratio it is)")
        factor = _number("max_position_embeddings", config["max_position_embeddings"], 0) / original

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = optional("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = optional("mscale", 0, above=False), optional("mscale_all_dim", 0, above=False)
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = optional("beta_fast") or 32, optional("beta_slow") or 1
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise TypeError(f"rope config: rope_scaling truncate must be a bool, got {type(truncate).__name__} "
                        f"{truncate!r}")

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor
