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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from parallelism.layouts import inverse_permutation, permutation
from parallelism.mesh import Rules, as_axes, logical_to_spec, spec_on_mesh
from parallelism.masks import Mask, Side, logits, sparsek_weight, visible

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


def decode_attention(q_B1HD: jax.Array, k_B1KD: jax.Array, v_B1KD: jax.Array, cache: tuple,
                     position_B: jax.Array, mask: Mask = Mask(), *, layout: str, rules: Rules,
                     mesh=None, threshold=None) -> tuple[jax.Array, tuple]:
  """Attention of the token at `position_B` (one per row) over the cache, after writing its
  own key and value into it, as the whole row's forward under `mask` (`parallelism.masks`)
  sees position p: its spec, the query side (codes [B,1,Hq], per-head spans [Hq]) and the
  new token's key side (its code or SparseK score, [B,1,Hkv]). A cache holds one document
  per row, so a position is its in-document position (which keys are sinks).

  `cache` is (key cache [B,C,Hkv,D], value cache, the slots' key side: a `Side` holding a
  run-time mask's per-slot operand, [B,C,Hkv], codes int32 or SparseK's scores float32, or
  none); returns (out [B,1,Hq,D] in q's dtype, the cache with the token's entries written).
  SparseK's `threshold(u_BCK, position_B) -> [B, Hkv]` solves the query's threshold over a
  row's scores in original order; each device gathers the score cache (C floats per row and
  kv head) and solves it alike. A query that sees no slot (a dropped query; a bucket of its
  own) gives 0, as in training.

  `rules` are the decode rules (`decode_rules`); the cache shards as `CACHE_NAMES` map, q
  and the new key/value as the heads do. `mesh=None` uses the mesh set by `jax.set_mesh`;
  with no mesh at all the cache is one local block.
  """
  key_cache_BCKD, value_cache_BCKD, slots = cache
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
  per_head = P(batch, None, heads)
  mask_specs = Mask(mask.spec, _specs_like(mask.q, codes=per_head, spans=P(heads)),
                    _specs_like(mask.k, codes=per_head, scores=per_head))
  slots_specs = jax.tree.map(lambda _: slots_spec, slots)

  def per_device(q, k, v, cache, slot_positions, slot_of_position, position, mask):
    return _local_attention(q, k, v, cache, slot_positions, slot_of_position, position,
                            seq_axes, mask, threshold)

  args = (q_B1HD, k_B1KD, v_B1KD, cache, slot_positions_C, slot_of_position_C, position_B,
          mask)
  if mesh.empty:
    return per_device(*args)
  cache_specs = (cache_spec, cache_spec, slots_specs)
  return jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(token_spec, token_spec, token_spec, cache_specs, P(cache_spec[1]), P(),
                P(batch), mask_specs),
      out_specs=(token_spec, cache_specs), check_vma=False)(*args)


def _specs_like(side: Side, **specs) -> Side:
  """The shard_map specs of a decode step's side: `specs` by field, where it has one (a
  decode step's operands are only these)."""
  given = {f.name: getattr(side, f.name) for f in dataclasses.fields(side)}
  unknown = [name for name, value in given.items() if value is not None and name not in specs]
  if unknown:
    raise ValueError(f"a decode step's mask takes no {unknown} (the cache's rows are one "
                     f"document each)")
  return Side(**{name: None if given[name] is None else spec for name, spec in specs.items()})


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


def _local_attention(q_B1HD, k_B1KD, v_B1KD, cache, slot_positions_c, slot_of_position_C,
                     position_B, seq_axes, mask: Mask, threshold):
  """One device's slots (`cache`: keys, values, the mask's per-slot side): write, then a
  partial softmax merged over `seq_axes`; (out, the cache written)."""
  key_cache_BcKD, value_cache_BcKD, slots = cache
  spec = mask.spec
  batch, _, num_heads, head_dim = q_B1HD.shape
  num_kv = k_B1KD.shape[2]
  local_capacity = key_cache_BcKD.shape[1]
  slot_B1, held_B1 = _local_slots(position_B[:, None], slot_of_position_C, local_capacity,
                                  seq_axes)
  write = lambda cache, new: _write_token(cache, new, slot_B1[:, 0], held_B1[:, 0])
  key_cache_BcKD = write(key_cache_BcKD, k_B1KD)
  value_cache_BcKD = write(value_cache_BcKD, v_B1KD)
  # The mask's per-slot operand, with the new token's written.
  slots = jax.tree.map(write, slots, dataclasses.replace(mask.k, positions=None))
  window, sinks = spec.window, spec.sink_tokens
  if window is not None and window + sinks < local_capacity:  # Only these slots are read:
    # the window's, then the sinks beyond it (-1, no slot, where the window has them).
    sink_W = jnp.arange(sinks)[None, :]
    positions_BW = jnp.concatenate([
        position_B[:, None] - jnp.arange(window)[None, :],
        jnp.where(sink_W <= position_B[:, None] - window, sink_W, -1)], axis=1)
    slots_BW, held_Bc = _local_slots(positions_BW, slot_of_position_C, local_capacity,
                                     seq_axes)
    take = lambda x: jnp.take_along_axis(x, slots_BW.reshape(*slots_BW.shape,
                                                             *[1] * (x.ndim - 2)), axis=1)
    keys_BcKD, values_BcKD, read = take(key_cache_BcKD), take(value_cache_BcKD), jax.tree.map(
        take, slots)
  else:
    keys_BcKD, values_BcKD, read = key_cache_BcKD, value_cache_BcKD, slots
    positions_BW = jnp.broadcast_to(slot_positions_c[None, :], (batch, local_capacity))
    held_Bc = jnp.ones(positions_BW.shape, bool)

  q_BKGD = q_B1HD.reshape(batch, num_kv, num_heads // num_kv, head_dim)
  scores_BKGc = jnp.einsum("bkgd,bckd->bkgc", q_BKGD, keys_BcKD,
                           preferred_element_type=jnp.float32)
  scores_BKGc = logits(spec, scores_BKGc, head_dim ** -0.5)[0]
  # The rule (`parallelism.masks.visible`), laid out [B, Hkv, G, slots].
  per_query = lambda x_B1H: None if x_B1H is None else x_B1H.reshape(batch, num_kv, -1)[..., None]
  per_slot = lambda x_BcK: None if x_BcK is None else jnp.swapaxes(x_BcK, 1, 2)[:, :, None]
  behind_B11c = (position_B[:, None] - positions_BW)[:, None, None]
  tau = None
  if spec.selects:
    tau = _threshold(slots.scores, slot_of_position_C, position_B, seq_axes, threshold)
  span = None if mask.q.spans is None else mask.q.spans.reshape(num_kv, -1)[None, :, :, None]
  slot_mask = Mask(spec, Side(codes=per_query(mask.q.codes), scores=tau, spans=span),
                   Side(positions=positions_BW[:, None, None], codes=per_slot(read.codes),
                        scores=per_slot(read.scores)))
  visible_BKGc = held_Bc[:, None, None] & visible(slot_mask, behind_B11c)
  if spec.selects:
    weight, _ = sparsek_weight(slot_mask, behind_B11c)
    scores_BKGc = scores_BKGc + jnp.log(jnp.where(weight > 0, weight, 1.0))
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
  return out_B1HD, (key_cache_BcKD, value_cache_BcKD, slots)


def _threshold(scores_cache_BcK, slot_of_position_C, position_B, seq_axes, threshold):
  """SparseK's threshold of the query [B, Hkv, 1, 1] from the whole cache's scores, gathered
  and put in original order (model/sparsek.py, as the forward solves it)."""
  whole_BCK = lax.all_gather(scores_cache_BcK, seq_axes, axis=1, tiled=True) if seq_axes \
      else scores_cache_BcK
  return threshold(whole_BCK[:, slot_of_position_C], position_B)[:, :, None, None]
