"""Per-row tiles, the layout of the run-time-mask kernels (`kernel_hash`, `kernel_sparsek`):
each (batch row, head) of a block is one row of [B*H, T, ...], walked a tile at a time."""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp


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
