"""The `xla` block kernel: tiled flash attention of one query block against one key block.

Pure JAX, runs on any backend; it is the reference the Pallas kernel is checked against.
The loops are `lax.scan`s over tiles and each (query tile, key tile) pair goes through
`lax.switch` on its class from `parallelism.tiles`, so a skipped pair executes no
arithmetic at all (a real conditional on CPU/GPU). The class is decided once per pair
from min/max over the whole local batch, never vmapped, because a vmapped cond would
turn into a select that computes both branches.

Shapes: q `[B, Tq, Hq, D]`, k/v `[B, Tk, Hkv, D]`, token_index/segment_ids `[B, T]`.
GQA keeps K/V un-repeated by viewing q as `[B, T, Hkv, G, D]` with q head h = kv_head * G + g
(the same pairing as `jnp.repeat(k, G, axis=2)`). Matmuls take the input dtype (bf16 ok)
and accumulate in float32. Log-sum-exp is the natural log, float32, shape `[B, Tq, Hq]`;
a query that sees no key gets output 0 and lse -inf, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import tiles

_F32 = jnp.float32


def _tiled(x_BT, tile: int):
  """[B, T, ...] -> [T // tile, B, tile, ...], tiles leading so `scan` walks them."""
  batch, length = x_BT.shape[:2]
  x = x_BT.reshape(batch, length // tile, tile, *x_BT.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _untiled(x_NBt):
  """Inverse of `_tiled`."""
  x = jnp.moveaxis(x_NBt, 0, 1)
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _scores(q_BtKGD, k_BtKD, scale: float):
  """Scaled q.k^T in float32, [B, Kv, G, tq, tk]."""
  s = jnp.einsum("bqhgd,bkhd->bhgqk", q_BtKGD, k_BtKD, preferred_element_type=_F32)
  return s * scale


def _mask(q_index_Bt, q_seg_Bt, k_index_Bt, k_seg_Bt):
  """Visibility [B, 1, 1, tq, tk]: causal in token_index, same segment."""
  visible = ((k_index_Bt[:, None, :] <= q_index_Bt[:, :, None])
             & (k_seg_Bt[:, None, :] == q_seg_Bt[:, :, None]))
  return visible[:, None, None]


def _summaries(q_index, q_seg, k_index, k_seg, tile: int):
  return (tiles.summarize_tiles(q_index, q_seg, tile),
          tiles.summarize_tiles(k_index, k_seg, tile))


def block_fwd(q_BTHD, k_BTKD, v_BTKD, q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, *,
              tile: int) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32)."""
  batch, _, num_heads, head_dim = q_BTHD.shape
  num_kv = k_BTKD.shape[2]
  group = num_heads // num_kv
  scale = head_dim ** -0.5
  q_sum, k_sum = _summaries(q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, tile)
  q_tiles = _tiled(q_BTHD.reshape(*q_BTHD.shape[:2], num_kv, group, head_dim), tile)
  k_tiles, v_tiles = _tiled(k_BTKD, tile), _tiled(v_BTKD, tile)
  k_idx_tiles, k_seg_tiles = _tiled(k_index_BT, tile), _tiled(k_seg_BT, tile)

  def q_tile_body(_, q_xs):
    q_BtKGD, q_idx_Bt, q_seg_Bt, qi_min, qi_max, qs_min, qs_max = q_xs

    def k_tile_body(carry, k_xs):
      k_BtKD, v_BtKD, k_idx_Bt, k_seg_Bt, ki_min, ki_max, ks_min, ks_max = k_xs
      single = tiles.one_segment(qs_min, qs_max, ks_min, ks_max)
      tile_class = tiles.classify_tile(qi_min, qi_max, ki_min, ki_max, single)

      def update(masked: bool):
        def fn(carry):
          m_BKGt, l_BKGt, acc_BtKGD = carry
          s = _scores(q_BtKGD, k_BtKD, scale)
          if masked:
            s = jnp.where(_mask(q_idx_Bt, q_seg_Bt, k_idx_Bt, k_seg_Bt), s, -jnp.inf)
          m_new = jnp.maximum(m_BKGt, s.max(axis=-1))
          # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
          m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
          p = jnp.exp(s - m_safe[..., None])
          alpha = jnp.exp(m_BKGt - m_safe)
          l_new = alpha * l_BKGt + p.sum(axis=-1)
          pv = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v_BtKD.dtype), v_BtKD,
                          preferred_element_type=_F32)
          acc_new = jnp.moveaxis(alpha, -1, 1)[..., None] * acc_BtKGD + pv
          return m_new, l_new, acc_new
        return fn

      carry = lax.switch(tile_class, [lambda c: c, update(False), update(True)], carry)
      return carry, None

    t = q_BtKGD.shape[1]
    init = (jnp.full((batch, num_kv, group, t), -jnp.inf, _F32),
            jnp.zeros((batch, num_kv, group, t), _F32),
            jnp.zeros(q_BtKGD.shape, _F32))
    k_xs = (k_tiles, v_tiles, k_idx_tiles, k_seg_tiles, *k_sum)
    (m, l, acc), _ = lax.scan(k_tile_body, init, k_xs)
    seen = l > 0
    lse_BKGt = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    out_BtKGD = acc / jnp.moveaxis(jnp.where(seen, l, 1.0), -1, 1)[..., None]
    lse_BtKG = jnp.moveaxis(lse_BKGt, -1, 1)
    return None, (out_BtKGD, lse_BtKG)

  q_xs = (q_tiles, _tiled(q_index_BT, tile), _tiled(q_seg_BT, tile), *q_sum)
  _, (out_tiles, lse_tiles) = lax.scan(q_tile_body, None, q_xs)
  out_BTKGD, lse_BTKG = _untiled(out_tiles), _untiled(lse_tiles)
  return (out_BTKGD.reshape(q_BTHD.shape),
          lse_BTKG.reshape(batch, q_BTHD.shape[1], num_heads))


def block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, q_index_BT, q_seg_BT,
              k_index_BT, k_seg_BT, *, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradient contributions (dq, dk, dv, all float32) of one query block x key block.

  `lse_BTH` is the GLOBAL log-sum-exp of the queries (merged over all key blocks) and
  `delta_BTH = sum(dout * out, -1)` with the global output, so each block's
  probabilities are recomputed exactly as the forward's final softmax.
  """
  batch, _, num_heads, head_dim = q_BTHD.shape
  num_kv = k_BTKD.shape[2]
  group = num_heads // num_kv
  scale = head_dim ** -0.5
  q_sum, k_sum = _summaries(q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, tile)

  def grouped(x_BTHD):
    return x_BTHD.reshape(*x_BTHD.shape[:2], num_kv, group, head_dim)

  # lse -inf (a query that sees nothing) -> +inf so exp(s - lse) is 0 rather than NaN.
  lse_safe = jnp.where(jnp.isfinite(lse_BTH), lse_BTH, jnp.inf).astype(_F32)
  lse_tiles = _tiled(lse_safe.reshape(batch, -1, num_kv, group), tile)
  delta_tiles = _tiled(delta_BTH.astype(_F32).reshape(batch, -1, num_kv, group), tile)
  q_xs = (_tiled(grouped(q_BTHD), tile), _tiled(grouped(dout_BTHD), tile), lse_tiles,
          delta_tiles, _tiled(q_index_BT, tile), _tiled(q_seg_BT, tile), *q_sum)

  def k_tile_body(dq_tiles, k_xs):
    k_BtKD, v_BtKD, k_idx_Bt, k_seg_Bt, ki_min, ki_max, ks_min, ks_max = k_xs

    def q_tile_body(dkv, q_xs_i):
      (q_BtKGD, do_BtKGD, lse_BtKG, delta_BtKG, q_idx_Bt, q_seg_Bt,
       qi_min, qi_max, qs_min, qs_max) = q_xs_i
      single = tiles.one_segment(qs_min, qs_max, ks_min, ks_max)
      tile_class = tiles.classify_tile(qi_min, qi_max, ki_min, ki_max, single)

      def skip(dkv):
        return dkv, jnp.zeros(q_BtKGD.shape, _F32)

      def update(masked: bool):
        def fn(dkv):
          dk_BtKD, dv_BtKD = dkv
          s = _scores(q_BtKGD, k_BtKD, scale)
          p = jnp.exp(s - jnp.moveaxis(lse_BtKG, 1, -1)[..., None])
          if masked:
            p = jnp.where(_mask(q_idx_Bt, q_seg_Bt, k_idx_Bt, k_seg_Bt), p, 0.0)
          dv_new = dv_BtKD + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do_BtKGD.dtype),
                                        do_BtKGD, preferred_element_type=_F32)
          dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_BtKGD, v_BtKD, preferred_element_type=_F32)
          ds = p * (dp - jnp.moveaxis(delta_BtKG, 1, -1)[..., None]) * scale
          ds = ds.astype(q_BtKGD.dtype)
          dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_BtKD, preferred_element_type=_F32)
          dk_new = dk_BtKD + jnp.einsum("bhgqk,bqhgd->bkhd", ds, q_BtKGD,
                                        preferred_element_type=_F32)
          return (dk_new, dv_new), dq
        return fn

      return lax.switch(tile_class, [skip, update(False), update(True)], dkv)

    init = (jnp.zeros(k_BtKD.shape, _F32), jnp.zeros(v_BtKD.shape, _F32))
    (dk, dv), dq_contrib = lax.scan(q_tile_body, init, q_xs)
    return dq_tiles + dq_contrib, (dk, dv)

  k_xs = (_tiled(k_BTKD, tile), _tiled(v_BTKD, tile), _tiled(k_index_BT, tile),
          _tiled(k_seg_BT, tile), *k_sum)
  dq_init = jnp.zeros(q_xs[0].shape, _F32)
  dq_tiles, (dk_tiles, dv_tiles) = lax.scan(k_tile_body, dq_init, k_xs)
  return (_untiled(dq_tiles).reshape(q_BTHD.shape), _untiled(dk_tiles), _untiled(dv_tiles))
