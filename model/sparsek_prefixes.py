"""SparseK's thresholds of every prefix of a row's documents at once, exact and sub-quadratic
(model/sparsek.py's `thresholds` when it has many queries).

A query's candidates are a prefix of its document; its threshold solves sum_j clip(u_j - tau,
0, 1) = k over it and only grows with the prefix (each key adds mass). So the row is sorted
by (document, position), sorted index m standing for the prefix of m's document ending at m,
and every prefix's threshold is found at once by searches whose trial thresholds t_m grow
along each document. For such t, the keys of prefix m passing a test of the gap u - t_m that
a larger t can only fail (gap > 0, gap >= 1, as float32 computes it) are those that passed on
arrival less a run of the document's lowest scores, which t_m is past: a count or sum over
them is a prefix of the row in position order less a prefix of the document in score order.

- The root: per prefix, a binary search of its document's sorted breakpoints (scores and
  scores - 1) for the last with mass >= k, all prefixes in step (binary lifting, so each
  step's trials grow along a document; a breakpoint's run end is searched once). Sums are
  kept in two float32s (~48 bits), a score times a count exactly.
- Then as `sparsek._solve`: the solve on the support twice (from inside the piece found, so
  exact), and the flat-stretch rule from a sparse table of positions in score order.
- The VJP: key j is in prefix m's support for m in a range (tau grows along the document),
  so |S_m| counts the ranges open at m and du_j sums g_m / |S_m| over its range.

Per row and kv head: three sorts, O(log S) lifting steps of O(S) and a few passes of binary
searches: O(S log S) time and memory (tables of log2(S) levels).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

_F32 = jnp.float32
# Gap tests as gap > level: support's lower edge, its upper one (gap >= 1: no float32 lies
# between 1 - 2^-24 and 1), and the flat-stretch rule's split.
_ABOVE_0, _ABOVE_1, _ABOVE_HALF = 0.0, float(np.nextafter(np.float32(1), np.float32(0))), 0.5


class Row(NamedTuple):
  """One row per batch entry and kv head, sorted by (document, original position): sorted
  index m is the prefix of its document that ends at m; and each document's keys by score
  (score slots, the document's at the same [start, end))."""

  order_BS: jax.Array  # original position of sorted index m
  seg_BS: jax.Array  # segment id of sorted index m
  start_B1S: jax.Array  # first sorted index of m's document
  end_B1S: jax.Array  # one past its last
  u_BKS: jax.Array  # scores, float32
  by_score_BKS: jax.Array  # sorted index of each score slot: each document's keys by score
  scores_BKS: jax.Array  # scores in score order, u[by_score]


def _take(x, index):
  """x[..., index] along the last axis, leading axes broadcast, index clipped in range (a
  gather from the flattened array: quicker to compile and to run than take_along_axis's)."""
  shape = jnp.broadcast_shapes(x.shape[:-1], index.shape[:-1])
  size = x.shape[-1]
  if math.prod(shape) * size >= 2**31:  # past int32's flat indices: per axis
    return jnp.take_along_axis(jnp.broadcast_to(x, (*shape, size)),
                               jnp.broadcast_to(index, (*shape, index.shape[-1])), axis=-1,
                               mode="clip")
  rows = jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(*shape, 1) * size
  flat = jnp.broadcast_to(x, (*shape, size)).reshape(-1)
  return flat.at[rows + jnp.clip(index, 0, size - 1)].get(mode="promise_in_bounds")


def sorted_row(u_BSK: jax.Array, seg_BS: jax.Array) -> Row:
  """The row sorted by (document, position) (a stable sort by segment id, so any ids, in any
  order), and each document's keys by score."""
  seq = seg_BS.shape[1]
  order_BS = jnp.argsort(seg_BS, axis=1, stable=True).astype(jnp.int32)
  sorted_seg_BS = jnp.take_along_axis(seg_BS, order_BS, axis=1)
  index_S = jnp.arange(seq, dtype=jnp.int32)
  edge = sorted_seg_BS[:, 1:] != sorted_seg_BS[:, :-1]
  first = jnp.pad(edge, ((0, 0), (1, 0)), constant_values=True)
  last = jnp.pad(edge, ((0, 0), (0, 1)), constant_values=True)
  start_BS = lax.cummax(jnp.where(first, index_S, 0), axis=1)
  end_BS = lax.cummin(jnp.where(last, index_S + 1, seq), axis=1, reverse=True)
  u_BKS = _take(jnp.swapaxes(u_BSK.astype(_F32), 1, 2), order_BS[:, None])
  seg_BKS = jnp.broadcast_to(sorted_seg_BS[:, None], u_BKS.shape)
  _, scores_BKS, by_score_BKS = lax.sort(
      (seg_BKS, u_BKS, jnp.broadcast_to(index_S, u_BKS.shape)), num_keys=2)
  return Row(order_BS, sorted_seg_BS, start_BS[:, None], end_BS[:, None], u_BKS, by_score_BKS,
             scores_BKS)


def _first_failing(passes, lo, hi, steps: int):
  """Per entry, the first index in [lo, hi) where `passes(index)` fails (hi if none), for
  tests that pass and then fail along the index: a binary search of fixed steps."""

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) // 2
    ok = passes(mid) & (lo < hi)
    return jnp.where(ok, mid + 1, lo), jnp.where(ok | (lo >= hi), hi, mid)

  return lax.fori_loop(0, steps, halve, (lo, hi))[0]


# Two-float arithmetic (Dekker, Knuth): x = hi + lo, |lo| <= half an ulp of hi. A sum of
# 16k scores in float32 is off by ~10^-3, far more than the rounding of tau.
def _two_sum(a, b):
  s = a + b
  b_part = s - a
  return s, (a - (s - b_part)) + (b - b_part)


def _add(x, y):
  s, e = _two_sum(x[0], y[0])
  e = e + (x[1] + y[1])
  hi = s + e
  return hi, e - (hi - s)


def _neg(x):
  return -x[0], -x[1]


def _times_count(c, n):
  """c * n as two floats, exact to ~2^-48 (c float32, 0 <= n < 2^24 int32): each score and
  count split into 12-bit halves, whose products float32 holds exactly."""
  c_hi = lax.bitcast_convert_type(lax.bitcast_convert_type(c, jnp.int32) & ~0xFFF, _F32)
  c_lo = c - c_hi
  n_hi, n_lo = (n & ~0xFFF).astype(_F32), (n & 0xFFF).astype(_F32)
  total = _add((c_hi * n_hi, 0.0), (c_hi * n_lo, 0.0))
  return _add(_add(total, (c_lo * n_hi, 0.0)), (c_lo * n_lo, 0.0))


def _cumsum0(x):
  """Two-float sums of float32 x[..., :i] for i in [0, S]: float32's cumsum plus that of
  each step's rounding (the error-free sum of the previous sum and x, less the sum taken),
  whose own rounding is float32's squared."""
  pad = lambda y: jnp.pad(y, [(0, 0)] * (x.ndim - 1) + [(1, 0)])
  hi = pad(jnp.cumsum(x, axis=-1))
  step, rounding = _two_sum(hi[..., :-1], x)
  return hi, pad(jnp.cumsum((step - hi[..., 1:]) + rounding, axis=-1))


def _failing_run(row: Row, t, level, start, end):
  """Per entry, the end of its document's run of lowest scores (score slots [start, end))
  that fail gap u - t > level: a binary search."""
  return _first_failing(lambda r: ~(_take(row.scores_BKS, r) - t > level), start, end,
                        row.u_BKS.shape[-1].bit_length())


def _passing(row: Row, t, level, failed_end=None):
  """Per prefix m, its keys with gap u - t_m > level (float32): (count, two-float sum of
  their scores, the end of the document's score run that fails: a score slot, searched for
  unless given).

  `t` must grow along each document (`_grow`). `t` and `level` broadcast to [..., B, K, S].
  """
  passed = row.u_BKS - t > level  # on arrival
  start = jnp.broadcast_to(row.start_B1S, passed.shape)
  if failed_end is None:
    failed_end = _failing_run(row, t, level, start, jnp.broadcast_to(row.end_B1S, passed.shape))
  # Prefix m's passing keys: those that passed on arrival, in [start, m], less those of
  # them in the failing run, score slots [start, failed_end). Counts and sums side by side
  # (float32 counts are exact below 2^24), in position and in score order.
  by_pos = jnp.stack([passed.astype(_F32), jnp.where(passed, row.u_BKS, 0.0)])
  hi, lo = _cumsum0(jnp.stack([by_pos, _take(by_pos, row.by_score_BKS)]))
  at = lambda x, i: (_take(x[0], i), _take(x[1], i))
  first = at((hi, lo), start)
  run = _add(at((hi[1], lo[1]), failed_end), _neg((first[0][1], first[1][1])))
  arrived = _add((hi[0, ..., 1:], lo[0, ..., 1:]), _neg((first[0][0], first[1][0])))
  count_sum = _add(arrived, _neg(run))
  return count_sum[0][0].astype(jnp.int32), (count_sum[0][1], count_sum[1][1]), failed_end


def _doubling_table(x, combine, fill):
  """[..., L, S]: level l combines x over runs [r, r + 2^l) (`fill` past the end), built
  in one loop."""
  seq = x.shape[-1]
  index_S = jnp.arange(seq)

  def double(level, table):
    half = lax.dynamic_index_in_dim(table, level - 1, axis=-2, keepdims=False)
    width = jnp.left_shift(1, level - 1)
    shifted = jnp.where(index_S + width < seq, jnp.roll(half, -width, axis=-1), fill)
    return lax.dynamic_update_index_in_dim(table, combine(half, shifted), level, axis=-2)

  table = jnp.broadcast_to(jnp.expand_dims(x, -2), (*x.shape[:-1], seq.bit_length(), seq))
  return lax.fori_loop(1, seq.bit_length(), double, table)


def _grow(row: Row, t):
  """t made to grow along each document: the greatest over [start, m] (only rounding ever
  undoes the growth), two overlapping runs of 2^l from a table of maxima."""
  seq = t.shape[-1]
  table = _doubling_table(t, jnp.maximum, -jnp.inf).reshape(*t.shape[:-1], -1)
  index_S = jnp.arange(seq, dtype=jnp.int32)
  level = 31 - lax.clz(index_S - row.start_B1S + 1)  # the longest run within [start, m]
  ends = (jnp.broadcast_to(level * seq + x, t.shape) for x in (row.start_B1S,
                                                                index_S - (1 << level) + 1))
  return jnp.maximum(*(_take(table, x) for x in ends))


def _breakpoints(row: Row):
  """[B, K, 2S] each document's scores and scores - 1 sorted, at [2 start, 2 end)."""
  seg = jnp.broadcast_to(row.seg_BS[:, None], row.u_BKS.shape)
  return lax.sort((jnp.concatenate([seg, seg], -1),
                   jnp.concatenate([row.u_BKS, row.u_BKS - 1.0], -1)), num_keys=2)[1]


def _root(row: Row, k: int):
  """Each prefix's root of mass = k, [B, K, S]: the last of its document's breakpoints with
  mass >= k found by binary lifting (mass is linear from there to the next), then as
  `sparsek._solve`, the solve on the support twice: from the piece's middle (exact), and
  once more from there. And at that root, for the flat-stretch rule, how many keys stand
  over 1/2 above it and where the document's score run of the others ends. One loop of
  every kind of step (one body to compile)."""
  points = _breakpoints(row)
  first, stop = 2 * row.start_B1S, 2 * row.end_B1S
  steps = (points.shape[-1] - 1).bit_length()
  small = jnp.arange(row.u_BKS.shape[-1]) - row.start_B1S < k  # m - start + 1 keys
  support = jnp.asarray([_ABOVE_0, _ABOVE_1], _F32)[:, None, None, None]
  halves = jnp.asarray([_ABOVE_HALF, _ABOVE_1], _F32)[:, None, None, None]

  # The failing score runs of every breakpoint (breakpoint q's document is sorted index
  # q // 2's), searched once: the lifting steps' probes are breakpoints.
  half = jnp.arange(points.shape[-1]) // 2
  bounds = (jnp.broadcast_to(_take(x, half[None, None]), (2, *points.shape))
            for x in (row.start_B1S, row.end_B1S))
  runs = _failing_run(row, points, support, *bounds)

  def step(i, state):
    at, t, top, split = state
    lifting, last = i < steps, i == steps + 2
    trial = jnp.minimum(at + jnp.left_shift(1, jnp.maximum(steps - 1 - i, 0)), stop)
    probe = jnp.where(lifting, _take(points, jnp.minimum(trial, stop - 1)), t)
    levels = jnp.where(last, halves, support)
    failed_end = lax.cond(lifting, lambda: _take(runs, jnp.minimum(trial, stop - 1)), lambda: (
        _failing_run(row, probe, levels, *(jnp.broadcast_to(x, (2, *t.shape))
                                          for x in (row.start_B1S, row.end_B1S)))))
    # The keys over 0 and over 1 above the probe (which grows along each document).
    count, total, failed_end = _passing(row, probe, levels, failed_end)
    ones, size = count[1], count[0] - count[1]
    total = _add((total[0][0], total[1][0]), _neg((total[0][1], total[1][1])))
    excess = _add(total, ((ones - k).astype(_F32), 0.0))  # mass - k + probe |support|
    reaches = _add(excess, _neg(_times_count(probe, size)))
    at = jnp.where(lifting & (trial < stop) & (reaches[0] + reaches[1] >= 0.0), trial, at)
    at = lax.cummax(at, axis=at.ndim - 1)  # documents' ranges lie in order
    middle = 0.5 * (_take(points, at) + _take(points, jnp.minimum(at + 1, stop - 1)))
    solved = jnp.where(size > 0, excess[0] / jnp.maximum(size, 1), probe)
    kept = jnp.where(i == steps - 1, jnp.where(small, -jnp.inf, middle), t)
    t = lax.cond(lifting | last, lambda: kept, lambda: _grow(row, solved))
    return at, t, jnp.where(last, count[0], top), jnp.where(last, failed_end[0], split)

  zeros = jnp.zeros(row.u_BKS.shape, jnp.int32)
  start = (jnp.broadcast_to(first, row.u_BKS.shape), zeros.astype(_F32), zeros, zeros)
  return lax.fori_loop(0, steps + 3, step, start)[1:]


def _nearest(row: Row, slot, prefix):
  """(the first score slot from `slot` on whose key is in the prefix (sorted index <=
  prefix), end if none; the last before it, start - 1 if none), within the document: runs
  of 2^l skipped from the longest down, by a table of each run's least sorted index."""
  table = _doubling_table(row.by_score_BKS, jnp.minimum, jnp.iinfo(jnp.int32).max)
  start, end = (jnp.broadcast_to(x, slot.shape) for x in (row.start_B1S, row.end_B1S))

  def skip(i, slots):
    after, before = slots
    level = table.shape[-2] - 1 - i
    width = jnp.left_shift(1, level)
    least = lax.dynamic_index_in_dim(table, level, axis=-2, keepdims=False)
    out = (after + width <= end) & (_take(least, after) > prefix)
    back = (before - width >= start) & (_take(least, before - width) > prefix)
    return jnp.where(out, after + width, after), jnp.where(back, before - width, before)

  after, before = lax.fori_loop(0, table.shape[-2], skip, (slot, slot))
  return after, before - 1


def _flat_middle(row: Row, t, top, split, k: int):
  """Where the k largest scores stand 1 or more above the rest, the middle of that flat
  stretch (`sparsek._solve`'s rule: decided on the scores, the k largest being the `top`
  keys over 1/2 above t, score slots from `split` on)."""
  least, greatest = _nearest(row, split, jnp.broadcast_to(jnp.arange(t.shape[-1]), t.shape))
  start, end = (jnp.broadcast_to(x, t.shape) for x in (row.start_B1S, row.end_B1S))
  above = jnp.where(least < end, _take(row.scores_BKS, least), jnp.inf) - 1.0
  below = jnp.where(greatest >= start, _take(row.scores_BKS, greatest), -jnp.inf)
  flat = (top == k) & (above >= below)
  return jnp.where(flat, 0.5 * (below + above), t)


def prefix_taus(row: Row, k: int) -> jax.Array:
  """[B, K, S] float32: the threshold of every prefix (-inf where it has k keys or fewer)."""
  small = jnp.arange(row.u_BKS.shape[-1]) - row.start_B1S < k
  return _grow(row, jnp.where(small, -jnp.inf, _flat_middle(row, *_root(row, k), k)))


def query_prefixes(row: Row, queries, window: int) -> jax.Array:
  """[B, Q] int32: the sorted index ending each query's candidates (its document's keys at
  original positions <= index - window), -1 where it has none; `queries` a mask's query
  side (`index` [B, Q], `segment_ids`)."""
  index_BQ, seg_BQ = queries.index, queries.segment_ids
  cut = index_BQ - max(window, 0)

  def before(m):  # sorted index m's key is at or before (seg, cut)
    seg, pos = _take(row.seg_BS, m), _take(row.order_BS, m)
    return (seg < seg_BQ) | ((seg == seg_BQ) & (pos <= cut))

  seq = row.seg_BS.shape[1]
  zeros = jnp.zeros(index_BQ.shape, jnp.int32)
  m = _first_failing(before, zeros, zeros + seq, seq.bit_length()) - 1
  return jnp.where((m >= 0) & (_take(row.seg_BS, m) == seg_BQ), m, -1)


def query_taus(taus_BKS, m_BQ) -> jax.Array:
  """[B, Q, K]: each query's threshold from its prefix's."""
  tau_BKQ = _take(taus_BKS, m_BQ[:, None])
  return jnp.swapaxes(jnp.where(m_BQ[:, None] >= 0, tau_BKQ, -jnp.inf), 1, 2)


def _histogram(index, weight, size: int):
  """[..., size] float32: per leading index, `weight` summed into bins `index` (last axis)."""
  shape = index.shape[:-1]
  rows = jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(*shape, 1) * size
  flat = jnp.zeros(math.prod(shape) * size, _F32).at[(rows + index).reshape(-1)].add(
      jnp.broadcast_to(weight, index.shape).reshape(-1), mode="promise_in_bounds")
  return flat.reshape(*shape, size)


def prefix_vjp(row: Row, taus_BKS, m_BQ, g_BQK) -> jax.Array:
  """[B, S, K]: the VJP of the queries' thresholds to the scores, in original order: each
  query's g / |support| on its prefix's support (d tau / d u_j = 1 / |S| on S)."""
  batch, heads, seq = row.u_BKS.shape
  # Key j is in the support of prefixes [enters, leaves): from the first of [j, end) with
  # gap < 1 to the first with gap <= 0 (tau grows along the document).
  levels = jnp.asarray([_ABOVE_1, _ABOVE_0], _F32)[:, None, None, None]
  key = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (2, *row.u_BKS.shape))
  enters, leaves = _first_failing(lambda m: row.u_BKS - _take(taus_BKS, m) > levels, key,
                                  jnp.broadcast_to(row.end_B1S, key.shape), seq.bit_length())
  # |support| of prefix m: keys entered by m less keys left by m.
  size = jnp.cumsum(_histogram(jnp.concatenate([enters, leaves], -1),
                               jnp.concatenate([jnp.ones(seq), -jnp.ones(seq)]), seq + 1), -1)
  into = jnp.where(m_BQ >= 0, m_BQ, seq)[:, None]  # queries without candidates: dropped
  g_BKS = _histogram(jnp.broadcast_to(into, (batch, heads, into.shape[-1])),
                     jnp.swapaxes(g_BQK.astype(_F32), 1, 2), seq + 1)
  share = jnp.where(size > 0, g_BKS / jnp.maximum(size, 1), 0.0)[..., :seq]
  shares = _cumsum0(share)
  at = lambda i: (_take(shares[0], i), _take(shares[1], i))
  du_BKS = _add(at(leaves), _neg(at(enters)))[0]
  # Back to original order: sorted index m of head h goes to (order[m], h).
  to_BSK = row.order_BS[:, :, None] * heads + jnp.arange(heads)
  return _histogram(to_BSK.reshape(batch, -1), jnp.swapaxes(du_BKS, 1, 2).reshape(batch, -1),
                    seq * heads).reshape(batch, seq, heads)
