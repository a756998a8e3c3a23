"""SparseK attention (Lou et al. 2024, "Sparser is Faster and Less is More"): a learned soft
top-k mask over each query's keys, beside a sliding window.

- Scores: a linear scoring network gives each token one score per kv head from the layer's
  input, u = x W [d_model, Hkv] (`Scorer`, float32, trained end to end like any weight).
- The operator: SparseK(z, k) = argmin_{p in [0,1]^n, sum p = k} ||p - z||^2
  = clip(z - tau(z), 0, 1), tau the threshold where the sum is k; a vector of n <= k
  entries keeps them all (tau = -inf here). Its gradient is the projection's: with S the
  support {0 < z - tau < 1}, d tau / d z_j = 1 / |S| for j in S, else 0.
- Causal LM: query i's candidates are its document's keys at least `window` positions back
  (original positions j <= i - window); its threshold tau_i is SparseK's over their scores,
  its mask m_ij = clip(u_j - tau_i, 0, 1) on them, and the `window` keys up to itself are
  always seen (m = 1). Attention weights are m_ij exp(q_i.k_j) (log m added to the logits).

Thresholds are exact to float32 rounding, found two ways, chosen by the work each takes:
- many queries (a row's forward, a device's share): every prefix of every document at once,
  O(S log S) per row and kv head (model/sparsek_prefixes.py: a prefix's threshold grows
  with it, so searches of all prefixes in step need only prefix sums and binary searches);
- few queries (decoding): per query a bisection of 30 halvings brackets tau, then tau is
  solved on the bracket's support, (sum_S u + |{u >= tau + 1}| - k) / |S|, twice: O(S) per
  query (`_solve`, queries in chunks, O(chunk x S) memory).
Both decide flat stretches alike and take the gradient from the support. On a mesh each device
solves its own queries over the gathered scores (`parallelism.per_query`: S floats per row
and kv head).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import sparsek_prefixes as prefixes
from model.config import ModelConfig
from model.layers import projection_kernel
from parallelism.masks import Mask, MaskSpec, Side

_F32 = jnp.float32
_HALVINGS = 30  # Float32 brackets of scores within ~10^3 of each other stop shrinking by then.
_CHUNK_ELEMENTS = 1 << 22  # Query chunk x keys per (row, kv head) held at once.
# From this many queries on, every prefix at once is quicker than each query on its own (on a
# CPU the break-even moved little from 256 to 16k keys: the per-query passes slow with S).
_MANY_QUERIES = 256


class Scorer(nn.Module):
  """SparseK's scoring network: u [B, S, Hkv] float32 = x W, one score per kv head."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BSE: jax.Array) -> jax.Array:
    cfg = self.cfg
    w_EK = projection_kernel(self, cfg, (cfg.d_model, cfg.num_kv_heads), ("embed", "kv_heads"))
    return jnp.einsum("bse,ek->bsk", x_BSE.astype(_F32), w_EK.astype(_F32),
                      precision="highest")


def _solve(z_QK, member_QK, k: int):
  """(tau [..., Q], support [..., Q, K]) of SparseK over each query's member scores; -inf
  and an empty support where a query has k members or fewer."""
  shape = jnp.broadcast_shapes(z_QK.shape, member_QK.shape)
  z_QK, member_QK = jnp.broadcast_to(z_QK, shape), jnp.broadcast_to(member_QK, shape)
  count_Q = member_QK.sum(-1)
  lo_Q = jnp.min(jnp.where(member_QK, z_QK, jnp.inf), -1) - 1.0  # mass there: count > k
  hi_Q = jnp.max(jnp.where(member_QK, z_QK, -jnp.inf), -1)  # mass there: 0 < k
  mass = lambda t_Q: jnp.sum(jnp.where(member_QK, jnp.clip(z_QK - t_Q[..., None], 0.0, 1.0),
                                       0.0), -1)

  def halve(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    above = mass(mid) >= k
    return jnp.where(above, mid, lo), jnp.where(above, hi, mid)

  lo_Q, hi_Q = jax.lax.fori_loop(0, _HALVINGS, halve, (lo_Q, hi_Q))
  tau_Q = 0.5 * (lo_Q + hi_Q)
  for _ in range(2):  # Solve on the bracket's support: exact once the support is right.
    support = _inside(z_QK, tau_Q, member_QK)
    ones_Q = jnp.sum(member_QK & (z_QK - tau_Q[..., None] >= 1.0), -1)
    size_Q = support.sum(-1)
    solved = (jnp.sum(jnp.where(support, z_QK, 0.0), -1) + ones_Q - k) / jnp.maximum(size_Q, 1)
    tau_Q = jnp.where(size_Q > 0, solved, tau_Q)
  # A flat stretch: the k largest scores stand 1 or more above the rest, so the mass is k for
  # every tau between; take its middle, away from the kinks where the gradient is undefined.
  # The search ends at the stretch's upper edge, where float32 may leave the edge key's gap a
  # rounding below 1 (a support of one, gradient 1): so decide on the scores, not the gaps.
  # On (or a rounding off) a stretch the k largest are the members over 1/2 above tau; where
  # there is no stretch, no split of the members passes the test below.
  top_QK = member_QK & (z_QK - tau_Q[..., None] > 0.5)
  below_Q = jnp.max(jnp.where(member_QK & ~top_QK, z_QK, -jnp.inf), -1)
  above_Q = jnp.min(jnp.where(top_QK, z_QK, jnp.inf), -1) - 1.0
  flat_Q = (top_QK.sum(-1) == k) & (above_Q >= below_Q)
  tau_Q = jnp.where(flat_Q, 0.5 * (below_Q + above_Q), tau_Q)
  tau_Q = jnp.where(count_Q <= k, -jnp.inf, tau_Q)
  return tau_Q, _inside(z_QK, tau_Q, member_QK)


def _inside(z_QK, tau_Q, member_QK):
  """The support: members whose mask clip(z - tau, 0, 1) is strictly between 0 and 1 (the
  same float32 difference the kernels take)."""
  gap_QK = z_QK - tau_Q[..., None]
  return member_QK & (gap_QK > 0.0) & (gap_QK < 1.0)


def _spread(g_Q, support_QK):
  """d tau / d z applied to the thresholds' cotangent: each query's g / |S| on its support."""
  size_Q = support_QK.sum(-1)
  share_Q = jnp.where(size_Q > 0, g_Q / jnp.maximum(size_Q, 1), 0.0)
  return jnp.sum(jnp.where(support_QK, share_Q[..., None], 0.0), -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def threshold(z_N: jax.Array, k: int) -> jax.Array:
  """SparseK's threshold tau of the last axis of `z_N` (-inf where it has k entries or fewer)."""
  return _solve(z_N[..., None, :], jnp.ones(z_N.shape[-1:], bool)[None], k)[0][..., 0]


def _threshold_fwd(z_N, k):
  return threshold(z_N, k), z_N


def _threshold_bwd(k, z_N, g):
  _, support = _solve(z_N[..., None, :], jnp.ones(z_N.shape[-1:], bool)[None], k)
  return (_spread(g[..., None], support),)


threshold.defvjp(_threshold_fwd, _threshold_bwd)


def sparsek(z_N: jax.Array, k: int) -> jax.Array:
  """SparseK(z, k) over the last axis: the soft top-k mask, clip(z - tau(z), 0, 1)."""
  return jnp.clip(z_N - threshold(z_N, k)[..., None], 0.0, 1.0)


def _members(mask: Mask):
  """[B, 1, C, S]: key j is a candidate of query i (j <= i - window, same document), of a
  chunk of `mask`'s queries."""
  queries, keys = mask.q, mask.k
  key_S = jnp.arange(keys.segment_ids.shape[1])
  back = queries.index[:, :, None] - key_S[None, None, :] >= max(mask.spec.sparsek_window, 0)
  return (back & (queries.segment_ids[:, :, None] == keys.segment_ids[:, None, :]))[:, None]


def _chunk(num_queries: int, seq_len: int) -> int:
  return math.gcd(num_queries, max(1, _CHUNK_ELEMENTS // seq_len))


def _query_chunks(fn, mask: Mask, *xs_BQ):
  """[n, ...] of `fn(mask chunk, *chunks)` over chunks of `mask`'s queries (lax.map): its
  query side and each `x_BQ` (axis 1 the queries) sliced to the chunk."""
  num_queries = mask.q.segment_ids.shape[1]
  chunk = _chunk(num_queries, mask.k.segment_ids.shape[1])

  def one(start):
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
    return fn(dataclasses.replace(mask, q=jax.tree.map(cut, mask.q)), *map(cut, xs_BQ))

  return jax.lax.map(one, jnp.arange(0, num_queries, chunk))


def thresholds(mask: Mask) -> jax.Array:
  """The thresholds [B, Q, Hkv] float32 of `mask`'s queries (its query side: their original
  positions `index` [B, Q] and documents `segment_ids`) over their candidates' scores (its
  key side: `scores` [B, S, Hkv] and `segment_ids`, the whole row in its original order),
  the spec's `sparsek_k` and `sparsek_window`; -inf where a query has k candidates or
  fewer: every mask is 1."""
  if mask.q.index.shape[1] >= _MANY_QUERIES:  # every prefix: O(S log S), else O(S) a query
    return _prefix_thresholds(mask)
  return _query_thresholds(mask)


def _no_cotangent(mask: Mask, du_BSK) -> Mask:
  """The mask's cotangent: the scores' gradient, nothing for the integers."""
  return Mask(mask.spec, Side(), Side(scores=du_BSK.astype(mask.k.scores.dtype)))


@jax.custom_vjp
def _prefix_thresholds(mask: Mask):
  return _prefix_fwd(mask)[0]


def _prefix_fwd(mask: Mask):
  row = prefixes.sorted_row(mask.k.scores, mask.k.segment_ids)
  taus_BKS = prefixes.prefix_taus(row, mask.spec.sparsek_k)
  prefix_BQ = prefixes.query_prefixes(row, mask.q, mask.spec.sparsek_window)
  return prefixes.query_taus(taus_BKS, prefix_BQ), (mask, row, taus_BKS, prefix_BQ)


def _prefix_bwd(residuals, g_BQK):
  mask, row, taus_BKS, prefix_BQ = residuals
  return (_no_cotangent(mask, prefixes.prefix_vjp(row, taus_BKS, prefix_BQ, g_BQK)),)


_prefix_thresholds.defvjp(_prefix_fwd, _prefix_bwd)


@jax.custom_vjp
def _query_thresholds(mask: Mask):
  u_BK1S = jnp.swapaxes(mask.k.scores.astype(_F32), 1, 2)[:, :, None]

  def chunk(mask_c):
    return _solve(u_BK1S, _members(mask_c), mask.spec.sparsek_k)[0]  # [B, K, C]

  tau_nBKC = _query_chunks(chunk, mask)
  return jnp.transpose(tau_nBKC, (1, 0, 3, 2)).reshape(*mask.q.segment_ids.shape,
                                                       u_BK1S.shape[1])


def _query_fwd(mask: Mask):
  tau_BQK = _query_thresholds(mask)
  return tau_BQK, (mask, tau_BQK)


def _query_bwd(residuals, g_BQK):
  mask, tau_BQK = residuals
  u_BK1S = jnp.swapaxes(mask.k.scores.astype(_F32), 1, 2)[:, :, None]

  def chunk(mask_c, tau_BCK, g_BCK):
    support = _inside(u_BK1S, jnp.swapaxes(tau_BCK, 1, 2), _members(mask_c))
    return _spread(jnp.swapaxes(g_BCK, 1, 2), support)  # [B, K, S]

  du_BKS = _query_chunks(chunk, mask, tau_BQK, g_BQK).sum(0)
  return (_no_cotangent(mask, jnp.swapaxes(du_BKS, 1, 2)),)


_query_thresholds.defvjp(_query_fwd, _query_bwd)


def spec_of(k: int, window: int) -> MaskSpec:
  """SparseK's mask spec keeping `k` keys beside a window of `window`."""
  return MaskSpec(sparse="sparsek", sparsek_k=k, sparsek_window=window)


def row_mask(spec: MaskSpec, u_BSK, seg_BS, index_BQ, seg_BQ) -> Mask:
  """The mask `thresholds` reads: queries at original positions `index_BQ` of documents
  `seg_BQ`, keys the whole row's scores `u_BSK` of documents `seg_BS` in original order."""
  return Mask(spec, Side(segment_ids=seg_BQ, index=index_BQ),
              Side(segment_ids=seg_BS, scores=u_BSK))


def prefix_thresholds(u_BSK: jax.Array, seg_BS: jax.Array, k: int, window: int) -> jax.Array:
  """Every query's threshold [B, S, Hkv] of a row in its original order (`thresholds`)."""
  index_BS = jnp.broadcast_to(jnp.arange(u_BSK.shape[1], dtype=jnp.int32), seg_BS.shape)
  return thresholds(row_mask(spec_of(k, window), u_BSK, seg_BS, index_BS, seg_BS))


def decode_thresholds(u_BSK: jax.Array, position_B: jax.Array, k: int,
                      window: int) -> jax.Array:
  """The thresholds [B, Hkv] of one query per row, at original position `position_B`, over a
  row of one document in its original order (a sampler's gathered cache): `thresholds`, so a
  decode step solves what the whole row's forward solves for that query (to float32
  rounding: one query is solved on its own, a long row's many by prefix)."""
  seg_BS = jnp.ones(u_BSK.shape[:2], jnp.int32)
  return thresholds(row_mask(spec_of(k, window), u_BSK, seg_BS, position_B[:, None],
                             seg_BS[:, :1]))[:, 0]
