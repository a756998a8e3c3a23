"""SparseK's block kernel (issue #38, model/sparsek.py): a soft mask decided at run time, its
selected keys a prefix of the keys sorted by score.

The `xla` kernel hands a block pair here when its mask selects (`MaskSpec.selects`): per
query head a threshold tau_i, per kv head a score u_j (travelling with K/V). A key the rule
lets a query see (`parallelism.masks.visible`) weighs m_ij = 1 if i - j < window, else
clip(u_j - tau_i, 0, 1) (`masks.sparsek_weight`; log m added to the logit). Two passes
share one online softmax per query tile:
- the window: the key tiles, in the block's order, within `window` of the query tile's
  positions (from the pair's token indices), each key of weight 1;
- the selection: the keys sorted per kv head by score, highest first, so a query's keys
  above its threshold are a prefix of them and a query tile walks only its lowest
  threshold's prefix. With scores independent of position, query i's prefix holds about
  S k / i of the block's S keys: about k S (1 + ln(S / k)) pairs, not S^2 / 2; a query tile
  whose prefix is longer walks its causal tiles instead (`_Walks`).

Backward: dq and dtau per query tile over the same tiles; dK, dV and du per key tile over
the query tiles that reach it, in each order (the ranked keys' unsorted after). On the
support (0 < u_j - tau_i < 1, outside the window) d logit / d u_j = 1 / m_ij = -d logit /
d tau_i, so du_j = sum_i p0_ij (dp_ij - delta_i) and dtau_i = -sum_j of the same, p0 the
probability without the mask. A query that sees nothing gives 0, lse -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallelism.kernel_grads import Grads, Merged
from parallelism.masks import Mask, Side, sparsek_weight, visible
from parallelism.row_tiles import rows, tile as tile_of, unrows, walk
from parallelism.tile_math import fwd_result
from parallelism.tiles import tile_ranges

_F32 = jnp.float32


def tile_lists(meet_ON):
  """Per outer tile (leading axes), the met inner tiles in ascending order, padded to a
  static capacity (at least 2: with 1, XLA would hoist a loop body that reads a constant
  index; see `parallelism.schedule`), and their count."""
  capacity = max(meet_ON.shape[-1], 2)
  pad = [(0, 0)] * (meet_ON.ndim - 1) + [(0, capacity - meet_ON.shape[-1])]
  padded = jnp.pad(meet_ON, pad)
  return (jnp.argsort(~padded, axis=-1, stable=True).astype(jnp.int32),
          meet_ON.sum(axis=-1, dtype=jnp.int32))


class _Keys(NamedTuple):
  """One kv head's keys per row ([Rk, T, ...]) in some order, with what the rule reads."""
  k: jax.Array
  v: jax.Array
  u: jax.Array  # scores
  index: jax.Array  # original positions
  seg: jax.Array | None


# The parts of a query's keys a walk computes (`_pair`): those within the window, those
# beyond it, or all.
NEAR, FAR, ALL = 0, 1, 2


class _Setup(NamedTuple):
  """A block pair as rows: the queries, their keys in the block's order and sorted by score,
  and which tiles each query tile walks."""
  q: jax.Array  # [Rq, T, D]
  tau: jax.Array  # [Rq, T]
  q_seg: jax.Array | None
  q_index: jax.Array  # [T]
  block: _Keys  # the block's order
  ranked: _Keys  # sorted by score, highest first, per row
  walks: "_Walks"
  heads: int
  num_kv: int


class _Walks(NamedTuple):
  """Per query tile either the window's key tiles (in the block's order) and its prefix of
  ranked tiles, or, where that prefix is longer than the causal tiles, the causal tiles in
  the block's order, every key by the whole rule (early queries, whose thresholds are low)."""
  near_QK: jax.Array  # [nq, nk] bool: the window's key tiles, the same for every row
  causal_QK: jax.Array  # [nq, nk] bool: the key tiles not after the query tile
  near: tuple  # (lists [nq, nk], counts [nq]) of near_QK
  causal: tuple  # and of causal_QK
  prefix: jax.Array  # [Rq, nq]: the ranked tiles its lowest threshold's prefix reaches
  ranked: jax.Array  # [Rq, nq] bool: whether it walks the window and its prefix
  order: jax.Array  # [Rk, T]: each ranked key's place in the block

  def counts(self):
    """(window tiles, causal tiles, ranked tiles) [Rq, nq] each query tile walks."""
    near = jnp.where(self.ranked, self.near[1][None, :], 0)
    causal = jnp.where(self.ranked, 0, self.causal[1][None, :])
    return near, causal, jnp.where(self.ranked, self.prefix, 0)

  def lengths(self):
    """[Rq * nq]: the tiles each query tile walks."""
    return sum(self.counts()).reshape(-1)


def _k_row(at: _Setup, row):
  return (row // at.heads) * at.num_kv + (row % at.heads) // (at.heads // at.num_kv)


def _walks(mask: Mask, q_index_T, k_index_T, tile: int) -> _Walks:
  """What each query tile walks (`_Walks`), from the blocks' positions and the mask's
  thresholds and scores."""
  for name, length in (("query", mask.q.scores.shape[1]), ("key", mask.k.scores.shape[1])):
    if length % tile:
      raise ValueError(f"{name} block length {length} is not divisible by tile size {tile}")
  heads, num_kv = mask.q.scores.shape[2], mask.k.scores.shape[2]
  qi_lo, qi_hi = tile_ranges(q_index_T, tile)
  ki_lo, ki_hi = tile_ranges(k_index_T, tile)
  causal_QK = ki_lo[None, :] <= qi_hi[:, None]
  near_QK = causal_QK & (qi_lo[:, None] - ki_hi[None, :] < mask.spec.sparsek_window)
  u_RT, tau_RT = (rows(x.astype(_F32)) for x in (mask.k.scores, mask.q.scores))
  order = jnp.argsort(-u_RT, axis=1, stable=True).astype(jnp.int32)
  lowest_Rn = tau_RT.reshape(tau_RT.shape[0], -1, tile).min(axis=-1)
  q_rows = jnp.arange(tau_RT.shape[0])
  k_of_q = (q_rows // heads) * num_kv + (q_rows % heads) // (heads // num_kv)
  ranked_u = jnp.take_along_axis(u_RT, order, axis=1)[k_of_q]
  above_Rn = jax.vmap(lambda u_T, t_n: jnp.searchsorted(-u_T, -t_n, side="left"))(
      ranked_u, lowest_Rn)
  prefix_Rn = (above_Rn + tile - 1) // tile
  near, causal = tile_lists(near_QK), tile_lists(causal_QK)
  ranked = near[1][None, :] + prefix_Rn <= causal[1][None, :]
  return _Walks(near_QK, causal_QK, near, causal, prefix_Rn, ranked, order)


def _setup(q_BTHD, k_BTKD, v_BTKD, mask: Mask, q_index_T, k_index_T, tile: int) -> _Setup:
  q_index_T, k_index_T = (x.astype(jnp.int32) for x in (q_index_T, k_index_T))
  walks = _walks(mask, q_index_T, k_index_T, tile)
  heads, num_kv = q_BTHD.shape[2], k_BTKD.shape[2]
  seg = lambda s, h: None if s is None else jnp.repeat(s, h, axis=0)
  u_RT = rows(mask.k.scores.astype(_F32))
  block = _Keys(rows(k_BTKD), rows(v_BTKD), u_RT,
                jnp.broadcast_to(k_index_T, u_RT.shape), seg(mask.k.segment_ids, num_kv))
  order = walks.order
  take = lambda x: None if x is None else jnp.take_along_axis(
      x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
  return _Setup(rows(q_BTHD), rows(mask.q.scores.astype(_F32)),
                seg(mask.q.segment_ids, heads), q_index_T, block,
                _Keys(*(take(x) for x in block)), walks, heads, num_kv)


def _pair(mask: Mask, at: _Setup, keys: _Keys, row, i, j, tile: int, part: int):
  """([tq, tk] weights m, [tq, tk] whether on SparseK's support) of query tile i of `row`
  on key tile j of `keys`: 0 where the rule hides the key or it is not of `part` (NEAR,
  FAR or ALL; may be traced)."""
  k_row = _k_row(at, row)
  q_at = lambda x: None if x is None else tile_of(x, row, i, tile)[:, None]
  k_at = lambda x: None if x is None else tile_of(x, k_row, j, tile)[None, :]
  behind = (lax.dynamic_slice_in_dim(at.q_index, i * tile, tile)[:, None]
            - k_at(keys.index))
  tile_mask = Mask(mask.spec, Side(q_at(at.q_seg), scores=q_at(at.tau)),
                   Side(k_at(keys.seg), scores=k_at(keys.u)))
  weight, support = sparsek_weight(tile_mask, behind)
  near = behind < mask.spec.sparsek_window
  seen = visible(tile_mask, behind) & jnp.where(part == ALL, True, near == (part == NEAR))
  return jnp.where(seen, weight, 0.0), seen & support


def _over_query_tile(at: _Setup, row, i, visit, carry):
  """`visit(keys, j, part, carry)` over the key tiles query tile i of `row` walks: the
  window's, then its prefix of ranked tiles; or the causal ones (`_Walks`)."""
  near, causal, prefix = (x[row, i] for x in at.walks.counts())
  for (lists, _), count, part in ((at.walks.near, near, NEAR),
                                  (at.walks.causal, causal, ALL)):
    carry = lax.fori_loop(0, count, lambda n, c, lists=lists, part=part: visit(
        at.block, lists[i, n], part, c), carry)
  return lax.fori_loop(0, prefix, lambda j, c: visit(at.ranked, j, FAR, c), carry)


def computed_tiles(mask: Mask, q_index_T, k_index_T, tile: int) -> jax.Array:
  """How many (query head, query tile, key tile) pairs the kernel computes on this block
  pair (every walk)."""
  return _walks(mask, q_index_T.astype(jnp.int32), k_index_T.astype(jnp.int32),
                tile).lengths().sum(dtype=jnp.int32)


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, q_index_T, k_index_T,
              tile: int) -> tuple[jax.Array, jax.Array]:
  """(out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32) of the block pair, over the key tiles each
  query tile walks (`_Walks`)."""
  at = _setup(q_BTHD, k_BTKD, v_BTKD, mask, q_index_T, k_index_T, tile)
  nq = at.q.shape[1] // tile
  scale = q_BTHD.shape[3] ** -0.5

  def one_query_tile(u):
    row, i = u // nq, u % nq
    k_row = _k_row(at, row)
    q_tD = tile_of(at.q, row, i, tile)

    def visit(keys, j, part, carry):
      m_t, l_t, acc_tD = carry
      k_tD, v_tD = (tile_of(x, k_row, j, tile) for x in (keys.k, keys.v))
      weight, _ = _pair(mask, at, keys, row, i, j, tile, part)
      s = jnp.einsum("qd,kd->qk", q_tD, k_tD, preferred_element_type=_F32) * scale
      s = jnp.where(weight > 0, s, -jnp.inf)
      m_new = jnp.maximum(m_t, s.max(axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing seen yet: 0, not NaN
      p = jnp.exp(s - m_safe[:, None]) * weight
      alpha = jnp.exp(m_t - m_safe)
      pv = jnp.einsum("qk,kd->qd", p.astype(v_tD.dtype), v_tD, preferred_element_type=_F32)
      return m_new, alpha * l_t + p.sum(-1), alpha[:, None] * acc_tD + pv

    init = (jnp.full((tile,), -jnp.inf, _F32), jnp.zeros((tile,), _F32),
            jnp.zeros(q_tD.shape, _F32))
    return fwd_result(*_over_query_tile(at, row, i, visit, init), spec=mask.spec, scale=1.0)

  out_UtD, lse_Ut = walk(one_query_tile, at.walks.lengths(), tile)
  batch = q_BTHD.shape[0]
  return (unrows(out_UtD.reshape(at.q.shape), batch),
          unrows(lse_Ut.reshape(at.q.shape[:2]), batch))


def _scores(q_side, keys: _Keys, k_row, j, tile: int, scale: float, weight):
  """(p, p0, centred) of a tile pair from the GLOBAL lse and delta (`q_side`: the query
  tile's q, dout, lse, delta), p0 the probabilities without the mask's weights."""
  q_tD, do_tD, lse_t, delta_t = q_side
  k_tD, v_tD = (tile_of(x, k_row, j, tile) for x in (keys.k, keys.v))
  s = jnp.einsum("qd,kd->qk", q_tD, k_tD, preferred_element_type=_F32) * scale
  p0 = jnp.where(weight > 0, jnp.exp(s - lse_t[:, None]), 0.0)
  dp = jnp.einsum("qd,kd->qk", do_tD, v_tD, preferred_element_type=_F32)
  return p0 * weight, p0, dp - delta_t[:, None]


def block_bwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, q_index_T,
              k_index_T, tile: int) -> Grads:
  """Float32 gradients of the block pair, with the thresholds' (dtau [B,Tq,Hq]) and scores'
  (du [B,Tk,Hkv]), from the GLOBAL lse and delta (the contract): dq and dtau per query tile,
  dK, dV and du per key tile of each pass."""
  at = _setup(q_BTHD, k_BTKD, v_BTKD, mask, q_index_T, k_index_T, tile)
  q_rows = (at.q, rows(merged.dout), rows(merged.safe_lse()), rows(merged.delta.astype(_F32)))
  nq, nk = at.q.shape[1] // tile, at.block.k.shape[1] // tile
  group = at.heads // at.num_kv
  scale, head_dim = q_BTHD.shape[3] ** -0.5, q_BTHD.shape[3]
  q_tile = lambda row, i: tuple(tile_of(x, row, i, tile) for x in q_rows)

  def one_query_tile(u):  # dq and dtau, over the forward's tiles
    row, i = u // nq, u % nq
    q_side = q_tile(row, i)

    def visit(keys, j, part, carry):
      dq_tD, dtau_t = carry
      weight, support = _pair(mask, at, keys, row, i, j, tile, part)
      p, p0, centred = _scores(q_side, keys, _k_row(at, row), j, tile, scale, weight)
      k_tD = tile_of(keys.k, _k_row(at, row), j, tile)
      dq_tD += jnp.einsum("qk,kd->qd", (p * centred).astype(k_tD.dtype), k_tD,
                          preferred_element_type=_F32) * scale
      return dq_tD, dtau_t - jnp.where(support, p0 * centred, 0.0).sum(-1)

    init = (jnp.zeros((tile, head_dim), _F32), jnp.zeros((tile,), _F32))
    return _over_query_tile(at, row, i, visit, init)

  def key_tiles(keys: _Keys, ranked: bool):
    """dK, dV and du [Rk, T, ...] of `keys`' order, per key tile over the (query head of
    its group, query tile) pairs that walk it: the ranked tiles of the query tiles' prefixes
    (FAR), or the block's tiles of the windows (NEAR) and of the causal walks (ALL)."""
    walks, num_q_rows = at.walks, at.q.shape[0]
    by_kv = lambda x_Rn: x_Rn.reshape(num_q_rows // group, group, nq)  # [Rk, G, nq]
    ranked_RGn = by_kv(walks.ranked)
    if ranked:
      meet_RGnK = ranked_RGn[..., None] & (by_kv(walks.prefix)[..., None] > jnp.arange(nk))
    else:
      meet_RGnK = jnp.where(ranked_RGn[..., None], walks.near_QK, walks.causal_QK)
    lists_RKm, counts_RK = tile_lists(jnp.moveaxis(meet_RGnK, 3, 1).reshape(
        meet_RGnK.shape[0], nk, -1))

    def one_key_tile(u):
      k_row, j = u // nk, u % nk
      k_tD = tile_of(keys.k, k_row, j, tile)

      def visit(n, carry):
        dk_tD, dv_tD, du_t = carry
        g, i = divmod(lists_RKm[k_row, j, n], nq)
        row = (k_row // at.num_kv) * at.heads + (k_row % at.num_kv) * group + g
        part = FAR if ranked else jnp.where(walks.ranked[row, i], NEAR, ALL)
        weight, support = _pair(mask, at, keys, row, i, j, tile, part)
        q_side = q_tile(row, i)
        p, p0, centred = _scores(q_side, keys, k_row, j, tile, scale, weight)
        q_tD, do_tD = q_side[:2]
        dv_tD += jnp.einsum("qk,qd->kd", p.astype(do_tD.dtype), do_tD,
                            preferred_element_type=_F32)
        dk_tD += jnp.einsum("qk,qd->kd", (p * centred).astype(q_tD.dtype), q_tD,
                            preferred_element_type=_F32) * scale
        return dk_tD, dv_tD, du_t + jnp.where(support, p0 * centred, 0.0).sum(0)

      zeros = jnp.zeros(k_tD.shape, _F32)
      return lax.fori_loop(0, counts_RK[k_row, j], visit,
                           (zeros, zeros, jnp.zeros((tile,), _F32)))

    grads = walk(one_key_tile, counts_RK.reshape(-1), tile)
    return tuple(x.reshape(keys.k.shape[0], -1, *x.shape[2:]) for x in grads)

  dq_UtD, dtau_Ut = walk(one_query_tile, at.walks.lengths(), tile)
  dk_w, dv_w, du_w = key_tiles(at.block, False)
  dk_r, dv_r, du_r = key_tiles(at.ranked, True)
  home = lambda x_ranked: jax.vmap(lambda x, order: jnp.zeros_like(x).at[order].set(x))(
      x_ranked, at.walks.order)  # the ranked keys' gradients back in the block's order
  batch = q_BTHD.shape[0]
  return Grads(unrows(dq_UtD.reshape(at.q.shape), batch),
               unrows(dk_w + home(dk_r), batch), unrows(dv_w + home(dv_r), batch),
               unrows(dtau_Ut.reshape(at.q.shape[:2]), batch), unrows(du_w + home(du_r), batch))
