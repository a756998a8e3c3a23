"""What a block kernel's backward returns (`parallelism.kernels`): one shape for every mask."""

from __future__ import annotations

from typing import NamedTuple

import jax


class Grads(NamedTuple):
  """Float32 gradients of one block pair: dq [B,Tq,Hq,D], dk and dv [B,Tk,Hkv,D] and, where
  the mask has float operands (SparseK), its thresholds' [B,Tq,Hq] and scores' [B,Tk,Hkv];
  else None."""
  dq: jax.Array
  dk: jax.Array
  dv: jax.Array
  dq_scores: jax.Array | None = None
  dk_scores: jax.Array | None = None
