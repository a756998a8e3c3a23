"""What a block kernel's backward reads and returns (`parallelism.kernels`): one shape for
every mask."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def softmax_delta(dout_BTHD, out_BTHD):
  """`delta = sum(dout * out, -1)` of the global output, float32: what every block's
  backward subtracts."""
  return jnp.sum(dout_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1)


class Merged(NamedTuple):
  """The queries' merged (global) attention, over every key block, and its cotangent: what
  each block's backward recomputes its probabilities from, so that their gradients sum to
  the whole's. out and dout [B, T, Hq, D], lse and delta [B, T, Hq] float32."""
  out: jax.Array
  lse: jax.Array
  dout: jax.Array
  delta: jax.Array

  @classmethod
  def of(cls, out_BTHD, lse_BTH, dout_BTHD) -> "Merged":
    return cls(out_BTHD, lse_BTH, dout_BTHD, softmax_delta(dout_BTHD, out_BTHD))

  def safe_lse(self):
    """lse with -inf (a query that sees nothing) as +inf, so exp(s - lse) is 0, not NaN."""
    return jnp.where(jnp.isfinite(self.lse), self.lse, jnp.inf).astype(jnp.float32)


class Grads(NamedTuple):
  """Float32 gradients of one block pair: dq [B,Tq,Hq,D], dk and dv [B,Tk,Hkv,D] and, where
  the mask has float operands (SparseK), its thresholds' [B,Tq,Hq] and scores' [B,Tk,Hkv];
  else None."""
  dq: jax.Array
  dk: jax.Array
  dv: jax.Array
  dq_scores: jax.Array | None = None
  dk_scores: jax.Array | None = None
