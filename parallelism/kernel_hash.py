"""The block kernel of run-time codes (hash attention, QK-dropping; issue #54): sort, then
ranges, as SCFA computes them.

The `xla` kernel hands a block pair here when its mask is coded (`MaskSpec.coded`): query
head h sees a key iff its code of h's kv head equals the query's, it is in the same
document, not after the query by original position and within its window or span. The
ring sorts each device's queries and keys once, per head, by (code, document, original
position) (`parallelism.sorting`); then every query sees one contiguous range [lo, hi) of a
key block's sorted keys (`sorting.ranges`), and a query tile the key tiles from its first
query's lo to its last query's hi (both rise with the sorted order). Ranges are the mask:
a computed tile masks key position p of query q by lo_q <= p < hi_q, and no tile outside
the ranges is visited, with the loop's bounds read at run time.

- Rows: each (batch row, query head) is one row, each kv head one key row; no union of a
  group's heads (their codes differ; at SCFA's B=4, H=48 a shared tile would skip little).
- Forward and dq: per query tile over its key tiles. dK/dV: per key tile, over each query
  head of its group, the query tiles from its first key's lowest query to its last key's
  highest (the keys' ranges); key tiles side by side cannot all add into one dq.
- The tiles walk one at a time on a CPU; on a GPU side by side in batches of like lengths
  (`row_tiles.walk`; one at a time, a GPU ran B x H x T/t tiny steps).
- Outputs stay in the sorted order (the ring merges them so and unsorts once); a pair given
  unsorted (a block alone, e.g. `dense` or a test) is sorted here and its results unsorted.

A query that sees nothing gives 0 and lse -inf, never NaN. Tile arithmetic is the `xla`
kernel's (`parallelism.tile_math`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import sorting
from parallelism.kernel_grads import Grads, Merged
from parallelism.masks import Mask
from parallelism.row_tiles import rows, tile as tile_of, unrows, walk
from parallelism.tile_math import bwd_update, fwd_result, fwd_update

_F32 = jnp.float32


def tiles(tile: int) -> tuple[int, int]:
  """(query tile, key tile): half the ring's tile each way. Sorted, a (code, document)
  group's queries and keys start and end inside tiles, and a tile that straddles two
  groups computes each group's queries on the other's keys; finer tiles waste less of
  that, and on a CPU their smaller matmuls cost less than the pairs they save
  (`scripts/bench_sparse.py`)."""
  half = tile // 2 if tile % 2 == 0 else tile
  return half, half


def _span(lo_RT, hi_RT, row, i, outer: int, inner: int):
  """(first, stop) of the inner tiles the ranges of outer tile i of row `row` reach (lo and
  hi rise along a sorted row: its first entry's lo, its last's hi); first == stop where
  every range of the tile is empty."""
  first = lo_RT[row, i * outer]
  last = hi_RT[row, i * outer + outer - 1]
  stop = jnp.where(last > first, (last + inner - 1) // inner, first // inner)
  return first // inner, stop


def _within(lo_t, hi_t, j, size: int):
  """[t, size]: which positions of tile j (of `size`) lie in each range [lo, hi)."""
  at = j * size + jnp.arange(size, dtype=jnp.int32)
  return (at[None, :] >= lo_t[:, None]) & (at[None, :] < hi_t[:, None])


def _walk_lengths(lo_RT, hi_RT, outer: int, inner: int):
  """[R * n]: how many inner tiles each outer tile's ranges reach."""
  first = lo_RT[:, ::outer]
  last = hi_RT[:, outer - 1::outer]
  return jnp.where(last > first, (last + inner - 1) // inner - first // inner, 0).reshape(-1)


def computed_tiles(mask: Mask, tile: int, q_index_T=None, k_index_T=None) -> jax.Array:
  """How much the kernel computes on this block pair, in (query head, tile x tile) pairs
  (its own tiles are `tiles(tile)`; sorted here when given unsorted, with its blocks'
  original positions)."""
  mask = sorting.sort_device(None, None, None, mask, q_index_T, k_index_T)[3]
  (lo, hi), _ = sorting.ranges(mask)
  tq, tk = tiles(tile)
  return _walk_lengths(lo, hi, tq, tk).sum() * (tq * tk / tile ** 2)


def _check(q_BTHD, k_BTKD, tile: int) -> None:
  for name, length in (("query", q_BTHD.shape[1]), ("key", k_BTKD.shape[1])):
    if length % tile:
      raise ValueError(f"{name} block length {length} is not divisible by tile size {tile}")


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, tile: int, q_index_T=None,
              k_index_T=None) -> tuple[jax.Array, jax.Array]:
  """(out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32) of the block pair, over the key tiles of each
  query tile's ranges; in the sorted order where the pair came sorted, else the block's
  (`*_index_T`: the blocks' original positions, to sort by)."""
  _check(q_BTHD, k_BTKD, tile)
  q_BTHD, k_BTKD, v_BTKD, mask, q_order, _ = sorting.sort_device(
      q_BTHD, k_BTKD, v_BTKD, mask, q_index_T, k_index_T)
  spec = mask.spec
  tq, tk = tiles(tile)
  (lo_RT, hi_RT), _ = sorting.ranges(mask)
  q_RTD, k_RTD, v_RTD = rows(q_BTHD), rows(k_BTKD), rows(v_BTKD)
  heads, num_kv = q_BTHD.shape[2], k_BTKD.shape[2]
  group, nq = heads // num_kv, q_RTD.shape[1] // tq
  scale = q_BTHD.shape[3] ** -0.5

  def one_query_tile(u):
    row, i = u // nq, u % nq
    k_row = (row // heads) * num_kv + (row % heads) // group
    q_tD = tile_of(q_RTD, row, i, tq)[None, None, None]  # [1, 1, 1, t, D]
    lo_t, hi_t = tile_of(lo_RT, row, i, tq), tile_of(hi_RT, row, i, tq)

    def visit(j, carry):
      k_tD, v_tD = (tile_of(x, k_row, j, tk)[None, None] for x in (k_RTD, v_RTD))
      seen = _within(lo_t, hi_t, j, tk)[None, None, None]
      return fwd_update(carry, q_tD, k_tD, v_tD, seen, spec=spec, scale=scale)

    shape = q_tD.shape[:-1]
    init = (jnp.full(shape, -jnp.inf, _F32), jnp.zeros(shape, _F32), jnp.zeros(q_tD.shape, _F32))
    first, stop = _span(lo_RT, hi_RT, row, i, tq, tk)
    out_tD, lse_t = fwd_result(*lax.fori_loop(first, stop, visit, init), spec=spec,
                               scale=scale)
    return out_tD[0, 0, 0], lse_t[0, 0, 0]

  out_UtD, lse_Ut = walk(one_query_tile, _walk_lengths(lo_RT, hi_RT, tq, tk), tile)
  batch = q_BTHD.shape[0]
  out_BTHD = unrows(out_UtD.reshape(q_RTD.shape), batch)
  lse_BTH = unrows(lse_Ut.reshape(q_RTD.shape[:2]), batch)
  return sorting.unsorted((out_BTHD, lse_BTH), q_order)


def block_bwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, tile: int,
              q_index_T=None, k_index_T=None) -> Grads:
  """Float32 gradients of the block pair from the GLOBAL lse and delta (the contract): dq
  per query tile over its ranges' key tiles, dk and dv per key tile over the query tiles of
  its keys' ranges, in each query head of its group; sorted as `block_fwd`."""
  _check(q_BTHD, k_BTKD, tile)
  q_BTHD, k_BTKD, v_BTKD, mask, q_order, k_order = sorting.sort_device(
      q_BTHD, k_BTKD, v_BTKD, mask, q_index_T, k_index_T)
  merged = Merged(*sorting.sorted_like(merged, q_order))
  spec = mask.spec
  tq, tk = tiles(tile)
  (lo_RT, hi_RT), (k_lo_RGT, k_hi_RGT) = sorting.ranges(mask)
  q_side = tuple(rows(x) for x in (q_BTHD, merged.dout, merged.safe_lse(),
                                   merged.delta.astype(_F32)))
  k_RTD, v_RTD = rows(k_BTKD), rows(v_BTKD)
  heads, num_kv = q_BTHD.shape[2], k_BTKD.shape[2]
  group, nq, nk = heads // num_kv, q_side[0].shape[1] // tq, k_RTD.shape[1] // tk
  scale, head_dim = q_BTHD.shape[3] ** -0.5, q_BTHD.shape[3]

  def pair(row, i, k_row, j, carry):
    """bwd_update of one tile pair (carry: dk, dv, dq^T), masked by the queries' ranges."""
    q_xs = tuple(tile_of(x, row, i, tq)[None, None, None] for x in q_side)
    k_tD, v_tD = (tile_of(x, k_row, j, tk)[None, None] for x in (k_RTD, v_RTD))
    seen_T = _within(tile_of(lo_RT, row, i, tq), tile_of(hi_RT, row, i, tq), j, tk).T
    return bwd_update(carry, q_xs, (k_tD, v_tD, jnp.swapaxes(k_tD, 2, 3)),
                      seen_T[None, None, :, None], spec=spec, scale=scale)

  no_kv = jnp.zeros((1, 1, tk, head_dim), _F32)
  no_dq = jnp.zeros((1, 1, head_dim, 1, tq), _F32)  # dq^T of one query tile
  k_row_of = lambda row: (row // heads) * num_kv + (row % heads) // group

  def one_query_tile(u):  # its dq, over its ranges' key tiles (the forward's)
    row, i = u // nq, u % nq
    first, stop = _span(lo_RT, hi_RT, row, i, tq, tk)
    visit = lambda j, dq_DGt: pair(row, i, k_row_of(row), j, (no_kv, no_kv, dq_DGt))[2]
    return lax.fori_loop(first, stop, visit, no_dq)[0, 0, :, 0].T

  def one_key_tile(u):  # its dk and dv, over each query head's tiles its keys' ranges reach
    k_row, j = u // nk, u % nk
    row_of = lambda g: (k_row // num_kv) * heads + (k_row % num_kv) * group + g

    def head(g, dkv):
      first, stop = _span(k_lo_RGT[:, g], k_hi_RGT[:, g], k_row, j, tk, tq)
      visit = lambda i, dkv: pair(row_of(g), i, k_row, j, (*dkv, no_dq))[:2]
      return lax.fori_loop(first, stop, visit, dkv)

    dk_tD, dv_tD = lax.fori_loop(0, group, head, (no_kv, no_kv))
    return dk_tD[0, 0], dv_tD[0, 0]

  dq_UtD = walk(one_query_tile, _walk_lengths(lo_RT, hi_RT, tq, tk), tile)
  k_lengths = sum(_walk_lengths(k_lo_RGT[:, g], k_hi_RGT[:, g], tk, tq) for g in range(group))
  dk_UtD, dv_UtD = walk(one_key_tile, k_lengths, tile)
  batch = q_BTHD.shape[0]
  grads = Grads(unrows(dq_UtD.reshape(q_side[0].shape), batch),
                unrows(dk_UtD.reshape(k_RTD.shape), batch),
                unrows(dv_UtD.reshape(v_RTD.shape), batch))
  dq_BTHD, = sorting.unsorted((grads.dq,), q_order)
  return Grads(dq_BTHD, *sorting.unsorted((grads.dk, grads.dv), k_order))
