"""Run-time codes as ranges (SCFA's own method): each device sorts its queries and keys once,
per head, by (code, document, original position); then every query sees ONE contiguous range
of any key block.

Hash buckets and QK-dropping's flags (`MaskSpec.coded`) mask a query's keys by equal codes,
which scatters them over a block. Sorted, a query's visible keys are the entries of its
(code, document) group at positions in [i - w + 1, i] (w its window or span; no window: from
the group's start): the first sorted key >= (code, document, i - w + 1) up to the last <=
(code, document, i), found by binary search (`ranges`), no walk. QK-dropping sorts its
dropped queries and keys into groups that meet nothing: empty ranges.

A sorted side keeps the block's shape, [B, T, H, ...] with each head's own order along T
(`Side.index` holds each entry's original position, its segment ids become [B, T, H]), so
K/V travel the ring sorted like any block. The ring sorts before its first step and unsorts
its outputs once at the end (`sort_device`, `unsort`); dK/dV come home in their owner's
order and are unsorted there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from parallelism.masks import Mask, MaskSpec, Side

_LOWEST, _HIGHEST = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max


def _per_head(x_BT, heads: int):
  """[B, T] -> [B, T, H] (a row's segment ids as each head's)."""
  return jnp.broadcast_to(x_BT[:, :, None], (*x_BT.shape, heads))


def sort_order(side: Side, index_T):
  """[B, T, H] int32: each head's entries in stable (code, document, original position)
  order, as positions in the block; `index_T` the block's original positions."""
  codes = side.codes
  keys = [jnp.broadcast_to(index_T.astype(jnp.int32)[None, :, None], codes.shape)]
  if side.segment_ids is not None:
    keys.append(_per_head(side.segment_ids, codes.shape[2]))
  return jnp.lexsort((*keys, codes), axis=1).astype(jnp.int32)


def gather(x_BTH, order_BTH):
  """x [B, T, H, ...] in each head's sorted order."""
  order = order_BTH.reshape(order_BTH.shape + (1,) * (x_BTH.ndim - 3))
  return jnp.take_along_axis(x_BTH, order, axis=1)


def unsort(x_BTH, order_BTH):
  """Inverse of `gather`: x [B, T, H, ...] back in the block's order."""
  batch, length, heads = order_BTH.shape
  at = (jnp.arange(batch)[:, None, None], order_BTH, jnp.arange(heads)[None, None, :])
  return jnp.zeros_like(x_BTH).at[at].set(x_BTH)


def sorted_like(xs, order_BTH) -> tuple:
  """Each x [B, T, H, ...] in the sorted order (none sorted: as given)."""
  return tuple(xs) if order_BTH is None else tuple(gather(x, order_BTH) for x in xs)


def unsorted(xs, order_BTH) -> tuple:
  """Each x [B, T, H, ...] back in the block's order (none sorted: as given)."""
  return tuple(xs) if order_BTH is None else tuple(unsort(x, order_BTH) for x in xs)


def sort_side(side: Side, index_T) -> tuple[Side, jax.Array]:
  """(the side sorted per head, with its entries' original positions, its order)."""
  order = sort_order(side, index_T)
  seg = None if side.segment_ids is None else gather(
      _per_head(side.segment_ids, order.shape[2]), order)
  index = gather(jnp.broadcast_to(index_T.astype(jnp.int32)[None, :, None], order.shape),
                 order)
  return dataclasses.replace(side, segment_ids=seg, codes=gather(side.codes, order),
                             index=index), order


def sort_device(q_BTHD, k_BTKD, v_BTKD, mask: Mask, q_index_T, k_index_T=None):
  """Queries and keys sorted (coded masks not yet sorted; else as given): (q, k, v, mask,
  the queries' order, the keys' order), orders None when nothing was sorted. `q_index_T`
  and `k_index_T` are the blocks' original positions (a device's own block: one for both;
  an array given as None stays None)."""
  if not mask.spec.coded or mask.q.index is not None:
    return q_BTHD, k_BTKD, v_BTKD, mask, None, None
  q_side, q_order = sort_side(mask.q, q_index_T)
  k_side, k_order = sort_side(mask.k, q_index_T if k_index_T is None else k_index_T)
  sort = lambda x, order: None if x is None else gather(x, order)
  return (sort(q_BTHD, q_order), sort(k_BTKD, k_order), sort(v_BTKD, k_order),
          Mask(mask.spec, q_side, k_side), q_order, k_order)


def _keys(side: Side, rows):
  """The side's sort keys per row ([R, T] each): (code, document or None, position)."""
  flat = lambda x: None if x is None else jnp.swapaxes(x, 1, 2).reshape(-1, x.shape[1])[rows]
  return flat(side.codes), flat(side.segment_ids), flat(side.index)


def _before(keys, probe, strict: bool):
  """Whether sorted keys lie before the probe, lexicographically (or at it: not strict)."""
  (code, seg, index), (p_code, p_seg, p_index) = keys, probe
  last = index < p_index if strict else index <= p_index
  if seg is not None:
    last = (seg < p_seg) | ((seg == p_seg) & last)
  return (code < p_code) | ((code == p_code) & last)


def _search(keys, probe, strict: bool):
  """[R, P] int32: per row, how many sorted keys lie before each probe (a lower bound,
  `strict`, or an upper bound): a binary search of fixed steps over the key axis."""
  length = keys[0].shape[1]

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) // 2
    at = tuple(None if x is None else jnp.take_along_axis(x, jnp.minimum(mid, length - 1), 1)
               for x in keys)
    below = _before(at, probe, strict) & (lo < hi)
    return jnp.where(below, mid + 1, lo), jnp.where(below | (lo >= hi), hi, mid)

  zeros = jnp.zeros(probe[0].shape, jnp.int32)
  steps = max(1, int(length).bit_length())
  return lax.fori_loop(0, steps, halve, (zeros, zeros + length))[0]


def _windows(spec: MaskSpec, spans_H, heads: int):
  """[H] int32 each head's window (keys up to itself), or None: no window."""
  if spans_H is not None:
    return spans_H.astype(jnp.int32)
  return None if spec.window is None else jnp.full((heads,), spec.window, jnp.int32)


def ranges(mask: Mask):
  """The sorted block pair's ranges: (lo, hi) [B*Hq, Tq] int32, each query row's keys
  [lo, hi) of its kv head's row (query row b * Hq + h reads key row b * Hkv + h // G), and
  (lo, hi) [B*Hkv, G, Tk], each key's queries of each of its group's query heads."""
  q, k = mask.q, mask.k
  batch, _, heads = q.codes.shape
  num_kv = k.codes.shape[2]
  group = heads // num_kv
  window = _windows(mask.spec, q.spans, heads)
  q_rows = jnp.arange(batch * heads)
  k_of_q = (q_rows // heads) * num_kv + (q_rows % heads) // group
  q_keys, k_keys = _keys(q, q_rows), _keys(k, k_of_q)
  # A query (c, d, i) sees the keys (c, d, i - w + 1) .. (c, d, i).
  back = (jnp.full_like(q_keys[2], _LOWEST) if window is None
          else q_keys[2] - jnp.tile(window, batch)[:, None] + 1)
  q_lo = _search(k_keys, (q_keys[0], q_keys[1], back), strict=True)
  q_hi = _search(k_keys, q_keys, strict=False)
  # A key (c, d, j) is seen by the queries (c, d, j) .. (c, d, j + w - 1).
  k_rows = jnp.arange(batch * num_kv)
  q_of_k = ((k_rows // num_kv) * heads + (k_rows % num_kv) * group)[:, None] + jnp.arange(group)
  k_keys = _keys(k, jnp.repeat(k_rows, group))
  q_keys = _keys(q, q_of_k.reshape(-1))
  ahead = (jnp.full_like(k_keys[2], _HIGHEST) if window is None else
           k_keys[2] + jnp.tile(window, batch)[q_of_k.reshape(-1)][:, None] - 1)
  k_lo = _search(q_keys, k_keys, strict=True)
  k_hi = _search(q_keys, (k_keys[0], k_keys[1], ahead), strict=False)
  shape = (batch * num_kv, group, -1)
  return (q_lo, q_hi), (k_lo.reshape(shape), k_hi.reshape(shape))
