"""Decoder building blocks: RMSNorm, SwiGLU, and parameter initialisers (RoPE: model/rope.py).

Every parameter carries logical axis names (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`,
`vocab`, `norm`); the rules table in the config maps them to mesh axes.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig


def dense_init(cfg: ModelConfig, names: Sequence[str]):
  return nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), tuple(names))


class Projection(nn.Module):
  """A bias-free linear map written as an einsum, its kernel named by logical axes.

  Used instead of nn.DenseGeneral because that one initialises a flattened kernel and
  reshapes it, which breaks logical-name sharding constraints on multi-axis kernels.
  """

  cfg: ModelConfig
  equation: str  # e.g. "bse,ehd->bshd"
  shape: tuple[int, ...]
  names: tuple[str, ...]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = projection_kernel(self, self.cfg, self.shape, self.names)
    return jnp.einsum(self.equation, x.astype(self.cfg.dtype), kernel.astype(self.cfg.dtype))


def projection_kernel(module: nn.Module, cfg: ModelConfig, shape: tuple[int, ...],
                      names: Sequence[str]) -> jax.Array:
  """`module`'s parameter `kernel`, in the parameter dtype, named by logical axes."""
  return module.param("kernel", dense_init(cfg, names), shape, jnp.dtype(cfg.param_dtype))


def constrain(x: jax.Array, names: Sequence[str]) -> jax.Array:
  """Pins an activation's sharding by logical names (a no-op outside a mesh context)."""
  return nn.with_logical_constraint(x, tuple(names))


class RMSNorm(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BSE: jax.Array) -> jax.Array:
    scale_E = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        (x_BSE.shape[-1],), jnp.dtype(self.cfg.param_dtype))
    # Normalise in float32: the mean of squares loses too much in bf16.
    x32_BSE = x_BSE.astype(jnp.float32)
    normed_BSE = x32_BSE * jax.lax.rsqrt(
        jnp.mean(jnp.square(x32_BSE), axis=-1, keepdims=True) + self.cfg.norm_eps)
    return (normed_BSE * scale_E).astype(self.cfg.dtype)


class SwiGLU(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BSE: jax.Array) -> jax.Array:
    cfg = self.cfg

    up_shape, up_names = (cfg.d_model, cfg.d_ff), ("embed", "mlp")
    gate_BSF = Projection(cfg, "bse,ef->bsf", up_shape, up_names, name="gate")(x_BSE)
    up_BSF = Projection(cfg, "bse,ef->bsf", up_shape, up_names, name="up")(x_BSE)
    hidden_BSF = constrain(nn.silu(gate_BSF) * up_BSF,
                           ("activation_batch", "activation_seq", "activation_mlp"))
    return Projection(cfg, "bsf,fe->bse", (cfg.d_ff, cfg.d_model), ("mlp", "embed"),
                      name="down")(hidden_BSF)
