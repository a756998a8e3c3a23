"""One new token's attention over a KV cache sharded along the sequence, for sampling.

The cache is what a prefill with ring attention leaves behind: each layer's roped keys and
values for `capacity` positions, in the layout's order, sharded over the ring's mesh axis
(the cache slot of position p is `layouts.inverse_permutation(layout, capacity, N)[p]`).
Decoding position p writes the new key/value into the slot that holds p, on whichever device
owns it (one slot written, not the cache rewritten), and attends to every slot whose position
is not after p. Each device computes its partial softmax over its own slots; the parts merge
by log-sum-exp (a max and two sums over the ring axis), so no device ever holds another
device's keys or values. A local layer's step (a window w shorter than a device's share of
the cache) gathers only the slots of positions p-w+1..p that the device holds, so its cost is
that of the window, not of the capacity. With per-head spans the window is the widest, and
each query head masks the slots beyond its own span.

During decoding the one-token activations are not split along the sequence: the rules
table's `activation_seq` entry moves to `activation_cache_seq` (`decode_rules`), which only
the cache uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from parallelism.layouts import inverse_permutation, permutation
from parallelism.mesh import Rules, as_axes, logical_to_spec, spec_on_mesh
from parallelism.tiles import visible

CACHE_SEQ = "activation_cache_seq"
CACHE_NAMES = ("activation_batch", CACHE_SEQ, "activation_kv_heads", None)


def decode_rules(rules: Rules) -> Rules:
  """`rules` for one-token steps: `activation_seq` replicated, its axes kept for the cache."""
  table = dict(rules)
  seq_axes = table.get(CACHE_SEQ, table.get("activation_seq"))  # Applied twice: the same.
  return tuple((name, None if name == "activation_seq" else axes) for name, axes in rules
               if name != CACHE_SEQ) + ((CACHE_SEQ, seq_axes),)


def cache_positions(layout: str, capacity: int, num_shards: int) -> np.ndarray:
  """The original position each cache slot holds (the layout's permutation)."""
  return permutation(layout, capacity, num_shards)


def decode_attention(q_B1HD: jax.Array, k_B1KD: jax.Array, v_B1KD: jax.Array,
                     key_cache_BCKD: jax.Array, value_cache_BCKD: jax.Array,
                     position_B: jax.Array, *, layout: str, rules: Rules,
                     mesh=None, window: int | None = None, softcap: float = 0.0,
                     spans: jax.Array | None = None, sink_tokens: int = 0
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Attention of the token at `position_B` (one per row) over the cache, after writing its
  own key and value into it, seeing the `window` positions up to its own (None: every one
  before it; with per-head spans `spans` [Hq], query head h sees `spans[h]` <= `window`),
  and, with `sink_tokens` k, positions below k however far back (a cache holds one
  document per row, so a position is its in-document position); logits capped at `softcap`
  (0: not). Returns (out [B,1,Hq,D] in q's dtype, key cache,
  value cache).

  `rules` are the decode rules (`decode_rules`); the cache shards as `CACHE_NAMES` map, q
  and the new key/value as the heads do. `mesh=None` uses the mesh set by `jax.set_mesh`;
  with no mesh at all the cache is one local block.
  """
  capacity = key_cache_BCKD.shape[1]
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  cache_spec = spec_on_mesh(logical_to_spec(CACHE_NAMES, rules), mesh)
  seq_axes = as_axes(cache_spec[1])
  # The layout permutes for the ring, the first sequence axis; a second (Ulysses) splits
  # each ring block further, so the slots' order is the ring's.
  ring_shards = mesh.shape[seq_axes[0]] if seq_axes else 1
  slot_positions_C = jnp.asarray(cache_positions(layout, capacity, ring_shards))
  slot_of_position_C = jnp.asarray(inverse_permutation(layout, capacity, ring_shards))

  def per_device(q, k, v, key_cache, value_cache, slot_positions, slot_of_position, position,
                 *spans_H):
    return _local_attention(q, k, v, key_cache, value_cache, slot_positions, slot_of_position,
                            position, seq_axes, window, softcap, sink_tokens, *spans_H)

  args = (q_B1HD, k_B1KD, v_B1KD, key_cache_BCKD, value_cache_BCKD, slot_positions_C,
          slot_of_position_C, position_B) + (() if spans is None else (spans,))
  if mesh.empty:
    return per_device(*args)
  batch, _, heads, _ = cache_spec
  token_spec = P(batch, None, heads, None)
  return jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(token_spec, token_spec, token_spec, cache_spec, cache_spec,
                P(cache_spec[1]), P(), P(batch)) + (() if spans is None else (P(heads),)),
      out_specs=(token_spec, cache_spec, cache_spec), check_vma=False)(*args)


def _local_slots(positions_BW, slot_of_position_C, local_capacity, seq_axes):
  """This device's cache slots of `positions_BW` (clipped into range) and whether it holds
  them: slot s of the whole cache lies on device s // local_capacity along `seq_axes`."""
  device = lax.axis_index(seq_axes) if seq_axes else 0
  local_BW = slot_of_position_C[jnp.clip(positions_BW, 0)] - device * local_capacity
  held_BW = (positions_BW >= 0) & (local_BW >= 0) & (local_BW < local_capacity)
  return jnp.clip(local_BW, 0, local_capacity - 1), held_BW


def _write_token(cache_BcKD, new_B1KD, slot_B, held_B):
  """The cache with the new token's key (or value) in its slot, where this device holds it."""
  rows_B = jnp.arange(cache_BcKD.shape[0])
  kept_BKD = jnp.where(held_B[:, None, None], new_B1KD[:, 0], cache_BcKD[rows_B, slot_B])
  return cache_BcKD.at[rows_B, slot_B].set(kept_BKD)


def _local_attention(q_B1HD, k_B1KD, v_B1KD, key_cache_BcKD, value_cache_BcKD,
                     slot_positions_c, slot_of_position_C, position_B, seq_axes, window,
                     softcap, sink_tokens=0, spans_H=None):
  """One device's slots: write, then a partial softmax merged over `seq_axes`."""
  batch, _, num_heads, head_dim = q_B1HD.shape
  num_kv = k_B1KD.shape[2]
  local_capacity = key_cache_BcKD.shape[1]
  slot_B1, held_B1 = _local_slots(position_B[:, None], slot_of_position_C, local_capacity,
                                  seq_axes)
  key_cache_BcKD = _write_token(key_cache_BcKD, k_B1KD, slot_B1[:, 0], held_B1[:, 0])
  value_cache_BcKD = _write_token(value_cache_BcKD, v_B1KD, slot_B1[:, 0], held_B1[:, 0])
  sinks = sink_tokens if window is not None else 0  # a global layer sees them anyway
  if window is not None and window + sinks < local_capacity:  # Only these slots are read:
    # the window's, then the sinks beyond it (-1, no slot, where the window has them).
    sink_W = jnp.arange(sinks)[None, :]
    positions_BW = jnp.concatenate([
        position_B[:, None] - jnp.arange(window)[None, :],
        jnp.where(sink_W <= position_B[:, None] - window, sink_W, -1)], axis=1)
    slots_BW, visible_Bc = _local_slots(positions_BW, slot_of_position_C, local_capacity,
                                        seq_axes)
    keys_BcKD = jnp.take_along_axis(key_cache_BcKD, slots_BW[:, :, None, None], axis=1)
    values_BcKD = jnp.take_along_axis(value_cache_BcKD, slots_BW[:, :, None, None], axis=1)
  else:
    keys_BcKD, values_BcKD = key_cache_BcKD, value_cache_BcKD
    positions_BW = jnp.broadcast_to(slot_positions_c[None, :], (batch, local_capacity))
    visible_Bc = visible(position_B[:, None], positions_BW, None)
  behind_Bc = position_B[:, None] - positions_BW
  sink_Bc = positions_BW < sinks
  if window is not None:
    visible_Bc = visible_Bc & ((behind_Bc < window) | sink_Bc)
  visible_BKGc = visible_Bc[:, None, None, :]
  if spans_H is not None:  # Each query head its own span (the window is the widest).
    spans_KG = spans_H.reshape(num_kv, -1)
    visible_BKGc = visible_BKGc & ((behind_Bc[:, None, None, :] < spans_KG[None, :, :, None])
                                   | sink_Bc[:, None, None, :])

  q_BKGD = q_B1HD.reshape(batch, num_kv, num_heads // num_kv, head_dim)
  scores_BKGc = jnp.einsum("bkgd,bckd->bkgc", q_BKGD, keys_BcKD,
                           preferred_element_type=jnp.float32) / jnp.sqrt(head_dim)
  if softcap:
    scores_BKGc = softcap * jnp.tanh(scores_BKGc / softcap)
  scores_BKGc = jnp.where(visible_BKGc, scores_BKGc, -jnp.inf)
  # The merge: the global max first (a device may see nothing: -inf, kept out of the max),
  # then the weights' sum and the weighted values summed over the ring.
  local_max_BKG = jnp.max(scores_BKGc, axis=-1)
  global_max_BKG = lax.pmax(local_max_BKG, seq_axes) if seq_axes else local_max_BKG
  weights_BKGc = jnp.exp(scores_BKGc - global_max_BKG[..., None])
  denom_BKG = jnp.sum(weights_BKGc, axis=-1)
  out_BKGD = jnp.einsum("bkgc,bckd->bkgd", weights_BKGc.astype(values_BcKD.dtype),
                        values_BcKD, preferred_element_type=jnp.float32)
  if seq_axes:
    denom_BKG, out_BKGD = lax.psum((denom_BKG, out_BKGD), seq_axes)
  # The token sees at least itself, so the denominator is positive.
  out_B1HD = (out_BKGD / denom_BKG[..., None]).reshape(batch, 1, num_heads, head_dim)
  return out_B1HD.astype(q_B1HD.dtype), key_cache_BcKD, value_cache_BcKD
