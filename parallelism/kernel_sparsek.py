"""SparseK's block kernel (issue #38, model/sparsek.py): a soft mask decided at run time,
tiles skipped by the thresholds.

The `xla` kernel hands a block pair here when it has SparseK's float codes
(`parallelism.kernels`): per query head a threshold tau_i (with the queries), per kv head a
score u_j (travelling with K/V). Query head h weighs key j by

    m_ij = 1 if i - j < window, else clip(u_j - tau_i, 0, 1)

where j is causal by ORIGINAL token index and in the same document, else 0; the weights are
m_ij exp(q_i.k_j) (log m added to the logits), so a key with m = 0 is not seen at all.

- Rows: each (batch row, head) is one row, in the block's order (no sort: one "bucket").
- SKIP a tile pair when `max(u of the key tile) <= min(tau of the query tile)` and no pair
  of it is within the window (`min(q_index) - max(k_index) >= window`), or by the causal and
  segment ranges as hash attention; walk the met tiles from static-capacity lists
  (`tile_lists`), so a skipped tile costs nothing.
- Backward: besides dq, dk, dv, the gradient of the logits' log m: on the support
  (0 < u_j - tau_i < 1, outside the window) d logit / d u_j = 1 / m_ij = -d logit / d tau_i,
  so du_j = sum_i p0_ij (dp_ij - delta_i) and dtau_i = -sum_j of the same, p0 the
  probability without the mask (no division by m). Where m is 0 or 1 the gradient is 0.

Memory: the tile lists ([B*Hq, nq, nk] int32 each way) and the operands as rows; nothing is
kept for the backward beyond the contract's. A query that sees nothing gives 0, lse -inf.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallelism.kernel_grads import Grads
from parallelism.row_tiles import put as _put, rows as _rows, tile as _tile, unrows as _unrows
from parallelism.masks import Mask, MaskSpec, Side, sparsek_weight, visible
from parallelism.tile_math import fwd_result

_F32 = jnp.float32


def _ranges(x_RT, tile: int):
  """(min, max) of each tile of each row."""
  chunks = x_RT.reshape(x_RT.shape[0], -1, tile)
  return chunks.min(axis=-1), chunks.max(axis=-1)


def tile_lists(meet_RON):
  """Per row and outer tile, the met inner tiles in ascending order, padded to a static
  capacity (at least 2: with 1, XLA would hoist a loop body that reads a constant index;
  see `parallelism.schedule`), and their count."""
  capacity = max(meet_RON.shape[-1], 2)
  padded = jnp.pad(meet_RON, [(0, 0), (0, 0), (0, capacity - meet_RON.shape[-1])])
  return (jnp.argsort(~padded, axis=-1, stable=True).astype(jnp.int32),
          meet_RON.sum(axis=-1, dtype=jnp.int32))


class _Setup(NamedTuple):
  tau_RT: jax.Array  # per query row
  u_RT: jax.Array  # per key row
  q_seg_RT: jax.Array | None
  k_seg_RT: jax.Array | None
  group: int
  meet: jax.Array  # [Rk, G, nq, nk]


def _setup(q_tau_BTH, k_score_BTK, q_seg_BT, k_seg_BT, q_index_T, k_index_T, tile: int,
           window: int) -> _Setup:
  for name, length in (("query", q_tau_BTH.shape[1]), ("key", k_score_BTK.shape[1])):
    if length % tile:
      raise ValueError(f"{name} block length {length} is not divisible by tile size {tile}")
  heads, num_kv = q_tau_BTH.shape[2], k_score_BTK.shape[2]
  group = heads // num_kv
  tau_RT, u_RT = _rows(q_tau_BTH.astype(_F32)), _rows(k_score_BTK.astype(_F32))
  seg = lambda s, h: None if s is None else jnp.repeat(s, h, axis=0)
  q_seg_RT, k_seg_RT = seg(q_seg_BT, heads), seg(k_seg_BT, num_kv)
  q_shape, k_shape = (u_RT.shape[0], group, -1, 1), (u_RT.shape[0], 1, 1, -1)
  qi_lo, qi_hi = _ranges(q_index_T[None].astype(jnp.int32), tile)
  ki_lo, ki_hi = _ranges(k_index_T[None].astype(jnp.int32), tile)
  qi_lo, qi_hi, ki_lo, ki_hi = (x[0] for x in (qi_lo, qi_hi, ki_lo, ki_hi))
  tau_lo = _ranges(tau_RT, tile)[0].reshape(q_shape)
  u_hi = _ranges(u_RT, tile)[1].reshape(k_shape)
  near = (qi_lo[:, None] - ki_hi[None, :]) < window
  meet = (ki_lo[None, :] <= qi_hi[:, None]) & (near | (u_hi > tau_lo))
  if q_seg_RT is not None:
    qs_lo, qs_hi = (r.reshape(q_shape) for r in _ranges(q_seg_RT, tile))
    ks_lo, ks_hi = (r.reshape(k_shape) for r in _ranges(k_seg_RT, tile))
    meet &= (qs_lo <= ks_hi) & (ks_lo <= qs_hi)
  return _Setup(tau_RT, u_RT, q_seg_RT, k_seg_RT, group, meet)


def _weights(spec: MaskSpec, at: _Setup, q_index_T, k_index_T, q_row, i, k_row, j, tile: int):
  """([tq, tk] mask weights m, [tq, tk] whether on SparseK's support) of one tile pair: 0
  where the rule (`parallelism.masks.visible`) hides the key."""
  q_at = lambda x, row: None if x is None else _tile(x, row, i, tile)[:, None]
  k_at = lambda x, row: None if x is None else _tile(x, row, j, tile)[None, :]
  behind = (lax.dynamic_slice_in_dim(q_index_T, i * tile, tile)[:, None]
            - lax.dynamic_slice_in_dim(k_index_T, j * tile, tile)[None, :])
  tile_mask = Mask(spec, Side(q_at(at.q_seg_RT, q_row), scores=q_at(at.tau_RT, q_row)),
                   Side(k_at(at.k_seg_RT, k_row), scores=k_at(at.u_RT, k_row)))
  weight, support = sparsek_weight(tile_mask, behind)
  seen = visible(tile_mask, behind)
  return jnp.where(seen, weight, 0.0), seen & support


def computed_tiles(q_tau_BTH, k_score_BTK, q_seg_BT, k_seg_BT, q_index_T, k_index_T, *,
                   tile: int, window: int) -> jax.Array:
  """How many (query head, query tile, key tile) pairs the kernel computes on this block."""
  return _setup(q_tau_BTH, k_score_BTK, q_seg_BT, k_seg_BT, q_index_T, k_index_T, tile,
                window).meet.sum(dtype=jnp.int32)


def _setup_of(mask: Mask, q_index_T, k_index_T, tile: int) -> _Setup:
  return _setup(mask.q.scores, mask.k.scores, mask.q.segment_ids, mask.k.segment_ids,
                q_index_T, k_index_T, tile, mask.spec.sparsek_window)


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, q_index_T, k_index_T,
              tile: int) -> tuple[jax.Array, jax.Array]:
  """(out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32) of the block pair, walking the met tiles."""
  at = _setup_of(mask, q_index_T, k_index_T, tile)
  q_RTD, k_RTD, v_RTD = _rows(q_BTHD), _rows(k_BTKD), _rows(v_BTKD)
  nq = q_RTD.shape[1] // tile
  lists, counts = tile_lists(at.meet.reshape(q_RTD.shape[0], nq, -1))
  scale = q_BTHD.shape[3] ** -0.5

  def body(u, results):
    q_row, i = u // nq, u % nq
    k_row = q_row // at.group
    q_tD = _tile(q_RTD, q_row, i, tile)

    def visit(n, carry):
      m_t, l_t, acc_tD = carry
      j = lists[q_row, i, n]
      k_tD, v_tD = (_tile(x, k_row, j, tile) for x in (k_RTD, v_RTD))
      weight, _ = _weights(mask.spec, at, q_index_T, k_index_T, q_row, i, k_row, j, tile)
      s = jnp.einsum("qd,kd->qk", q_tD, k_tD, preferred_element_type=_F32) * scale
      s = jnp.where(weight > 0, s, -jnp.inf)
      m_new = jnp.maximum(m_t, s.max(axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing seen yet: 0, not NaN
      p = jnp.exp(s - m_safe[:, None]) * weight
      alpha = jnp.exp(m_t - m_safe)
      pv = jnp.einsum("qk,kd->qd", p.astype(v_tD.dtype), v_tD, preferred_element_type=_F32)
      return m_new, alpha * l_t + p.sum(-1), alpha[:, None] * acc_tD + pv

    init = (jnp.full((tile,), -jnp.inf, _F32), jnp.zeros((tile,), _F32),
            jnp.zeros((tile, q_tD.shape[-1]), _F32))
    out_tD, lse_t = fwd_result(*lax.fori_loop(0, counts[q_row, i], visit, init),
                               spec=mask.spec, scale=1.0)
    out_RTD, lse_RT = results
    return _put(out_RTD, q_row, i, out_tD), _put(lse_RT, q_row, i, lse_t)

  results = (jnp.zeros(q_RTD.shape, _F32), jnp.zeros(q_RTD.shape[:2], _F32))
  out_RTD, lse_RT = lax.fori_loop(0, q_RTD.shape[0] * nq, body, results)
  batch = q_BTHD.shape[0]
  return _unrows(out_RTD, batch), _unrows(lse_RT, batch)


def block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, mask: Mask, *, q_index_T,
              k_index_T, tile: int) -> Grads:
  """Float32 gradients of the block pair, with the thresholds' (dtau [B,Tq,Hq]) and scores'
  (du [B,Tk,Hkv]), from the GLOBAL lse and delta (the contract), per key tile over the query
  tiles that meet it."""
  at = _setup_of(mask, q_index_T, k_index_T, tile)
  # lse -inf (a query that sees nothing) -> +inf so exp(s - lse) is 0 rather than NaN.
  lse_safe = jnp.where(jnp.isfinite(lse_BTH), lse_BTH, jnp.inf).astype(_F32)
  q_RTD, do_RTD = _rows(q_BTHD), _rows(dout_BTHD)
  lse_RT, delta_RT = _rows(lse_safe), _rows(delta_BTH.astype(_F32))
  k_RTD, v_RTD = _rows(k_BTKD), _rows(v_BTKD)
  nq, nk = q_RTD.shape[1] // tile, k_RTD.shape[1] // tile
  meet_RKGQ = jnp.moveaxis(at.meet, 3, 1)  # [Rk, nk, G, nq]
  lists, counts = tile_lists(meet_RKGQ.reshape(*meet_RKGQ.shape[:2], -1))
  scale = q_BTHD.shape[3] ** -0.5

  def body(u, grads):
    k_row, j = u // nk, u % nk
    k_tD, v_tD = (_tile(x, k_row, j, tile) for x in (k_RTD, v_RTD))

    def visit(n, carry):
      dk_tD, dv_tD, du_t, dq_RTD, dtau_RT = carry
      g, i = lists[k_row, j, n] // nq, lists[k_row, j, n] % nq
      q_row = k_row * at.group + g
      q_tD, do_tD, lse_t, delta_t = (_tile(x, q_row, i, tile)
                                     for x in (q_RTD, do_RTD, lse_RT, delta_RT))
      weight, support = _weights(mask.spec, at, q_index_T, k_index_T, q_row, i, k_row, j,
                                 tile)
      s = jnp.einsum("qd,kd->qk", q_tD, k_tD, preferred_element_type=_F32) * scale
      p0 = jnp.where(weight > 0, jnp.exp(s - lse_t[:, None]), 0.0)  # without the mask
      p = p0 * weight
      dp = jnp.einsum("qd,kd->qk", do_tD, v_tD, preferred_element_type=_F32)
      centred = dp - delta_t[:, None]
      ds = (p * centred).astype(q_tD.dtype)
      dlog_m = jnp.where(support, p0 * centred, 0.0)  # d loss / d log m_ij
      dv_tD += jnp.einsum("qk,qd->kd", p.astype(do_tD.dtype), do_tD, preferred_element_type=_F32)
      dk_tD += jnp.einsum("qk,qd->kd", ds, q_tD, preferred_element_type=_F32) * scale
      dq_tD = jnp.einsum("qk,kd->qd", ds, k_tD, preferred_element_type=_F32) * scale
      dq_RTD = _put(dq_RTD, q_row, i, _tile(dq_RTD, q_row, i, tile) + dq_tD)
      dtau_RT = _put(dtau_RT, q_row, i, _tile(dtau_RT, q_row, i, tile) - dlog_m.sum(-1))
      return dk_tD, dv_tD, du_t + dlog_m.sum(0), dq_RTD, dtau_RT

    dq_RTD, dtau_RT, dk_RTD, dv_RTD, du_RT = grads
    init = (jnp.zeros(k_tD.shape, _F32), jnp.zeros(v_tD.shape, _F32), jnp.zeros((tile,), _F32),
            dq_RTD, dtau_RT)
    dk_tD, dv_tD, du_t, dq_RTD, dtau_RT = lax.fori_loop(0, counts[k_row, j], visit, init)
    return (dq_RTD, dtau_RT, _put(dk_RTD, k_row, j, dk_tD), _put(dv_RTD, k_row, j, dv_tD),
            _put(du_RT, k_row, j, du_t))

  grads = (jnp.zeros(q_RTD.shape, _F32), jnp.zeros(q_RTD.shape[:2], _F32),
           jnp.zeros(k_RTD.shape, _F32), jnp.zeros(v_RTD.shape, _F32),
           jnp.zeros(k_RTD.shape[:2], _F32))
  dq_RTD, dtau_RT, dk_RTD, dv_RTD, du_RT = lax.fori_loop(0, k_RTD.shape[0] * nk, body, grads)
  batch = q_BTHD.shape[0]
  return Grads(_unrows(dq_RTD, batch), _unrows(dk_RTD, batch), _unrows(dv_RTD, batch),
               _unrows(dtau_RT, batch), _unrows(du_RT, batch))
