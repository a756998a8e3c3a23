"""The `xla` block kernel: tiled flash attention of one query block against one key block.

Pure JAX, runs on any backend; it is the reference the Pallas kernel is checked against.
Each (query tile, key tile) pair has a class from `parallelism.tiles`. The tile loops run
only over the pairs that are not SKIP (`_computed_first`), so a skipped pair costs not even
a loop iteration; a `lax.cond` picks the unmasked or the masked update. A MASKED pair is
computed as 2 x 2 quarter tiles classified by the same rule (`_by_quarters`): on a block's
diagonal one quarter is skipped and one is unmasked. Classes are decided from min/max over
the whole local batch, never vmapped, because a vmapped cond would turn into a select that
computes both branches.

Shapes: q `[B, Tq, Hq, D]`, k/v `[B, Tk, Hkv, D]`, token_index/segment_ids `[B, T]`.
Inside, arrays are head-major (`[B, Hkv, G, T, D]` for q, `[B, Hkv, T, D]` for k/v) so every
matmul is a plain batched one with no transpose of a tile. GQA keeps K/V un-repeated: q head
h = kv_head * G + g (the pairing of `jnp.repeat(k, G, axis=2)`). Matmuls take the input
dtype (bf16 ok) and accumulate in float32. Log-sum-exp is the natural log, float32, shape
`[B, Tq, Hq]`; a query that sees no key gets output 0 and lse -inf, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import tiles

_F32 = jnp.float32
# The token axis of head-major arrays (and of their tiles): q-side [B, Hkv, G, T, ...],
# k/v [B, Hkv, T, D], index and segment ids [B, T].
_Q_AXIS, _KV_AXIS, _INDEX_AXIS = 3, 2, 1
_K_AXES = (_KV_AXIS, _KV_AXIS, _INDEX_AXIS, _INDEX_AXIS)  # of `_key_tiles`


def _tiled(x, tile: int, axis: int):
  """Splits `axis` into tiles and puts the tile number first, so loops index it."""
  x = x.reshape(*x.shape[:axis], x.shape[axis] // tile, tile, *x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _untiled(x, axis: int):
  """Inverse of `_tiled`."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def _q_head_major(x_BTH, num_kv: int):
  """[B, T, Hq, ...] -> [B, Hkv, G, T, ...]."""
  batch, length, num_heads = x_BTH.shape[:3]
  x = x_BTH.reshape(batch, length, num_kv, num_heads // num_kv, *x_BTH.shape[3:])
  return jnp.moveaxis(x, 1, _Q_AXIS)


def _q_token_major(x_BKGT):
  """Inverse of `_q_head_major`."""
  x = jnp.moveaxis(x_BKGT, _Q_AXIS, 1)
  return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _query_tiles(per_head, q_index_BT, q_seg_BT, num_kv: int, tile: int):
  """Tiles of the query side: each [B, T, Hq, ...] array of `per_head` head-major,
  [N, B, Hkv, G, t, ...], then the index and segment ids, [N, B, t]."""
  return (*(_tiled(_q_head_major(x, num_kv), tile, _Q_AXIS) for x in per_head),
          _tiled(q_index_BT, tile, _INDEX_AXIS), _tiled(q_seg_BT, tile, _INDEX_AXIS))


def _key_tiles(k_BTKD, v_BTKD, k_index_BT, k_seg_BT, tile: int):
  """Tiles of the key side: k and v head-major, [N, B, Hkv, t, D], then the index and
  segment ids, [N, B, t]."""
  return (*(_tiled(jnp.swapaxes(x, 1, 2), tile, _KV_AXIS) for x in (k_BTKD, v_BTKD)),
          _tiled(k_index_BT, tile, _INDEX_AXIS), _tiled(k_seg_BT, tile, _INDEX_AXIS))


def _mask(q_index_Bt, q_seg_Bt, k_index_Bt, k_seg_Bt):
  """Visibility [B, tq, tk]: causal in token_index, same segment."""
  return ((k_index_Bt[:, None, :] <= q_index_Bt[:, :, None])
          & (k_seg_Bt[:, None, :] == q_seg_Bt[:, :, None]))


def _classes(q_index, q_seg, k_index, k_seg, tile: int):
  """Class of every (query tile, key tile) pair, [num_q_tiles, num_k_tiles] int32."""
  return tiles.classify_all(tiles.summarize_tiles(q_index, q_seg, tile),
                            tiles.summarize_tiles(k_index, k_seg, tile))


def _computed_first(classes_N):
  """(positions of the non-SKIP tiles in order, then the SKIP ones; how many are non-SKIP).

  The tile loops run only over the first `count` positions; the order does not assume
  sorted token indices.
  """
  skip_N = classes_N == tiles.SKIP
  return jnp.argsort(skip_N, stable=True), jnp.sum(~skip_N)


def _by_quarters(update, carry, q_xs, k_xs, *, carry_axes, carry_sides, q_axes, k_axes):
  """A MASKED tile pair as 2 x 2 quarter pairs, each classified by the same rule.

  `update(carry, q_xs, k_xs, masked=...)` is the per-pair update. Each argument is cut in
  halves along its token axis (`*_axes`); a carry element belongs to the query side or the
  key side (`carry_sides`, 'q' or 'k'), which says which half of it a quarter updates. An
  odd tile is computed whole.
  """
  length = q_xs[0].shape[q_axes[0]]
  half = length // 2
  if half == 0 or 2 * half != length:
    return update(carry, q_xs, k_xs, masked=True)

  def cut(x, axis, part):
    return lax.slice_in_dim(x, part * half, (part + 1) * half, axis=axis)

  q_halves = [tuple(cut(x, axis, a) for x, axis in zip(q_xs, q_axes)) for a in range(2)]
  k_halves = [tuple(cut(x, axis, b) for x, axis in zip(k_xs, k_axes)) for b in range(2)]
  # The index and segment ids are the last two of each side's arguments.
  classes_22 = _classes(*q_xs[-2:], *k_xs[-2:], half)
  pieces = [[cut(x, axis, 0), cut(x, axis, 1)] for x, axis in zip(carry, carry_axes)]
  branches = [lambda c, *_: c, functools.partial(update, masked=False),
              functools.partial(update, masked=True)]
  for a in range(2):
    for b in range(2):
      part = {"q": a, "k": b}
      sub = tuple(p[part[side]] for p, side in zip(pieces, carry_sides))
      sub = lax.switch(classes_22[a, b], branches, sub, q_halves[a], k_halves[b])
      for p, side, x in zip(pieces, carry_sides, sub):
        p[part[side]] = x
  return tuple(jnp.concatenate(p, axis=axis) for p, axis in zip(pieces, carry_axes))


def _fwd_update(carry, q_xs, k_xs, *, scale: float, masked: bool):
  """One online-softmax step of a query tile on a key tile; carry is (m, l, acc).

  m is the running max of the UNSCALED scores; the scale goes into the exponent, which
  saves a pass over the scores (scale > 0, so the max commutes with it).
  """
  m_BKGt, l_BKGt, acc_BKGtD = carry
  q_BKGtD, q_idx_Bt, q_seg_Bt = q_xs
  k_BKtD, v_BKtD, k_idx_Bt, k_seg_Bt = k_xs
  s = jnp.einsum("bhgqd,bhkd->bhgqk", q_BKGtD, k_BKtD, preferred_element_type=_F32)
  if masked:
    s = jnp.where(_mask(q_idx_Bt, q_seg_Bt, k_idx_Bt, k_seg_Bt)[:, None, None], s, -jnp.inf)
  m_new = jnp.maximum(m_BKGt, s.max(axis=-1))
  # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  p = jnp.exp((s - m_safe[..., None]) * scale)
  alpha = jnp.exp((m_BKGt - m_safe) * scale)
  l_new = alpha * l_BKGt + p.sum(axis=-1)
  pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v_BKtD.dtype), v_BKtD,
                  preferred_element_type=_F32)
  return m_new, l_new, alpha[..., None] * acc_BKGtD + pv


def block_fwd(q_BTHD, k_BTKD, v_BTKD, q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, *,
              tile: int) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32)."""
  head_dim = q_BTHD.shape[3]
  num_kv = k_BTKD.shape[2]
  scale = head_dim ** -0.5
  classes_NqNk = _classes(q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, tile)
  k_tiles = _key_tiles(k_BTKD, v_BTKD, k_index_BT, k_seg_BT, tile)
  unmasked = functools.partial(_fwd_update, scale=scale, masked=False)
  masked = functools.partial(
      _by_quarters, functools.partial(_fwd_update, scale=scale), carry_axes=(_Q_AXIS,) * 3,
      carry_sides=("q", "q", "q"), q_axes=(_Q_AXIS, _INDEX_AXIS, _INDEX_AXIS), k_axes=_K_AXES)

  def q_tile_body(_, q_xs):
    *q_xs, classes_N = q_xs
    q_xs = tuple(q_xs)
    order_N, count = _computed_first(classes_N)

    def k_tile_body(i, carry):
      j = order_N[i]
      k_xs = tuple(x[j] for x in k_tiles)
      return lax.cond(classes_N[j] == tiles.MASKED, masked, unmasked, carry, q_xs, k_xs)

    rows_BKGt = q_xs[0].shape[:-1]
    init = (jnp.full(rows_BKGt, -jnp.inf, _F32), jnp.zeros(rows_BKGt, _F32),
            jnp.zeros(q_xs[0].shape, _F32))
    m, l, acc = lax.fori_loop(0, count, k_tile_body, init)
    seen = l > 0
    lse_BKGt = jnp.where(seen, m * scale + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return None, (acc / jnp.where(seen, l, 1.0)[..., None], lse_BKGt)

  q_xs = (*_query_tiles((q_BTHD,), q_index_BT, q_seg_BT, num_kv, tile), classes_NqNk)
  _, (out_tiles, lse_tiles) = lax.scan(q_tile_body, None, q_xs)
  return (_q_token_major(_untiled(out_tiles, _Q_AXIS)),
          _q_token_major(_untiled(lse_tiles, _Q_AXIS)))


def _bwd_update(carry, q_xs, k_xs, *, scale: float, masked: bool):
  """Gradients of one query tile x key tile; carry is (dk, dv) of the key tile and dq of
  the query tile, all float32.

  Works in key-major scores [B, Kv, tk, G, tq], so dv, dp and dk are plain matmuls; only
  dq's contraction over keys reads a transposed operand.
  """
  dk_BKtD, dv_BKtD, dq_BKGtD = carry
  q_BKGtD, do_BKGtD, lse_BKGt, delta_BKGt, q_idx_Bt, q_seg_Bt = q_xs
  k_BKtD, v_BKtD, k_idx_Bt, k_seg_Bt = k_xs
  s_T = jnp.einsum("bhkd,bhgqd->bhkgq", k_BKtD, q_BKGtD, preferred_element_type=_F32)
  p_T = jnp.exp(s_T * scale - lse_BKGt[:, :, None])
  if masked:
    visible_T = jnp.swapaxes(_mask(q_idx_Bt, q_seg_Bt, k_idx_Bt, k_seg_Bt), 1, 2)
    p_T = jnp.where(visible_T[:, None, :, None, :], p_T, 0.0)
  dv_BKtD = dv_BKtD + jnp.einsum("bhkgq,bhgqd->bhkd", p_T.astype(do_BKGtD.dtype), do_BKGtD,
                                 preferred_element_type=_F32)
  dp_T = jnp.einsum("bhkd,bhgqd->bhkgq", v_BKtD, do_BKGtD, preferred_element_type=_F32)
  ds_T = (p_T * (dp_T - delta_BKGt[:, :, None]) * scale).astype(q_BKGtD.dtype)
  dk_BKtD = dk_BKtD + jnp.einsum("bhkgq,bhgqd->bhkd", ds_T, q_BKGtD,
                                 preferred_element_type=_F32)
  dq_BKGtD = dq_BKGtD + jnp.einsum("bhkgq,bhkd->bhgqd", ds_T, k_BKtD,
                                   preferred_element_type=_F32)
  return dk_BKtD, dv_BKtD, dq_BKGtD


def block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, q_index_BT, q_seg_BT,
              k_index_BT, k_seg_BT, *, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradient contributions (dq, dk, dv, all float32) of one query block x key block.

  `lse_BTH` is the GLOBAL log-sum-exp of the queries (merged over all key blocks) and
  `delta_BTH = sum(dout * out, -1)` with the global output, so each block's
  probabilities are recomputed exactly as the forward's final softmax.
  """
  head_dim = q_BTHD.shape[3]
  num_kv = k_BTKD.shape[2]
  scale = head_dim ** -0.5
  classes_NqNk = _classes(q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, tile)
  # lse -inf (a query that sees nothing) -> +inf so exp(s - lse) is 0 rather than NaN.
  lse_safe = jnp.where(jnp.isfinite(lse_BTH), lse_BTH, jnp.inf).astype(_F32)
  q_tiles = _query_tiles((q_BTHD, dout_BTHD, lse_safe, delta_BTH.astype(_F32)), q_index_BT,
                         q_seg_BT, num_kv, tile)
  unmasked = functools.partial(_bwd_update, scale=scale, masked=False)
  masked = functools.partial(
      _by_quarters, functools.partial(_bwd_update, scale=scale), carry_axes=(_KV_AXIS, _KV_AXIS, _Q_AXIS),
      carry_sides=("k", "k", "q"), q_axes=(_Q_AXIS,) * 4 + (_INDEX_AXIS,) * 2, k_axes=_K_AXES)

  def k_tile_body(dq_tiles, k_xs):
    *k_xs, classes_N = k_xs
    k_xs = tuple(k_xs)
    order_N, count = _computed_first(classes_N)

    def q_tile_body(n, carry):
      i = order_N[n]
      dk, dv, dq_tiles = carry
      dk, dv, dq = lax.cond(classes_N[i] == tiles.MASKED, masked, unmasked,
                            (dk, dv, dq_tiles[i]), tuple(x[i] for x in q_tiles), k_xs)
      # In place in the loop carry: only computed tiles touch dq.
      return dk, dv, dq_tiles.at[i].set(dq)

    init = (jnp.zeros(k_xs[0].shape, _F32), jnp.zeros(k_xs[1].shape, _F32), dq_tiles)
    dk, dv, dq_tiles = lax.fori_loop(0, count, q_tile_body, init)
    return dq_tiles, (dk, dv)

  k_xs = (*_key_tiles(k_BTKD, v_BTKD, k_index_BT, k_seg_BT, tile), classes_NqNk.T)
  dq_init = jnp.zeros(q_tiles[0].shape, _F32)
  dq_tiles, (dk_tiles, dv_tiles) = lax.scan(k_tile_body, dq_init, k_xs)
  dq_BTHD = _q_token_major(_untiled(dq_tiles, _Q_AXIS))
  dk_BTKD, dv_BTKD = (jnp.swapaxes(_untiled(x, _KV_AXIS), 1, 2) for x in (dk_tiles, dv_tiles))
  return dq_BTHD, dk_BTKD, dv_BTKD
