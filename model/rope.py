"""Rotary position embeddings and the rescalings that extend a trained model's context.

The frequencies follow `transformers`' definitions (modeling_rope_utils) exactly, so that a
checkpoint imported from Hugging Face computes what it computed there:

- `default`: theta^(-2i/D);
- `linear`: every frequency divided by `factor` (position interpolation);
- `llama3`: Llama 3.1's bands: wavelengths above original_max_len / low_freq_factor are
  divided by `factor`, below original_max_len / high_freq_factor kept, smoothly blended between;
- `yarn`: per-frequency blend of interpolation and extrapolation by a ramp between the
  dimensions that rotate beta_fast and beta_slow times in original_max_len, plus an attention
  temperature that scales cos and sin (so the logits) by `attention_factor`.

Frequencies are computed once, in numpy float32 like the reference, and enter the program as
constants.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE frequencies are rescaled for a longer context. Fields: configs/base.py."""

  type: str = "default"
  factor: float = 1.0
  original_max_len: int = 0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 0.0
  truncate: bool = True

  def problem(self) -> str:
    """What makes this scaling unusable, naming the field; empty when it is fine."""
    if self.type not in ROPE_TYPES:
      return f"model.rope_scaling.type='{self.type}' must be one of {ROPE_TYPES}"
    if self.type != "default" and self.factor <= 0:
      return f"model.rope_scaling.factor={self.factor} must be positive"
    if self.type in ("llama3", "yarn") and self.original_max_len <= 0:
      return (f"model.rope_scaling.original_max_len={self.original_max_len} must be the "
              f"pretrained context length for type '{self.type}'")
    if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      return "model.rope_scaling.high_freq_factor must exceed low_freq_factor"
    return ""


def frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[np.ndarray, float]:
  """The D/2 inverse frequencies and the factor cos and sin are multiplied by."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  base_freq = (np.float32(1.0) / np.float32(theta) ** exponents).astype(np.float32)
  if scaling.type == "default":
    return base_freq, 1.0
  if scaling.type == "linear":
    return (base_freq / np.float32(scaling.factor)).astype(np.float32), 1.0
  if scaling.type == "llama3":
    return _llama3(base_freq, scaling), 1.0
  if scaling.type == "yarn":
    return _yarn(head_dim, theta, scaling)
  raise ValueError(f"unknown RoPE scaling type '{scaling.type}'")


def _llama3(base_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
  factor = np.float32(s.factor)
  wavelen = (2 * math.pi / base_freq).astype(np.float32)
  low_freq_wavelen = s.original_max_len / s.low_freq_factor
  high_freq_wavelen = s.original_max_len / s.high_freq_factor
  scaled = np.where(wavelen > low_freq_wavelen, base_freq / factor, base_freq).astype(np.float32)
  smooth = ((s.original_max_len / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
  smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
  attention_factor = s.attention_factor or (
      0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)

  def correction_dim(rotations: float) -> float:
    # The dimension whose frequency turns `rotations` times over the pretrained context.
    return (head_dim * math.log(s.original_max_len / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # The reference's guard against a zero-width ramp.
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation_weight = (1 - ramp).astype(np.float32)
  pos_freqs = (np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32)
                                     / np.float32(head_dim))).astype(np.float32)
  extrapolated = (np.float32(1.0) / pos_freqs).astype(np.float32)
  interpolated = (np.float32(1.0) / (np.float32(s.factor) * pos_freqs)).astype(np.float32)
  inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
  return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(x_BSHD: jax.Array, positions_BS: jax.Array, inv_freq_F: np.ndarray,
               attention_factor: float = 1.0) -> jax.Array:
  """Rotates pairs (x[i], x[i + D/2]) by angle position * inv_freq[i] (rotate-half, as in
  `transformers`' LLaMA, so its q/k projections load without a permutation).

  Positions come from the batch, not from the array index: they restart per packed
  document and survive the layout permutation, so the rotation is the same in any layout.
  """
  angle_BSF = positions_BS.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
  cos_BS1F = (jnp.cos(angle_BSF) * attention_factor)[:, :, None]
  sin_BS1F = (jnp.sin(angle_BSF) * attention_factor)[:, :, None]
  x1, x2 = jnp.split(x_BSHD.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos_BS1F - x2 * sin_BS1F, x2 * cos_BS1F + x1 * sin_BS1F], -1)
  return rotated.astype(x_BSHD.dtype)
