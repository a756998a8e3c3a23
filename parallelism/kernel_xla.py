"""The `xla` block kernel: tiled flash attention of one query block against one key block.

Pure JAX, any backend: the reference every other kernel is checked against (the contract,
masks and options included, is in `parallelism.kernels`). The static schedule says which
tile pairs to compute: per query tile (forward) or key tile (backward), the runs of UNMASKED
tiles are plain loops with no mask, then the MASKED tiles apply their precomputed mask; SKIP
tiles are never visited and nothing is classified at run time (the loop bounds read only the
pair's row of the schedule's tables). A MASKED tile on a causal diagonal
(`TileTables.upper_right_empty`) is computed in two parts that leave out the quarter no
query sees (four quarters were no faster). Segment ids, a run-time mask, apply in every
computed tile (the rule, `parallelism.masks.visible`); run-time codes take sorted ranges
(`parallelism.kernel_hash`), SparseK its ranked keys (`parallelism.kernel_sparsek`).
Per-head spans narrow MASKED tiles only, by the distances of the pair's token indices
(`RingSchedule.pair_index`).

Matmuls work on head-major tiles (`parallelism.tile_math`), each a plain batched one; the
arrays the inner loop walks are made head-major once per call and sliced per tile, which
measured faster than transposing per tile pair. GQA keeps K/V
un-repeated: q head h = kv_head * G + g (as `jnp.repeat(k, G, 2)` pairs them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import kernel_hash, kernel_sparsek
from parallelism.kernel_grads import Grads, Merged
from parallelism.masks import Mask, MaskSpec, Side, visible
from parallelism.schedule import RingSchedule, TileLists, over_tiles
from parallelism.tile_math import bwd_update, fwd_result, fwd_update

_F32 = jnp.float32
_Q_AXIS = 3  # the token axis of head-major query-side tiles, [B, Hkv, G, t, ...]


def _tile_of(x, i, tile: int, axis: int = 1):
  """Tile `i` along the token axis (axis 1 of a token-major array)."""
  return lax.dynamic_slice_in_dim(x, i * tile, tile, axis=axis)


def _with_tile(x_BT, i, tile: int, value_Bt):
  """`x_BT` with tile `i` replaced (in place inside a loop carry)."""
  return lax.dynamic_update_slice_in_dim(x_BT, value_Bt.astype(x_BT.dtype), i * tile, axis=1)


def _q_head_major(x_BTH, num_kv: int):
  """[B, T, Hq, ...] -> [B, Hkv, G, T, ...]."""
  batch, length, num_heads = x_BTH.shape[:3]
  x = x_BTH.reshape(batch, length, num_kv, num_heads // num_kv, *x_BTH.shape[3:])
  return jnp.moveaxis(x, 1, _Q_AXIS)


def _q_token_major(x_BKGT):
  """Inverse of `_q_head_major`."""
  x = jnp.moveaxis(x_BKGT, _Q_AXIS, 1)
  return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _key_tile(k_BTKD, v_BTKD, j, tile: int):
  """Key tile `j`: k and v head-major, [B, Hkv, t, D]."""
  return tuple(jnp.swapaxes(_tile_of(x, j, tile), 1, 2) for x in (k_BTKD, v_BTKD))


def pair_rows(lists: TileLists, pair) -> TileLists:
  """One block pair's rows of the schedule's tile lists, as (constant) JAX arrays."""
  return TileLists(*(jnp.asarray(table)[pair] for table in lists))


def _spans_KG(spans_H, num_kv: int):
  """Per-query-head spans as [Hkv, G] (q head h = kv_head * G + g), or None."""
  return None if spans_H is None else spans_H.reshape(num_kv, -1)


def visibility(pair_mask: Mask, mask_tt=None, behind=None):
  """What a tile pair's queries see; None when they see every key: the rule
  (`parallelism.masks.visible`) on the tile's run-time operands (laid out by the caller to
  broadcast against its scores: query-major in the forward, key-major in the backward), and
  on a MASKED tile its precomputed mask `mask_tt` (laid out likewise), or with per-head
  spans the rule on the pair's distances `behind`."""
  if behind is not None:
    return visible(pair_mask, behind)
  seen = visible(pair_mask)
  if mask_tt is None:
    return seen
  return mask_tt[None] if seen is None else seen & mask_tt[None]


def _fwd_update_in_halves(carry, q_BKGtD, k_BKtD, v_BKtD, visible, *, spec: MaskSpec,
                          scale: float):
  """`fwd_update` of a MASKED tile whose first half of queries sees none of its second half
  of keys (`TileTables.upper_right_empty`): that quarter is not computed. The first half of
  queries meets the first half of keys, the second half all keys. Tiles are square here."""
  h = q_BKGtD.shape[_Q_AXIS] // 2
  first, second = (tuple(lax.slice_in_dim(c, start, stop, axis=_Q_AXIS) for c in carry)
                   for start, stop in ((0, h), (h, 2 * h)))
  first = fwd_update(first, q_BKGtD[:, :, :, :h], k_BKtD[:, :, :h], v_BKtD[:, :, :h],
                      visible[..., :h, :h], spec=spec, scale=scale)
  second = fwd_update(second, q_BKGtD[:, :, :, h:], k_BKtD, v_BKtD, visible[..., h:, :],
                       spec=spec, scale=scale)
  return tuple(jnp.concatenate(pair, axis=_Q_AXIS) for pair in zip(first, second))


def _pair_index(schedule: RingSchedule, pair, index=None):
  """The pair's query and key token indices ([T] int32 each): the ring's own (`index`) where
  given, else the pair's representative blocks' (`RingSchedule.pair_index`), which every
  device that computes the pair shares as far as the schedule's mask goes."""
  return index or tuple(jnp.asarray(index_PT)[pair] for index_PT in schedule.pair_index)


def _behind(q_index_T, k_index_T, i, j, tile: int):
  """[tq, tk] distances `q - k` of query tile i and key tile j."""
  return (_tile_of(q_index_T, i, tile, 0)[:, None] - _tile_of(k_index_T, j, tile, 0)[None, :])


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, schedule: RingSchedule, pair, tile: int,
              index=None) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32).
  With codes, hash attention's run-time walk (`parallelism.kernel_hash`); with SparseK's
  thresholds and scores, its walk (`kernel_sparsek`)."""
  spec = mask.spec
  if spec.selects:
    q_index, k_index = _pair_index(schedule, pair, index)
    return kernel_sparsek.block_fwd(q_BTHD, k_BTKD, v_BTKD, mask, q_index_T=q_index,
                                    k_index_T=k_index, tile=tile)
  if spec.coded:  # sorted by the ring; a pair alone, by its representative's positions
    q_index, k_index = _pair_index(schedule, pair, index)
    return kernel_hash.block_fwd(q_BTHD, k_BTKD, v_BTKD, mask, tile=tile, q_index_T=q_index,
                                 k_index_T=k_index)
  q_seg_BT, k_seg_BT, spans_H = mask.q.segment_ids, mask.k.segment_ids, mask.q.spans
  num_kv = k_BTKD.shape[2]
  spans_KG = _spans_KG(spans_H, num_kv)
  q_index_T, k_index_T = _pair_index(schedule, pair) if spans_H is not None else (None, None)
  scale = q_BTHD.shape[3] ** -0.5
  tables = schedule.tiles(tile)
  lists, masks = pair_rows(tables.by_query, pair), jnp.asarray(tables.masks)
  halves = tables.upper_right_empty
  segments = q_seg_BT is not None
  k_BKTD, v_BKTD = (jnp.swapaxes(x, 1, 2) for x in (k_BTKD, v_BTKD))  # walked by the inner loop

  def q_tile_body(i, results):
    q_BKGtD = _q_head_major(_tile_of(q_BTHD, i, tile), num_kv)
    q_seg_Bt = _tile_of(q_seg_BT, i, tile) if segments else None

    def visit(j, carry, mask_id):
      k_BKtD, v_BKtD = (_tile_of(x, j, tile, axis=2) for x in (k_BKTD, v_BKTD))
      k_seg_Bt = _tile_of(k_seg_BT, j, tile) if segments else None
      at = lambda x, axes: None if x is None else jnp.expand_dims(x, axes)
      if mask_id is not None and spans_KG is not None:  # [B, Hkv, G, tq, tk]
        pair_mask = Mask(spec, Side(at(q_seg_Bt, (1, 2, 4)), spans=spans_KG[:, :, None, None]),
                         Side(at(k_seg_Bt, (1, 2, 3))))
        visible_ = visibility(pair_mask, behind=_behind(q_index_T, k_index_T, i, j, tile))
      else:  # [B, tq, tk], then [B, 1, 1, tq, tk]
        pair_mask = Mask(spec, Side(at(q_seg_Bt, 2)), Side(at(k_seg_Bt, 1)))
        visible_ = visibility(pair_mask, None if mask_id is None else masks[mask_id])
        visible_ = None if visible_ is None else visible_[:, None, None]
      update = _fwd_update_in_halves if mask_id is not None and halves else fwd_update
      return update(carry, q_BKGtD, k_BKtD, v_BKtD, visible_, spec=spec, scale=scale)

    rows_BKGt = q_BKGtD.shape[:-1]
    init = (jnp.full(rows_BKGt, -jnp.inf, _F32), jnp.zeros(rows_BKGt, _F32),
            jnp.zeros(q_BKGtD.shape, _F32))
    out_BKGtD, lse_BKGt = fwd_result(*over_tiles(lists, i, visit, init), spec=spec,
                                     scale=scale)
    out_BTHD, lse_BTH = results
    return (_with_tile(out_BTHD, i, tile, _q_token_major(out_BKGtD)),
            _with_tile(lse_BTH, i, tile, _q_token_major(lse_BKGt)))

  # Every query tile is overwritten.
  results = (jnp.zeros(q_BTHD.shape, _F32), jnp.zeros(q_BTHD.shape[:3], _F32))
  return lax.fori_loop(0, q_BTHD.shape[1] // tile, q_tile_body, results)


def _bwd_update_in_halves(carry, q_xs, k_xs, visible_T, *, spec: MaskSpec, scale: float):
  """`bwd_update` of a MASKED tile whose second half of keys is seen by none of its first
  half of queries (`TileTables.upper_right_empty`): the first half of keys meets all queries,
  the second half only the second half of queries. Tiles are square here."""
  dk_BKtD, dv_BKtD, dq_BKDGt = carry
  h = dk_BKtD.shape[2] // 2
  k_axes = (2, 2, 3)  # k, v, and k transposed
  first_keys, second_keys = (tuple(lax.slice_in_dim(x, start, stop, axis=axis)
                                   for x, axis in zip(k_xs, k_axes))
                             for start, stop in ((0, h), (h, 2 * h)))
  dk_first, dv_first, dq_BKDGt = bwd_update(
      (dk_BKtD[:, :, :h], dv_BKtD[:, :, :h], dq_BKDGt), q_xs, first_keys,
      visible_T[:, :, :h], spec=spec, scale=scale)
  second_queries = tuple(lax.slice_in_dim(x, h, 2 * h, axis=_Q_AXIS) for x in q_xs)
  dk_second, dv_second, dq_second = bwd_update(
      (dk_BKtD[:, :, h:], dv_BKtD[:, :, h:], dq_BKDGt[..., h:]), second_queries, second_keys,
      visible_T[:, :, h:, :, h:], spec=spec, scale=scale)
  return (jnp.concatenate([dk_first, dk_second], axis=2),
          jnp.concatenate([dv_first, dv_second], axis=2),
          jnp.concatenate([dq_BKDGt[..., :h], dq_second], axis=-1))


def block_bwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, schedule: RingSchedule,
              pair, tile: int, index=None) -> Grads:
  """Gradient contributions (float32) of one query block x key block.

  `merged` holds the GLOBAL lse of the queries (merged over all key blocks) and `delta =
  sum(dout * out, -1)` of the global output, so each block's probabilities are recomputed
  exactly as the forward's final softmax. With SparseK, also the thresholds' and scores'
  gradients (`kernel_sparsek`).
  """
  spec = mask.spec
  if spec.selects:
    q_index, k_index = _pair_index(schedule, pair, index)
    return kernel_sparsek.block_bwd(q_BTHD, k_BTKD, v_BTKD, mask, merged, q_index_T=q_index,
                                    k_index_T=k_index, tile=tile)
  if spec.coded:
    q_index, k_index = _pair_index(schedule, pair, index)
    return kernel_hash.block_bwd(q_BTHD, k_BTKD, v_BTKD, mask, merged, tile=tile,
                                 q_index_T=q_index, k_index_T=k_index)
  q_seg_BT, k_seg_BT, spans_H = mask.q.segment_ids, mask.k.segment_ids, mask.q.spans
  num_kv = k_BTKD.shape[2]
  scale = q_BTHD.shape[3] ** -0.5
  spans_KG = _spans_KG(spans_H, num_kv)
  q_index_T, k_index_T = _pair_index(schedule, pair) if spans_H is not None else (None, None)
  tables = schedule.tiles(tile)
  # Key-major masks, transposed on the host: a traced mask id's gather is not folded away
  # as a lone constant mask is, and transposing each gathered mask cost striped's backward 2%.
  lists, masks_T = pair_rows(tables.by_key, pair), jnp.asarray(tables.masks.swapaxes(1, 2))
  halves = tables.upper_right_empty
  segments = q_seg_BT is not None
  # The query side, walked by the inner loop, head-major once.
  per_head = tuple(_q_head_major(x, num_kv) for x in (q_BTHD, merged.dout, merged.safe_lse(),
                                                      merged.delta.astype(_F32)))

  def k_tile_body(j, grads):
    k_BKtD, v_BKtD = _key_tile(k_BTKD, v_BTKD, j, tile)
    k_xs = (k_BKtD, v_BKtD, jnp.swapaxes(k_BKtD, 2, 3))
    k_seg_Bt = _tile_of(k_seg_BT, j, tile) if segments else None

    def visit(i, carry, mask_id):
      dk, dv, dq_BTHD = carry
      dq_BKDGt = jnp.moveaxis(_q_head_major(_tile_of(dq_BTHD, i, tile), num_kv), 4, 2)
      q_xs = tuple(_tile_of(x, i, tile, axis=_Q_AXIS) for x in per_head)
      q_seg_Bt = _tile_of(q_seg_BT, i, tile) if segments else None
      at = lambda x, axes: None if x is None else jnp.expand_dims(x, axes)
      if mask_id is not None and spans_KG is not None:  # key-major: [B, Hkv, tk, G, tq]
        pair_mask = Mask(spec, Side(at(q_seg_Bt, (1, 2, 3)), spans=spans_KG[:, None, :, None]),
                         Side(at(k_seg_Bt, (1, 3, 4))))
        behind_T = _behind(q_index_T, k_index_T, i, j, tile).T[:, None, :]
        visible_T = visibility(pair_mask, behind=behind_T)
      else:  # [B, tk, tq], then [B, 1, tk, 1, tq]
        pair_mask = Mask(spec, Side(at(q_seg_Bt, 1)), Side(at(k_seg_Bt, 2)))
        visible_T = visibility(pair_mask, None if mask_id is None else masks_T[mask_id])
        visible_T = None if visible_T is None else visible_T[:, None, :, None, :]
      update = _bwd_update_in_halves if mask_id is not None and halves else bwd_update
      dk, dv, dq_BKDGt = update((dk, dv, dq_BKDGt), q_xs, k_xs, visible_T, spec=spec,
                                scale=scale)
      # In place in the loop carry: only computed tiles touch dq.
      dq_BKGtD = jnp.moveaxis(dq_BKDGt, 2, 4)
      return dk, dv, _with_tile(dq_BTHD, i, tile, _q_token_major(dq_BKGtD))

    dq_BTHD, dk_BTKD, dv_BTKD = grads
    init = (jnp.zeros(k_BKtD.shape, _F32), jnp.zeros(v_BKtD.shape, _F32), dq_BTHD)
    dk, dv, dq_BTHD = over_tiles(lists, j, visit, init)
    return (dq_BTHD, _with_tile(dk_BTKD, j, tile, jnp.swapaxes(dk, 1, 2)),
            _with_tile(dv_BTKD, j, tile, jnp.swapaxes(dv, 1, 2)))

  # dq accumulates over key tiles; each dk/dv tile is written once.
  grads = (jnp.zeros(q_BTHD.shape, _F32), jnp.zeros(k_BTKD.shape, _F32),
           jnp.zeros(v_BTKD.shape, _F32))
  return Grads(*lax.fori_loop(0, k_BTKD.shape[1] // tile, k_tile_body, grads))
