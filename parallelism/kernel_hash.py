"""Hash attention's block kernel (SCFA, issue #38): tiles sorted by bucket, skipped at run time.

The `xla` kernel hands a block pair here when it has codes (`parallelism.kernels`): query
head h sees a key iff causal by ORIGINAL token index, same document, same code as its kv
head's key (and within the window or its span, when the layer has one).

- Rows: each (batch row, query head) is one row, each kv head one key row; both are sorted
  stably by (run, bucket, original index). A run is a stretch of the block whose indices
  advance by its stride (`runs`, from the layout on the host): zigzag's two chunks stay
  apart, so the causal rule still skips between them.
- SKIP a tile pair when the bucket ranges cannot meet, `min(k_index) > max(q_index)`,
  `min(q_index) - max(k_index) >= window`, or the segment ranges cannot meet; compute every
  other with the elementwise mask. Block pairs the schedule knows are empty never get here.
- Static capacity: per row and query tile the met key tiles first, then their count. The
  query tiles walk their lists one at a time on a CPU, side by side in batches on a GPU
  (`_over_tiles`; one at a time, a GPU ran B x H x T/t tiny steps); the backward walks
  twice, dq per query tile, dk and dv per key tile (key tiles side by side cannot all add
  into one dq). Memory: lists, sort metadata, a sorted copy of each operand, a batch's tiles.
- GQA: no union of heads (at SCFA's B=4, H=48 a shared tile would skip almost nothing); one
  head per matmul instead.

Results are scattered back to the block's order; a query that sees nothing gives 0 and lse
-inf, never NaN. Tile arithmetic is the `xla` kernel's (`parallelism.tile_math`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallelism import target
from parallelism.kernel_grads import Grads
from parallelism.masks import Mask, MaskSpec, Side, visible
from parallelism.schedule import RingSchedule
from parallelism.tile_math import bwd_update, fwd_result, fwd_update

_F32 = jnp.float32


class Rows(NamedTuple):
  """One side of a block pair sorted per row: [R, T] each (`seg` None without documents)."""
  order: jax.Array  # position in the block of each sorted entry
  codes: jax.Array
  index: jax.Array  # original token index
  seg: jax.Array | None


def runs(index_T: np.ndarray) -> np.ndarray:
  """[T] int32: the run of each position of a block, a new one wherever its original index
  does not advance by the block's most common step (host-side, from the static layout)."""
  steps = np.diff(np.asarray(index_T))
  if steps.size == 0:
    return np.zeros(np.shape(index_T), np.int32)
  values, counts = np.unique(steps, return_counts=True)
  return np.concatenate([[0], np.cumsum(steps != values[np.argmax(counts)])]).astype(np.int32)


@functools.lru_cache(maxsize=64)
def pair_runs(schedule: RingSchedule) -> tuple[np.ndarray, np.ndarray]:
  """([P, T], [P, T]) int32: the runs of each distinct pair's query and key blocks."""
  return tuple(np.stack([runs(index_T) for index_T in index_PT])
               for index_PT in schedule.pair_index)


def sort_rows(codes_BTH, index_T, seg_BT, run_T=None) -> Rows:
  """Rows (b * H + h) of a side, sorted stably by (run, bucket, original index)."""
  batch, length, heads = codes_BTH.shape
  codes_RT = jnp.swapaxes(codes_BTH, 1, 2).reshape(batch * heads, length)
  index_RT = jnp.broadcast_to(index_T.astype(jnp.int32), codes_RT.shape)
  keys = (index_RT, codes_RT) + (() if run_T is None else
                                 (jnp.broadcast_to(run_T, codes_RT.shape),))
  order_RT = jnp.lexsort(keys, axis=-1).astype(jnp.int32)
  take = lambda x_RT: jnp.take_along_axis(x_RT, order_RT, axis=1)
  seg_RT = None if seg_BT is None else take(jnp.repeat(seg_BT, heads, axis=0))
  return Rows(order_RT, take(codes_RT), take(index_RT), seg_RT)


def gather_rows(x_BTH, order_RT):
  """[B, T, H, ...] -> [B*H, T, ...] in the rows' sorted order."""
  batch, length, heads = x_BTH.shape[:3]
  x = jnp.swapaxes(x_BTH, 1, 2).reshape(batch * heads, length, *x_BTH.shape[3:])
  order = order_RT.reshape(order_RT.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, order, axis=1)


def scatter_rows(x_RT, order_RT, batch: int):
  """Inverse of `gather_rows`: back to the block's order, [B, T, H, ...]."""
  inverse_RT = jnp.argsort(order_RT, axis=1)
  x = jnp.take_along_axis(x_RT, inverse_RT.reshape(inverse_RT.shape + (1,) * (x_RT.ndim - 2)),
                          axis=1)
  x = x.reshape(batch, -1, *x.shape[1:])
  return jnp.swapaxes(x, 1, 2)


def _ranges(x_RT, tile: int):
  chunks = x_RT.reshape(x_RT.shape[0], -1, tile)
  return chunks.min(axis=-1), chunks.max(axis=-1)


def meets(q: Rows, k: Rows, tile: int, window: int | None = None):
  """[Rk, G, nq, nk] bool: the tile pairs the rule computes (query row = key row * G + g)."""
  num_k_rows = k.codes.shape[0]

  def ranges(rows: Rows, query: bool):
    shape = (num_k_rows, -1, rows.codes.shape[1] // tile, 1) if query else (
        num_k_rows, 1, 1, -1)
    return [tuple(r.reshape(shape) for r in _ranges(x, tile))
            for x in (rows.codes, rows.index, rows.seg) if x is not None]

  (qc_lo, qc_hi), (qi_lo, qi_hi), *q_seg = ranges(q, True)
  (kc_lo, kc_hi), (ki_lo, ki_hi), *k_seg = ranges(k, False)
  meet = (qc_lo <= kc_hi) & (kc_lo <= qc_hi) & (ki_lo <= qi_hi)
  if window is not None:
    meet &= qi_lo - ki_hi < window
  for (qs_lo, qs_hi), (ks_lo, ks_hi) in zip(q_seg, k_seg):
    meet &= (qs_lo <= ks_hi) & (ks_lo <= qs_hi)
  return meet


def tile_lists(meet_RON):
  """Per row and outer tile, the met inner tiles in ascending order, padded to a static
  capacity (at least 2: with 1, XLA would hoist a loop body that reads a constant index;
  see `parallelism.schedule`), and their count."""
  capacity = max(meet_RON.shape[-1], 2)
  padded = jnp.pad(meet_RON, [(0, 0), (0, 0), (0, capacity - meet_RON.shape[-1])])
  return (jnp.argsort(~padded, axis=-1, stable=True).astype(jnp.int32),
          meet_RON.sum(axis=-1, dtype=jnp.int32))


def _tile(x_RT, row, i, tile: int):
  """Tile `i` of row `row`: [t, ...]."""
  start = (row, i * tile) + (0,) * (x_RT.ndim - 2)
  return lax.dynamic_slice(x_RT, start, (1, tile, *x_RT.shape[2:]))[0]


def _put(x_RT, row, i, value):
  start = (row, i * value.shape[0]) + (0,) * (x_RT.ndim - 2)
  return lax.dynamic_update_slice(x_RT, value[None].astype(x_RT.dtype), start)


# The score tiles one batch of `_over_tiles` holds at once on a GPU (a few float32 [t, t]
# arrays per tile; its q, k, v tiles and carries add about a fifth at D = 64): what the walk
# needs beyond its operands, whatever the block's length.
_SCORE_BYTES = 1 << 28


def tiles_side_by_side(count: int, tile: int) -> int:
  """How many of `count` tiles `_over_tiles` walks at once: one on a CPU, which runs a walk
  fastest without the masked steps of a batch's shorter lists; on a GPU as many as
  _SCORE_BYTES holds, since one at a time is a tiny step each."""
  if target.backend() == "cpu":
    return 1
  return max(1, min(count, _SCORE_BYTES // (4 * 4 * tile * tile)))


def _over_tiles(one_tile, lengths_U, tile: int):
  """`one_tile(u)` for every tile u (its list `lengths_U[u]` long), stacked: batches of tiles
  walked side by side, one after another. A batch's loop runs to its longest list (the
  shorter ones masked), so a batch takes tiles of like lengths (the order is undone after)."""
  count = lengths_U.shape[0]
  size = tiles_side_by_side(count, tile)
  if size == 1:  # a plain loop, no vmap
    return lax.map(one_tile, jnp.arange(count, dtype=jnp.int32))
  order_U = jnp.argsort(lengths_U).astype(jnp.int32)
  by_length = lax.map(one_tile, order_U, batch_size=size)
  return jax.tree.map(lambda x: x[jnp.argsort(order_U)], by_length)


def _visible(spec: MaskSpec, q: Rows, q_row, i, k: Rows, k_row, j, tile: int, span):
  """[tq, tk]: the rule (`parallelism.masks.visible`) of one computed tile pair."""
  q_at = lambda x: None if x is None else _tile(x, q_row, i, tile)[:, None]
  k_at = lambda x: None if x is None else _tile(x, k_row, j, tile)[None, :]
  return visible(spec, q_at(q.index) - k_at(k.index), Side(q_at(q.seg), codes=q_at(q.codes)),
                 Side(k_at(k.seg), codes=k_at(k.codes)), span)


class _Setup(NamedTuple):
  q: Rows
  k: Rows
  group: int
  num_q_tiles: int
  meet: jax.Array  # [Rk, G, nq, nk]
  spans_R: jax.Array | None  # per query row


def _setup(q_codes_BTH, k_codes_BTK, q_seg_BT, k_seg_BT, q_index_T, k_index_T, tile,
           spans_H, window, q_run_T=None, k_run_T=None) -> _Setup:
  for name, length in (("query", q_codes_BTH.shape[1]), ("key", k_codes_BTK.shape[1])):
    if length % tile:
      raise ValueError(f"{name} block length {length} is not divisible by tile size {tile}")
  q = sort_rows(q_codes_BTH, q_index_T, q_seg_BT, q_run_T)
  k = sort_rows(k_codes_BTK, k_index_T, k_seg_BT, k_run_T)
  spans_R = None if spans_H is None else jnp.tile(spans_H, q_codes_BTH.shape[0])
  return _Setup(q, k, q_codes_BTH.shape[2] // k_codes_BTK.shape[2],
                q_codes_BTH.shape[1] // tile, meets(q, k, tile, window), spans_R)


def computed_tiles(q_codes_BTH, k_codes_BTK, q_seg_BT, k_seg_BT, q_index_T, k_index_T, *,
                   tile: int, window: int | None = None, q_run_T=None,
                   k_run_T=None) -> jax.Array:
  """How many (query head, query tile, key tile) pairs the kernel computes on this block."""
  return _setup(q_codes_BTH, k_codes_BTK, q_seg_BT, k_seg_BT, q_index_T, k_index_T, tile,
                None, window, q_run_T, k_run_T).meet.sum(dtype=jnp.int32)


def _setup_of(mask: Mask, q_index_T, k_index_T, tile, q_run_T, k_run_T) -> _Setup:
  return _setup(mask.q.codes, mask.k.codes, mask.q.segment_ids, mask.k.segment_ids, q_index_T,
                k_index_T, tile, mask.q.spans, mask.spec.window, q_run_T, k_run_T)


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, q_index_T, k_index_T, tile: int,
              q_run_T=None, k_run_T=None) -> tuple[jax.Array, jax.Array]:
  """(out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32) of the block pair, walking the met tiles.
  `*_index_T`: original token indices; `*_run_T`: runs (`runs`; None: one run)."""
  spec = mask.spec
  at = _setup_of(mask, q_index_T, k_index_T, tile, q_run_T, k_run_T)
  q_RTD = gather_rows(q_BTHD, at.q.order)
  k_RTD, v_RTD = (gather_rows(x, at.k.order) for x in (k_BTKD, v_BTKD))
  nq = at.num_q_tiles
  lists, counts = tile_lists(at.meet.reshape(q_RTD.shape[0], nq, -1))
  scale = q_BTHD.shape[3] ** -0.5

  def one_query_tile(u):
    q_row, i = u // nq, u % nq
    k_row = q_row // at.group
    q_tD = _tile(q_RTD, q_row, i, tile)[None, None, None]  # [1, 1, 1, t, D]
    span = None if at.spans_R is None else at.spans_R[q_row]

    def visit(n, carry):
      j = lists[q_row, i, n]
      k_tD, v_tD = (_tile(x, k_row, j, tile)[None, None] for x in (k_RTD, v_RTD))
      seen = _visible(spec, at.q, q_row, i, at.k, k_row, j, tile, span)
      return fwd_update(carry, q_tD, k_tD, v_tD, seen[None, None, None], spec=spec,
                        scale=scale)

    rows = q_tD.shape[:-1]
    init = (jnp.full(rows, -jnp.inf, _F32), jnp.zeros(rows, _F32), jnp.zeros(q_tD.shape, _F32))
    out_tD, lse_t = fwd_result(*lax.fori_loop(0, counts[q_row, i], visit, init), spec=spec,
                               scale=scale)
    return out_tD[0, 0, 0], lse_t[0, 0, 0]

  out_UtD, lse_Ut = _over_tiles(one_query_tile, counts.reshape(-1), tile)
  batch = q_BTHD.shape[0]
  return (scatter_rows(out_UtD.reshape(q_RTD.shape), at.q.order, batch),
          scatter_rows(lse_Ut.reshape(q_RTD.shape[:2]), at.q.order, batch))


def block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, mask: Mask, *, q_index_T,
              k_index_T, tile: int, q_run_T=None, k_run_T=None) -> Grads:
  """Float32 gradients of the block pair from the GLOBAL lse and delta (the contract): dq
  per query tile over the key tiles it meets, dk and dv per key tile over the (query head of
  its group, query tile) pairs that meet it."""
  spec = mask.spec
  at = _setup_of(mask, q_index_T, k_index_T, tile, q_run_T, k_run_T)
  # lse -inf (a query that sees nothing) -> +inf so exp(s - lse) is 0 rather than NaN.
  lse_safe = jnp.where(jnp.isfinite(lse_BTH), lse_BTH, jnp.inf).astype(_F32)
  q_side = tuple(gather_rows(x, at.q.order)
                 for x in (q_BTHD, dout_BTHD, lse_safe, delta_BTH.astype(_F32)))
  k_RTD, v_RTD = (gather_rows(x, at.k.order) for x in (k_BTKD, v_BTKD))
  nq, nk = at.num_q_tiles, k_RTD.shape[1] // tile
  q_lists, q_counts = tile_lists(at.meet.reshape(q_side[0].shape[0], nq, -1))
  meet_RKGQ = jnp.moveaxis(at.meet, 3, 1)  # [Rk, nk, G, nq]
  k_lists, k_counts = tile_lists(meet_RKGQ.reshape(*meet_RKGQ.shape[:2], -1))
  scale = q_BTHD.shape[3] ** -0.5
  head_dim = q_BTHD.shape[3]

  def pair(q_row, i, k_row, j, carry):
    """bwd_update of one met tile pair (carry: dk, dv, dq^T)."""
    q_xs = tuple(_tile(x, q_row, i, tile)[None, None, None] for x in q_side)
    k_tD, v_tD = (_tile(x, k_row, j, tile)[None, None] for x in (k_RTD, v_RTD))
    span = None if at.spans_R is None else at.spans_R[q_row]
    seen_T = _visible(spec, at.q, q_row, i, at.k, k_row, j, tile, span).T
    return bwd_update(carry, q_xs, (k_tD, v_tD, jnp.swapaxes(k_tD, 2, 3)),
                      seen_T[None, None, :, None], spec=spec, scale=scale)

  no_kv = jnp.zeros((1, 1, tile, head_dim), _F32)
  no_dq = jnp.zeros((1, 1, head_dim, 1, tile), _F32)  # dq^T of one query tile

  def one_query_tile(u):  # its dq, over the key tiles it meets (the forward's lists)
    q_row, i = u // nq, u % nq
    k_row = q_row // at.group

    def visit(n, dq_DGt):
      return pair(q_row, i, k_row, q_lists[q_row, i, n], (no_kv, no_kv, dq_DGt))[2]

    return lax.fori_loop(0, q_counts[q_row, i], visit, no_dq)[0, 0, :, 0].T

  def one_key_tile(u):  # its dk and dv, over the (query head, query tile) pairs it meets
    k_row, j = u // nk, u % nk

    def visit(n, dkv):
      g, i = k_lists[k_row, j, n] // nq, k_lists[k_row, j, n] % nq
      return pair(k_row * at.group + g, i, k_row, j, (*dkv, no_dq))[:2]

    dk_tD, dv_tD = lax.fori_loop(0, k_counts[k_row, j], visit, (no_kv, no_kv))
    return dk_tD[0, 0], dv_tD[0, 0]

  dq_UtD = _over_tiles(one_query_tile, q_counts.reshape(-1), tile)
  dk_UtD, dv_UtD = _over_tiles(one_key_tile, k_counts.reshape(-1), tile)
  batch = q_BTHD.shape[0]
  return Grads(scatter_rows(dq_UtD.reshape(q_side[0].shape), at.q.order, batch),
               scatter_rows(dk_UtD.reshape(k_RTD.shape), at.k.order, batch),
               scatter_rows(dv_UtD.reshape(v_RTD.shape), at.k.order, batch))
