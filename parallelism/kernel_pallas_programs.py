"""What each program of the `pallas` block kernel computes (`parallelism.kernel_pallas`
builds the grids, specs and tables and launches them).

Each program reads its tile's row of the block pair's tile lists and runs the UNMASKED runs
as plain loops (no branch, no mask, so Triton pipelines them; a branch in every iteration
measured slower on an H100), then the MASKED tiles with their precomputed mask. Softmax runs
in base 2 (exp2 with log2(e) folded into the scale); lse is converted back. With a soft cap
the logits are capped (`parallelism.masks.logits`) before the base change, and the backward
multiplies by the cap's slope. With per-head spans a MASKED tile applies the rule
(`parallelism.masks.visible`) to its distances for the program's query head's span, the
distances from the pair's token indices, which come in as two more operands beside the spans.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from parallelism.masks import Mask, MaskSpec, Side, logits, visible
from parallelism.schedule import TileLists, over_tiles

_F32 = jnp.float32
_LOG2E = math.log2(math.e)


# HIGHEST keeps float32 operands in IEEE float32 on the GPU (Triton would use tf32);
# bf16 operands are unaffected.
_PRECISION = lax.Precision.HIGHEST


def _dot(a, b, contract_b: int):
  """a @ b (contract_b=0) or a @ b.T (contract_b=1), float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=_PRECISION,
                         preferred_element_type=_F32)


def _dot_tn(a, b):
  """a.T @ b, float32 accumulation."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_PRECISION,
                         preferred_element_type=_F32)


def _rows(x_t):
  """A tile's query-side operand as rows of its [tq, tk] scores."""
  return None if x_t is None else x_t[:, None]


def _cols(x_t):
  """A tile's key-side operand as columns of its [tq, tk] scores."""
  return None if x_t is None else x_t[None, :]


def _visible(pair_mask: Mask, masks_ref, mask_id, behind=None):
  """Visibility [tq, tk] of a tile pair, or None when every query sees every key: the rule
  (`parallelism.masks.visible`) on its run-time operands and, on a MASKED tile (`mask_id`),
  its precomputed mask, or with per-head spans the rule on the tile's distances
  (`behind()`)."""
  if mask_id is not None and behind is not None:
    return visible(pair_mask, behind())
  seen = visible(pair_mask)
  if mask_id is None:
    return seen
  mask = masks_ref[mask_id] != 0
  return mask if seen is None else mask & seen


def _behind(q_index_t, k_index_t):
  """A tile pair's distances `q - k`, from the pair's token indices (per-head spans)."""
  return lambda: q_index_t[:, None] - k_index_t[None, :]


def _split_refs(refs, spec: MaskSpec, has_seg: bool, num_out: int):
  """(segment refs or (None, None), tile lists, masks ref, span refs (query indices, key
  indices, spans) or None, output refs) of a kernel."""
  seg_refs, refs = (refs[:2], refs[2:]) if has_seg else ((None, None), refs)
  span_refs, rest = (refs[6:9], refs[9:]) if spec.head_spans else (None, refs[6:])
  return seg_refs, TileLists(*refs[:5]), refs[5], span_refs, rest[:num_out]


def _logits(spec: MaskSpec, q_tD, k_kD, scale: float):
  """(logits, their derivative by q.k) of a tile pair (`parallelism.masks.logits`)."""
  return logits(spec, _dot(q_tD, k_kD, 1), scale)


def fwd_program(q_ref, k_ref, v_ref, *refs, spec: MaskSpec, scale: float, block_k: int,
                has_seg: bool):
  (q_seg_ref, k_seg_ref), lists, masks_ref, span_refs, (o_ref, lse_ref) = _split_refs(
      refs, spec, has_seg, 2)
  row = query_tile(pl.program_id(0), pl.num_programs(0))
  q_tD = q_ref[...]
  q_seg_t = q_seg_ref[...] if has_seg else None
  # Read outside the tile loops: interpret mode cannot lower a program id inside them.
  span = span_refs[2][pl.program_id(2)] if spec.head_spans else None

  def visit(j, carry, mask_id):
    keys = pl.ds(j * block_k, block_k)
    m_t, l_t, acc_tD = carry
    k_kD, v_kD = k_ref[keys, :], v_ref[keys, :]
    if spec.softcap:
      s_tk = _logits(spec, q_tD, k_kD, scale)[0] * _LOG2E
    else:  # base-2 logits in one multiply: exp2(s * log2 e) == exp(s)
      s_tk = _dot(q_tD, k_kD, 1) * (scale * _LOG2E)
    behind = _behind(span_refs[0][...], span_refs[1][keys]) if spec.head_spans else None
    pair_mask = Mask(spec, Side(_rows(q_seg_t), spans=span),
                     Side(_cols(k_seg_ref[keys] if has_seg else None)))
    mask = _visible(pair_mask, masks_ref, mask_id, behind)
    if mask is not None:
      s_tk = jnp.where(mask, s_tk, -jnp.inf)
    m_new = jnp.maximum(m_t, jnp.max(s_tk, axis=1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p_tk = jnp.exp2(s_tk - m_safe[:, None])
    alpha = jnp.exp2(m_t - m_safe)
    acc_tD = alpha[:, None] * acc_tD + _dot(p_tk.astype(v_kD.dtype), v_kD, 0)
    return m_new, alpha * l_t + jnp.sum(p_tk, axis=1), acc_tD

  t, d = q_tD.shape
  init = (jnp.full((t,), -jnp.inf, _F32), jnp.zeros((t,), _F32), jnp.zeros((t, d), _F32))
  m_t, l_t, acc_tD = over_tiles(lists, row, visit, init)
  seen = l_t > 0
  l_safe = jnp.where(seen, l_t, 1.0)
  o_ref[...] = (acc_tD / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m_t + jnp.log2(l_safe)) / _LOG2E, -jnp.inf)


def _bwd_tile(spec: MaskSpec, q_tD, k_kD, v_kD, do_tD, lse2_t, delta_t, scale: float,
              mask_tk):
  """Shared FA-2 backward algebra of one tile pair: (p, ds) in float32."""
  logits_tk, slope = _logits(spec, q_tD, k_kD, scale)
  p_tk = jnp.exp2(logits_tk * _LOG2E - lse2_t[:, None])
  if mask_tk is not None:
    p_tk = jnp.where(mask_tk, p_tk, 0.0)
  dp_tk = _dot(do_tD, v_kD, 1)
  return p_tk, p_tk * (dp_tk - delta_t[:, None]) * slope


def _lse2(lse_t):
  """Global lse in base 2; -inf (a query that sees nothing) -> +inf so p is 0, not NaN."""
  return jnp.where(lse_t == -jnp.inf, jnp.inf, lse_t * _LOG2E)


def dkv_program(q_ref, k_ref, v_ref, *refs, spec: MaskSpec, scale: float, block_q: int,
                group: int, has_seg: bool):
  do_ref, lse_ref, delta_ref, *refs = refs  # the merged attention's (`kernel_grads.Merged`)
  (q_seg_ref, k_seg_ref), lists, masks_ref, span_refs, (dk_ref, dv_ref) = _split_refs(
      refs, spec, has_seg, 2)
  row, kv_head = pl.program_id(0), pl.program_id(2)
  k_kD, v_kD = k_ref[...], v_ref[...]
  k_seg_t = k_seg_ref[...] if has_seg else None

  def visit(g, i, carry, mask_id):
    rows = pl.ds(i * block_q, block_q)
    dk_kD, dv_kD = carry
    q_tD, do_tD = q_ref[rows, g, :], do_ref[rows, g, :]
    behind, span = None, None
    if spec.head_spans:  # This program's kv head's query head g.
      behind = _behind(span_refs[0][rows], span_refs[1][...])
      span = span_refs[2][kv_head * group + g]
    pair_mask = Mask(spec, Side(_rows(q_seg_ref[rows] if has_seg else None), spans=span),
                     Side(_cols(k_seg_t)))
    mask = _visible(pair_mask, masks_ref, mask_id, behind)
    p_tk, ds_tk = _bwd_tile(spec, q_tD, k_kD, v_kD, do_tD, _lse2(lse_ref[rows, g]),
                            delta_ref[rows, g], scale, mask)
    dv_kD = dv_kD + _dot_tn(p_tk.astype(do_tD.dtype), do_tD)
    dk_kD = dk_kD + _dot_tn(ds_tk.astype(q_tD.dtype), q_tD)
    return dk_kD, dv_kD

  # The q heads of this kv head's group, one after another (no K/V repeat).
  zeros = jnp.zeros(k_kD.shape, _F32)
  dk_kD, dv_kD = lax.fori_loop(
      0, group, lambda g, c: over_tiles(lists, row, functools.partial(visit, g), c),
      (zeros, zeros))
  dk_ref[...], dv_ref[...] = dk_kD, dv_kD


def dq_program(q_ref, k_ref, v_ref, *refs, spec: MaskSpec, scale: float, block_k: int,
               has_seg: bool):
  do_ref, lse_ref, delta_ref, *refs = refs  # the merged attention's (`kernel_grads.Merged`)
  (q_seg_ref, k_seg_ref), lists, masks_ref, span_refs, (dq_ref,) = _split_refs(
      refs, spec, has_seg, 1)
  row = query_tile(pl.program_id(0), pl.num_programs(0))
  q_tD, do_tD = q_ref[...], do_ref[...]
  lse2_t, delta_t = _lse2(lse_ref[...]), delta_ref[...]
  q_seg_t = q_seg_ref[...] if has_seg else None
  span = span_refs[2][pl.program_id(2)] if spec.head_spans else None

  def visit(j, dq_tD, mask_id):
    keys = pl.ds(j * block_k, block_k)
    k_kD = k_ref[keys, :]
    behind = _behind(span_refs[0][...], span_refs[1][keys]) if spec.head_spans else None
    pair_mask = Mask(spec, Side(_rows(q_seg_t), spans=span),
                     Side(_cols(k_seg_ref[keys] if has_seg else None)))
    mask = _visible(pair_mask, masks_ref, mask_id, behind)
    _, ds_tk = _bwd_tile(spec, q_tD, k_kD, v_ref[keys, :], do_tD, lse2_t, delta_t, scale,
                         mask)
    return dq_tD + _dot(ds_tk.astype(k_kD.dtype), k_kD, 0)

  dq_ref[...] = over_tiles(lists, row, visit, jnp.zeros(q_tD.shape, _F32))


def query_tile(i, num_q):
  """The query tile of grid step `i`: last-first, because in a causal order the late tiles
  see the most keys, and launching them first evens out the tail of the grid."""
  return num_q - 1 - i
