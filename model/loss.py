"""Cross-entropy over sequence chunks: the output projection applied one chunk at a time.

The logits of a whole sequence are the largest activation of a long-context step (7B at
256k on 8 devices: 32k local tokens x 32k vocabulary x 4 bytes = 4 GiB per copy, plus its
gradient). Here each device projects `chunk` of its own tokens at a time, in a `lax.scan`
whose body is rematerialised, so the forward and the backward hold one chunk's logits at
once; the vocabulary axis stays sharded over `tensor` (the log-sum-exp and the target's
logit reduce across it). Per-token losses equal those of the full logits to float32
rounding (tests/test_loss.py).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.layers import constrain

# Chunk axes: [B, N, C, V], N the sequence shards (one chunk of each device's own tokens).
_CHUNK_BNCV = ("activation_batch", "activation_seq", None, "activation_vocab")


def sequence_shards() -> int:
  """Devices the sequence axis is split over in the current mesh and rules (1 without)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = nn.logical_to_mesh_axes(("activation_seq",))[0]
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape.get(axis, 1) for axis in axes)  # axes the mesh lacks: 1


def chunk_length(local_len: int, chunk: int) -> int:
  """The longest divisor of a device's sequence length that is at most `chunk` tokens."""
  return next(c for c in range(min(chunk, local_len), 0, -1) if local_len % c == 0)


def chunked_token_scores(x_BSE: jax.Array, head_EV: jax.Array, targets_BS: jax.Array,
                         chunk: int, predictions: bool = False) -> dict[str, jax.Array]:
  """Per-token cross-entropy [B, S] (float32) of `x_BSE @ head_EV` against `targets_BS`, and
  with `predictions` whether the argmax is the target, without the whole [B, S, V] logits.

  `x_BSE` is in the compute dtype; `head_EV` in its parameter dtype: it is cast to the
  compute dtype inside each chunk, so that the loop sums the head's gradient over the
  chunks in the parameter dtype (float32), not in bf16. Each chunk's logits are computed in
  the compute dtype and cast to float32, as the full logits are.
  """
  batch, seq_len, width = x_BSE.shape
  shards = sequence_shards()
  if seq_len % shards:
    raise ValueError(f"the loss splits a {seq_len}-token sequence over {shards} devices "
                     f"(mesh.rules' activation_seq): it must divide evenly")
  local = seq_len // shards
  length = chunk_length(local, chunk)
  count = local // length
  # [B, S] in shard-major order is [B, N, count, C]: scanning the count axis gives every
  # device one chunk of its own tokens per iteration, with no data moved between devices.
  x_nBNCE = jnp.moveaxis(constrain(x_BSE.reshape(batch, shards, count, length, width),
                                   ("activation_batch", "activation_seq", None, None,
                                    "activation_embed")), 2, 0)
  t_nBNC = jnp.moveaxis(targets_BS.reshape(batch, shards, count, length), 2, 0)

  @jax.checkpoint  # Saves nothing: the backward recomputes a chunk's logits, one at a time.
  def scores(x_BNCE, t_BNC):
    logits_BNCV = jnp.einsum("bnce,ev->bncv", x_BNCE, head_EV.astype(x_BNCE.dtype))
    logits_BNCV = constrain(logits_BNCV, _CHUNK_BNCV).astype(jnp.float32)
    is_target_BNCV = jax.lax.broadcasted_iota(jnp.int32, logits_BNCV.shape, 3) == t_BNC[..., None]
    target_BNC = jnp.sum(jnp.where(is_target_BNCV, logits_BNCV, 0.0), axis=-1)
    out = {"loss": jax.nn.logsumexp(logits_BNCV, axis=-1) - target_BNC}
    if predictions:
      out["correct"] = jnp.argmax(logits_BNCV, axis=-1) == t_BNC
    return out

  _, out = jax.lax.scan(lambda carry, xs: (carry, scores(*xs)), None, (x_nBNCE, t_nBNC))
  return {name: jnp.moveaxis(value, 0, 2).reshape(batch, seq_len)
          for name, value in out.items()}
