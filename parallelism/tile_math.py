"""The arithmetic of one tile pair, shared by the xla kernel's static walk
(`parallelism.kernel_xla`) and hash attention's run-time one (`parallelism.kernel_hash`).

Tiles are head-major: q [B, Hkv, G, t, D], k/v [B, Hkv, t, D] (GQA: q head kv_head * G + g).
Matmuls take the input dtype (bf16 ok) and accumulate in float32; logits are the mask spec's
(`parallelism.masks.logits`: with a soft cap the backward multiplies by the cap's slope). A visibility mask broadcasts against the scores
([.., G, tq, tk] forward, key-major [.., tk, G, tq] backward); None means all visible.
"""

from __future__ import annotations

import jax.numpy as jnp

from parallelism.masks import MaskSpec, logits

_F32 = jnp.float32


def fwd_update(carry, q_BKGtD, k_BKtD, v_BKtD, visible, *, spec: MaskSpec, scale: float):
  """One online-softmax step of a query tile on a key tile; carry is (m, l, acc).

  m is the running max of the UNSCALED scores; the scale goes into the exponent, which
  saves a pass over the scores (scale > 0, so the max commutes with it). With a soft cap
  the scores are the capped logits themselves, already scaled (`max_scale`).
  """
  m_BKGt, l_BKGt, acc_BKGtD = carry
  s = jnp.einsum("bhgqd,bhkd->bhgqk", q_BKGtD, k_BKtD, preferred_element_type=_F32)
  if spec.softcap:
    s = logits(spec, s, scale)[0]
  scale = max_scale(scale, spec.softcap)
  if visible is not None:  # [B or 1, Hkv or 1, G or 1, tq, tk]
    s = jnp.where(visible, s, -jnp.inf)
  m_new = jnp.maximum(m_BKGt, s.max(axis=-1))
  # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  p = jnp.exp((s - m_safe[..., None]) * scale)
  alpha = jnp.exp((m_BKGt - m_safe) * scale)
  l_new = alpha * l_BKGt + p.sum(axis=-1)
  pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v_BKtD.dtype), v_BKtD,
                  preferred_element_type=_F32)
  return m_new, l_new, alpha[..., None] * acc_BKGtD + pv


def max_scale(scale: float, softcap: float) -> float:
  """What turns the forward's running max into logits: the scale, or 1 when capped."""
  return 1.0 if softcap else scale


def fwd_result(m_BKGt, l_BKGt, acc_BKGtD, *, spec: MaskSpec, scale: float):
  """(out, lse) of a query tile from its online-softmax carry: a row that saw no key gives
  out 0 and lse -inf, never NaN."""
  seen = l_BKGt > 0
  log_l = jnp.log(jnp.where(seen, l_BKGt, 1.0))
  lse_BKGt = jnp.where(seen, m_BKGt * max_scale(scale, spec.softcap) + log_l, -jnp.inf)
  return acc_BKGtD / jnp.where(seen, l_BKGt, 1.0)[..., None], lse_BKGt


def bwd_update(carry, q_xs, k_xs, visible_T, *, spec: MaskSpec, scale: float):
  """Gradients of one query tile x key tile; carry is (dk, dv) of the key tile and dq of
  the query tile, transposed ([B, Hkv, D, G, tq]), all float32.

  Works in key-major scores [B, Kv, tk, G, tq], so dv, dp and dk are plain matmuls, and dq
  is computed transposed, dq^T = k^T ds^T, from the key tile transposed once per key tile
  (`k_xs[2]`). XLA's CPU matmuls want [m, k] x [k, n] operands: dq = ds k would transpose
  the score-sized ds for every tile pair, which cost a third of the backward. The
  query-side tiles (q, dout, lse, delta, dq) are transposed per pair instead, which is
  t / D times less data than a score tile.
  """
  dk_BKtD, dv_BKtD, dq_BKDGt = carry
  q_BKGtD, do_BKGtD, lse_BKGt, delta_BKGt = q_xs
  k_BKtD, v_BKtD, k_BKDt = k_xs
  s_T = jnp.einsum("bhkd,bhgqd->bhkgq", k_BKtD, q_BKGtD, preferred_element_type=_F32)
  logits_T, slope = logits(spec, s_T, scale)  # and d logits / d s
  p_T = jnp.exp(logits_T - lse_BKGt[:, :, None])
  if visible_T is not None:  # [B or 1, Hkv or 1, tk, G or 1, tq]
    p_T = jnp.where(visible_T, p_T, 0.0)
  dv_BKtD = dv_BKtD + jnp.einsum("bhkgq,bhgqd->bhkd", p_T.astype(do_BKGtD.dtype), do_BKGtD,
                                 preferred_element_type=_F32)
  dp_T = jnp.einsum("bhkd,bhgqd->bhkgq", v_BKtD, do_BKGtD, preferred_element_type=_F32)
  ds_T = (p_T * (dp_T - delta_BKGt[:, :, None]) * slope).astype(q_BKGtD.dtype)
  dk_BKtD = dk_BKtD + jnp.einsum("bhkgq,bhgqd->bhkd", ds_T, q_BKGtD,
                                 preferred_element_type=_F32)
  dq_BKDGt = dq_BKDGt + jnp.einsum("bhdk,bhkgq->bhdgq", k_BKDt, ds_T,
                                   preferred_element_type=_F32)
  return dk_BKtD, dv_BKtD, dq_BKDGt
