"""Per-query work that reads the whole row: each device its own queries, the row gathered.

SparseK's thresholds (model/sparsek.py) need, for each query, every earlier score of its row.
`per_query` gathers a per-token array [B, S, H] over the sequence axes (S floats per row and
head: small beside K/V), puts it in the original order, and hands each device the original
positions and segment ids of its own queries, so each computes its own share: the work is
split over the ring instead of repeated on every device. Its gradient is JAX's: the
all-gather's transpose sends each device the sum of the cotangents of its tokens.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from parallelism.layouts import permutation, unpermute
from parallelism.mesh import Rules, as_axes, logical_to_spec, spec_on_mesh

_X_NAMES = ("activation_batch", "activation_seq", "activation_kv_heads")
_SEG_NAMES = ("activation_batch", "activation_seq")


def per_query(fn: Callable, x_BSH: jax.Array, seg_BS: jax.Array, *, layout: str,
              num_shards: int, rules: Rules) -> jax.Array:
  """`fn(x_BSH, seg_BS, index_BT, seg_BT) -> [B, T, H]` on each device, the first two the
  whole row in its original order, the last two this device's queries' original positions
  and segment ids (T = S / shards); the results in the layout's order, [B, S, H] sharded as
  `x_BSH`. Without a mesh (or one shard), `fn` runs once on the whole row."""
  mesh = jax.sharding.get_abstract_mesh()
  seq_len = x_BSH.shape[1]
  order_S = jnp.asarray(permutation(layout, seq_len, num_shards), jnp.int32)
  if mesh.empty or num_shards == 1:
    index_BS = jnp.broadcast_to(order_S, seg_BS.shape)
    return fn(unpermute(x_BSH, layout, num_shards), unpermute(seg_BS, layout, num_shards),
              index_BS, seg_BS)
  x_spec, seg_spec = (spec_on_mesh(logical_to_spec(names, rules), mesh)
                      for names in (_X_NAMES, _SEG_NAMES))
  axes = as_axes(x_spec[1])
  if any(t == AxisType.Explicit for t in mesh.axis_types):  # shard_map takes them as specified
    x_BSH, seg_BS = jax.reshard(x_BSH, x_spec), jax.reshard(seg_BS, seg_spec)

  def per_device(x_BTH, seg_BT):
    gather = lambda a: unpermute(lax.all_gather(a, axes, axis=1, tiled=True), layout,
                                 num_shards)
    index_T = lax.dynamic_slice_in_dim(order_S, lax.axis_index(axes) * seg_BT.shape[1],
                                       seg_BT.shape[1])
    return fn(gather(x_BTH), gather(seg_BT), jnp.broadcast_to(index_T, seg_BT.shape), seg_BT)

  return jax.shard_map(per_device, in_specs=(x_spec, seg_spec), out_specs=x_spec,
                       check_vma=False)(x_BSH, seg_BS)
