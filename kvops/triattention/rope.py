"""RoPE inverse frequencies (omega) and attention scaling from a Hugging Face-style config dict.

The arithmetic follows transformers' RoPE init functions step by step in float32 (default, linear,
llama3, yarn), so omega matches what the model used; tests compare against transformers when it is
installed. transformers is not a dependency.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rotary_dim(config: Mapping[str, Any]) -> int:
    return int(head_dim_of(config) * config.get("partial_rotary_factor", 1.0))


def head_dim_of(config: Mapping[str, Any]) -> int:
    if config.get("head_dim"):
        return int(config["head_dim"])
    try:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    except KeyError as e:
        raise ValueError("rope config: needs head_dim, or hidden_size and num_attention_heads") from e


def rope_parameters(config: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(omega f32 [F], freq_scale_sq f32 [F]) with F = rotary_dim / 2.

    freq_scale_sq is the square of the attention scaling RoPE applies to cos and sin (yarn's mscale), since
    it multiplies both q and k.
    """
    scaling = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope config: rope_scaling type {kind!r} is not supported; expected one of {ROPE_TYPES}")
    base = scaling.get("rope_theta", config.get("rope_theta"))
    if base is None or not base > 1:
        raise ValueError(f"rope config: rope_theta must be > 1, got {base!r}")
    dim = rotary_dim(config)
    if dim <= 0 or dim % 2:
        raise ValueError(f"rope config: rotary dim (head_dim * partial_rotary_factor) must be even and > 0, got {dim}")

    def need(key):
        if scaling.get(key) is None:
            raise ValueError(f"rope config: rope_scaling type {kind!r} needs {key!r}")
        return scaling[key]

    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (base ** exponents)
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / need("factor")
    elif kind == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
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
    original = scaling.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    if not original:
        raise ValueError("rope config: yarn needs original_max_position_embeddings (or max_position_embeddings)")
    factor = scaling.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / original

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor
