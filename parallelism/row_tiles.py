"""Per-row tiles, the layout of the run-time-mask kernels (`kernel_hash`, `kernel_sparsek`):
each (batch row, head) of a block is one row of [B*H, T, ...], walked a tile at a time."""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from parallelism import target


def rows(x_BTH):
  """[B, T, H, ...] -> [B*H, T, ...] (row b * H + h)."""
  batch, length, heads = x_BTH.shape[:3]
  return jnp.swapaxes(x_BTH, 1, 2).reshape(batch * heads, length, *x_BTH.shape[3:])


def unrows(x_RT, batch: int):
  """Inverse of `rows`."""
  return jnp.swapaxes(x_RT.reshape(batch, -1, *x_RT.shape[1:]), 1, 2)


def tile(x_RT, row, i, size: int):
  """Tile `i` of row `row`: [size, ...]."""
  start = (row, i * size) + (0,) * (x_RT.ndim - 2)
  return lax.dynamic_slice(x_RT, start, (1, size, *x_RT.shape[2:]))[0]


def put(x_RT, row, i, value):
  """`x_RT` with tile `i` of row `row` replaced by `value`."""
  start = (row, i * value.shape[0]) + (0,) * (x_RT.ndim - 2)
  return lax.dynamic_update_slice(x_RT, value[None].astype(x_RT.dtype), start)


# The score tiles one batch of `walk` holds at once on a GPU (a few float32 [t, t]
# arrays per tile; its q, k, v tiles and carries add about a fifth at D = 64): what the walk
# needs beyond its operands, whatever the block's length.
_SCORE_BYTES = 1 << 28


def tiles_side_by_side(count: int, size: int) -> int:
  """How many of `count` tiles `walk` walks at once: one on a CPU, which runs a walk
  fastest without the masked steps of a batch's shorter ranges; on a GPU as many as
  _SCORE_BYTES holds, since one at a time is a tiny step each."""
  if target.backend() == "cpu":
    return 1
  return max(1, min(count, _SCORE_BYTES // (4 * 4 * size * size)))


def walk(one_tile, lengths_U, size: int):
  """`one_tile(u)` for every tile u (its walk `lengths_U[u]` long), stacked: batches of tiles
  walked side by side, one after another. A batch's loop runs to its longest walk (the
  shorter ones masked), so a batch takes tiles of like lengths (the order is undone after)."""
  count = lengths_U.shape[0]
  batch = tiles_side_by_side(count, size)
  if batch == 1:  # a plain loop, no vmap
    return lax.map(one_tile, jnp.arange(count, dtype=jnp.int32))
  order_U = jnp.argsort(lengths_U).astype(jnp.int32)
  by_length = lax.map(one_tile, order_U, batch_size=batch)
  return jax.tree.map(lambda x: x[jnp.argsort(order_U)], by_length)
