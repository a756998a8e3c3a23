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

Run-time masks (issue #38) decode exactly as the whole row's forward masks: the cache keeps
one more value per slot and kv head beside K/V, written with them. Hash attention's and
QK-dropping's is the key's code (a query head sees the slots whose code equals its own; the
new token's codes come from the model, as in training), SparseK's the key's score: the
query's threshold reads every earlier score, so each device gathers the score cache (C
floats per row and kv head, small beside its keys) and solves the same threshold the
forward solves, then weighs its own slots. Nothing else crosses devices.

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
                     spans: jax.Array | None = None, sink_tokens: int = 0,
                     codes: tuple | None = None, sparsek: tuple | None = None
                     ) -> tuple[jax.Array, ...]:
  """Attention of the token at `position_B` (one per row) over the cache, after writing its
  own key and value into it, seeing the `window` positions up to its own (None: every one
  before it; with per-head spans `spans` [Hq], query head h sees `spans[h]` <= `window`),
  and, with `sink_tokens` k, positions below k however far back (a cache holds one
  document per row, so a position is its in-document position); logits capped at `softcap`
  (0: not). Returns (out [B,1,Hq,D] in q's dtype, key cache, value cache).

  A run-time mask (`model.sparse`) keeps one value per slot and kv head in a third cache,
  written by the new token as its key is, and returned fourth:
  - `codes` = (query codes [B,1,Hq], key codes [B,1,Hkv], code cache [B,C,Hkv] int32): query
    head h sees only slots whose code of its kv head equals its own (hash buckets,
    QK-dropping's kept flags), as `ring_attention`'s `q_buckets`/`k_buckets`.
  - `sparsek` = (scores [B,1,Hkv], score cache [B,C,Hkv] float32, threshold, w): SparseK
    (model/sparsek.py). `threshold(u_BCK, position_B) -> [B, Hkv]` solves the query's
    threshold tau over a row's scores in original order; each device gathers the score cache
    (C floats per row and kv head) and solves it alike. A slot fewer than w positions back
    weighs 1, any other exp(logit) times m = clip(u - tau, 0, 1) (log m added to the logit).
  A query that sees no slot (a dropped query; a bucket of its own) gives 0, as in training.

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
  batch, _, heads, _ = cache_spec
  token_spec, slots_spec = P(batch, None, heads, None), P(*cache_spec[:3])
  # The optional operands by name, each with its shard_map spec: per-head spans, the query's
  # codes, and a mask's per-slot cache ("slots") with the new token's entry for it ("token").
  extra, specs = {}, {}
  if spans is not None:
    extra["spans"], specs["spans"] = spans, P(heads)
  if codes is not None:
    extra["q_codes"], extra["token"], extra["slots"] = codes
    specs["q_codes"] = P(batch, None, heads)
  rule = None
  if sparsek is not None:
    extra["token"], extra["slots"], threshold, near = sparsek
    rule = (threshold, near)
  if "slots" in extra:
    specs.update(token=P(batch, None, heads), slots=slots_spec)

  def per_device(q, k, v, key_cache, value_cache, slot_positions, slot_of_position, position,
                 extra):
    return _local_attention(q, k, v, key_cache, value_cache, slot_positions, slot_of_position,
                            position, seq_axes, window, softcap, sink_tokens, extra, rule)

  args = (q_B1HD, k_B1KD, v_B1KD, key_cache_BCKD, value_cache_BCKD, slot_positions_C,
          slot_of_position_C, position_B, extra)
  if mesh.empty:
    return per_device(*args)
  out_specs = (token_spec, cache_spec, cache_spec) + ((slots_spec,) if "slots" in extra else ())
  return jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(token_spec, token_spec, token_spec, cache_spec, cache_spec,
                P(cache_spec[1]), P(), P(batch), specs),
      out_specs=out_specs, check_vma=False)(*args)


def _local_slots(positions_BW, slot_of_position_C, local_capacity, seq_axes):
  """This device's cache slots of `positions_BW` (clipped into range) and whether it holds
  them: slot s of the whole cache lies on device s // local_capacity along `seq_axes`."""
  device = lax.axis_index(seq_axes) if seq_axes else 0
  local_BW = slot_of_position_C[jnp.clip(positions_BW, 0)] - device * local_capacity
  held_BW = (positions_BW >= 0) & (local_BW >= 0) & (local_BW < local_capacity)
  return jnp.clip(local_BW, 0, local_capacity - 1), held_BW


def _write_token(cache_Bc_, new_B1_, slot_B, held_B):
  """The cache ([B, c, ...]: keys, values, codes or scores) with the new token's entry in its
  slot, where this device holds it."""
  rows_B = jnp.arange(cache_Bc_.shape[0])
  held_B_ = held_B.reshape(-1, *[1] * (new_B1_.ndim - 2))
  kept_B_ = jnp.where(held_B_, new_B1_[:, 0], cache_Bc_[rows_B, slot_B])
  return cache_Bc_.at[rows_B, slot_B].set(kept_B_)


def _local_attention(q_B1HD, k_B1KD, v_B1KD, key_cache_BcKD, value_cache_BcKD,
                     slot_positions_c, slot_of_position_C, position_B, seq_axes, window,
                     softcap, sink_tokens, extra, sparsek_rule):
  """One device's slots: write, then a partial softmax merged over `seq_axes`."""
  batch, _, num_heads, head_dim = q_B1HD.shape
  num_kv = k_B1KD.shape[2]
  local_capacity = key_cache_BcKD.shape[1]
  slot_B1, held_B1 = _local_slots(position_B[:, None], slot_of_position_C, local_capacity,
                                  seq_axes)
  write = lambda cache, new: _write_token(cache, new, slot_B1[:, 0], held_B1[:, 0])
  key_cache_BcKD = write(key_cache_BcKD, k_B1KD)
  value_cache_BcKD = write(value_cache_BcKD, v_B1KD)
  slots_BcK = None  # The mask's per-slot codes or scores, with the new token's written.
  if "slots" in extra:
    slots_BcK = write(extra["slots"], extra["token"])
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
    read_BcK = None if slots_BcK is None else jnp.take_along_axis(
        slots_BcK, slots_BW[:, :, None], axis=1)
  else:
    keys_BcKD, values_BcKD, read_BcK = key_cache_BcKD, value_cache_BcKD, slots_BcK
    positions_BW = jnp.broadcast_to(slot_positions_c[None, :], (batch, local_capacity))
    visible_Bc = visible(position_B[:, None], positions_BW, None)
  behind_Bc = position_B[:, None] - positions_BW
  sink_Bc = positions_BW < sinks
  if window is not None:
    visible_Bc = visible_Bc & ((behind_Bc < window) | sink_Bc)
  visible_BKGc = visible_Bc[:, None, None, :]
  if "spans" in extra:  # Each query head its own span (the window is the widest).
    spans_KG = extra["spans"].reshape(num_kv, -1)
    visible_BKGc = visible_BKGc & ((behind_Bc[:, None, None, :] < spans_KG[None, :, :, None])
                                   | sink_Bc[:, None, None, :])

  q_BKGD = q_B1HD.reshape(batch, num_kv, num_heads // num_kv, head_dim)
  scores_BKGc = jnp.einsum("bkgd,bckd->bkgc", q_BKGD, keys_BcKD,
                           preferred_element_type=jnp.float32) / jnp.sqrt(head_dim)
  if softcap:
    scores_BKGc = softcap * jnp.tanh(scores_BKGc / softcap)
  if "q_codes" in extra:  # A query head sees the slots whose code of its kv head is its own.
    q_codes_BKG1 = extra["q_codes"].reshape(batch, num_kv, -1)[..., None]
    visible_BKGc = visible_BKGc & (q_codes_BKG1 == jnp.swapaxes(read_BcK, 1, 2)[:, :, None])
  if sparsek_rule is not None:
    visible_BKGc, scores_BKGc = _sparsek_mask(
        visible_BKGc, scores_BKGc, slots_BcK, read_BcK, behind_Bc, slot_of_position_C,
        position_B, seq_axes, *sparsek_rule)
  scores_BKGc = jnp.where(visible_BKGc, scores_BKGc, -jnp.inf)
  # The merge: the global max first (a device may see nothing: -inf, kept out of the max;
  # with a run-time mask no device may see anything: then 0), then the weights' sum and the
  # weighted values summed over the ring.
  local_max_BKG = jnp.max(scores_BKGc, axis=-1)
  global_max_BKG = lax.pmax(local_max_BKG, seq_axes) if seq_axes else local_max_BKG
  global_max_BKG = jnp.where(jnp.isfinite(global_max_BKG), global_max_BKG, 0.0)
  weights_BKGc = jnp.exp(scores_BKGc - global_max_BKG[..., None])
  denom_BKG = jnp.sum(weights_BKGc, axis=-1)
  out_BKGD = jnp.einsum("bkgc,bckd->bkgd", weights_BKGc.astype(values_BcKD.dtype),
                        values_BcKD, preferred_element_type=jnp.float32)
  if seq_axes:
    denom_BKG, out_BKGD = lax.psum((denom_BKG, out_BKGD), seq_axes)
  # Without a run-time mask the token sees at least itself; with one it may see nothing (0).
  out_BKGD = out_BKGD / jnp.where(denom_BKG > 0, denom_BKG, 1.0)[..., None]
  out_B1HD = out_BKGD.reshape(batch, 1, num_heads, head_dim).astype(q_B1HD.dtype)
  return (out_B1HD, key_cache_BcKD, value_cache_BcKD) + (
      () if slots_BcK is None else (slots_BcK,))


def _sparsek_mask(visible_BKGc, scores_BKGc, scores_cache_BcK, read_BcK, behind_Bc,
                  slot_of_position_C, position_B, seq_axes, threshold, near):
  """SparseK on this device's slots (model/sparsek.py, as `dense_attention` applies it): the
  threshold from the whole cache's scores, gathered and put in original order."""
  whole_BCK = lax.all_gather(scores_cache_BcK, seq_axes, axis=1, tiled=True) if seq_axes \
      else scores_cache_BcK
  tau_BK = threshold(whole_BCK[:, slot_of_position_C], position_B)
  m_BK1c = jnp.clip(jnp.swapaxes(read_BcK, 1, 2) - tau_BK[..., None], 0.0, 1.0)[:, :, None]
  near_B11c = (behind_Bc < near)[:, None, None]
  visible_BKGc = visible_BKGc & (near_B11c | (m_BK1c > 0))
  scores_BKGc = scores_BKGc + jnp.where(near_B11c, 0.0,
                                        jnp.log(jnp.where(m_BK1c > 0, m_BK1c, 1.0)))
  return visible_BKGc, scores_BKGc
