"""Sink tokens of local layers, kept off the ring: one small table of sink K/V per round.

The rule: a key whose in-document position (the `positions` RoPE reads, which restart at 0
per packed document) is below `count` is a sink, and every later query of its segment sees
it, however far back. The windowed ring already gives each query head h the keys with
`0 <= i - j < w_h` (original positions); this path adds exactly the rest, the sinks with
`i - j >= w_h`, so nothing is counted twice, and merges by log-sum-exp.

Which sinks any query needs is decided from the whole row's segment ids and positions (a
small all-gather of int32s): sink j is needed iff its segment has a token at j + `reach` or
later, `reach` being the layer's narrowest window. The needed sinks are numbered in layout
order; a round takes `capacity` of them, fetches their K/V from the devices that hold them
(one psum of a buffer that is zero but for the owners' rows, exact in any dtype) and attends
every local query to that table densely, a chunk of queries at a time so that the float32
score table stays a small multiple of a block (`query_chunk`). The backward runs the same
rounds and sends each table row's dK/dV home by a psum of the table, added into the owner's
block.

Capacity rule: `count * (S // (reach + 1))`. A row packed as the data pipeline packs it
(segments are contiguous runs whose positions count 0, 1, ...) needs no more: a segment
with a needed sink is at least reach + 1 tokens long and has at most `count` sinks; padding
counts its positions up as one segment does (data/packing.py). Rows that need more
(positions that restart inside a segment) run more rounds:
always exact, slower; the number of rounds is the row's, agreed by every device of the
ring because each holds the same gathered ids.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallelism.masks import Mask, Side, beyond_ring, logits
from parallelism.kernel_grads import softmax_delta
from parallelism.ring import merge


@dataclasses.dataclass(frozen=True)
class SinkPlan:
  """Static: `count` sinks per document, for a layer whose ring sees `window` keys (per
  head: the spans given at run time); `reach` is its narrowest window, beyond which a sink
  can be needed."""
  count: int
  window: int
  reach: int

  def capacity(self, seq_len: int) -> int:
    """Table rows per round (module docstring); 0: no query can need a sink."""
    return self.count * (seq_len // (self.reach + 1))


def _row(x_BT, axes):
  return lax.all_gather(x_BT, axes, axis=1, tiled=True) if axes else x_BT


def _device(axes):
  return lax.axis_index(axes) if axes else 0


def _needed(plan: SinkPlan, seg_BS, pos_BS, index_S):
  """[B, S] (layout order): the sinks some query of the row sees beyond the ring's window."""
  def one_row(seg_S, pos_S):
    rank_S = jnp.searchsorted(jnp.sort(seg_S), seg_S)  # a dense id per segment value
    last_S = jax.ops.segment_max(index_S, rank_S, num_segments=seg_S.shape[0])[rank_S]
    return (pos_S < plan.count) & (last_S >= index_S + plan.reach)
  return jax.vmap(one_row)(seg_BS, pos_BS)


class _Rounds:
  """One device's view of the row's needed sinks, cut into rounds of `capacity`."""

  def __init__(self, plan: SinkPlan, order_S: np.ndarray, seg_BT, pos_BT, axes):
    self.axes, self.block = axes, seg_BT.shape[1]
    self.index_S = jnp.asarray(order_S, jnp.int32)
    self.seg_BS, self.pos_BS = _row(seg_BT, axes), _row(pos_BT, axes)
    self.capacity = plan.capacity(self.index_S.shape[0])
    needed_BS = _needed(plan, self.seg_BS, self.pos_BS, self.index_S)
    self.needed_BS = needed_BS
    self.rank_BS = jnp.cumsum(needed_BS, axis=1) - 1
    most = jnp.max(jnp.sum(needed_BS, axis=1))
    self.count = (most + self.capacity - 1) // self.capacity
    start = _device(axes) * self.block
    self.q_index_T = lax.dynamic_slice_in_dim(self.index_S, start, self.block)

  def table(self, r):
    """Round r: (valid [B, C], this device's row of each [B, C] or -1, the table's key side
    (segment ids, positions [B, C]), original index [B, C])."""
    batch = self.seg_BS.shape[0]
    cap = self.capacity
    taken_BS = self.needed_BS & (self.rank_BS // cap == r)
    slot_BS = jnp.where(taken_BS, self.rank_BS - r * cap, cap)
    rows_B1 = jnp.arange(batch)[:, None]
    where_S = jnp.broadcast_to(jnp.arange(self.seg_BS.shape[1]), slot_BS.shape)
    pos_BC = jnp.zeros((batch, cap + 1), jnp.int32).at[rows_B1, slot_BS].set(where_S)[:, :cap]
    valid_BC = jnp.zeros((batch, cap + 1), bool).at[rows_B1, slot_BS].set(True)[:, :cap]
    local_BC = pos_BC - _device(self.axes) * self.block
    mine_BC = valid_BC & (local_BC >= 0) & (local_BC < self.block)
    keys = Side(*(jnp.take_along_axis(x_BS, pos_BC, axis=1) for x_BS in (self.seg_BS,
                                                                         self.pos_BS)))
    return valid_BC, jnp.where(mine_BC, local_BC, -1), keys, self.index_S[pos_BC]

  def fetch(self, x_BTKD, local_BC):
    """Table rows of a local [B, T, K, D] array, from whichever device holds each."""
    rows = jnp.take_along_axis(x_BTKD, jnp.maximum(local_BC, 0)[:, :, None, None], axis=1)
    rows = jnp.where((local_BC >= 0)[:, :, None, None], rows, jnp.zeros_like(rows))
    return lax.psum(rows, self.axes) if self.axes else rows


def query_chunk(length: int, capacity: int, head_dim: int) -> int:
  """Queries a round's float32 score table [B, H, c, C] holds at once: at most the size of
  the block's queries in float32 ([B, T, H, D]), so the table stays a small multiple of a
  block however many sinks a round takes (a divisor of the block)."""
  most = max(1, length * head_dim // max(capacity, 1))
  return next(c for c in range(min(most, length), 0, -1) if length % c == 0)


def _scores(q_BcHD, k_BCKD, mask: Mask, table, q_index_c):
  """(logits [B,K,G,c,C] f32, their slope by q.k, visible) of a chunk of queries on a
  table: the sinks the rule (`parallelism.masks.beyond_ring`) adds beyond the ring's
  window; `mask`'s query side is the chunk's."""
  valid_BC, _, keys, index_BC = table
  batch, length, heads, head_dim = q_BcHD.shape
  num_kv = k_BCKD.shape[2]
  q_BcKGD = q_BcHD.reshape(batch, length, num_kv, heads // num_kv, head_dim)
  s = jnp.einsum("btkgd,bckd->bkgtc", q_BcKGD, k_BCKD, preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST)
  s, slope = logits(mask.spec, s, head_dim ** -0.5)
  behind_B11cC = (q_index_c[:, None] - index_BC[:, None, :])[:, None, None]
  span = None if mask.q.spans is None else mask.q.spans.reshape(num_kv, -1)[:, :, None, None]
  queries = Side(mask.q.segment_ids[:, None, None, :, None], spans=span)
  keys = Side(*(x_BC[:, None, None, None, :] for x_BC in (keys.segment_ids, keys.positions)))
  visible = valid_BC[:, None, None, None, :] & beyond_ring(Mask(mask.spec, queries, keys),
                                                           behind_B11cC)
  return s, slope, visible


def _segments(mask: Mask) -> Mask:
  """The mask with segment ids on both sides (zeros for one document per row)."""
  if mask.q.segment_ids is not None:
    return mask
  zeros = jnp.zeros_like(mask.q.positions)
  return Mask(mask.spec, dataclasses.replace(mask.q, segment_ids=zeros),
              dataclasses.replace(mask.k, segment_ids=zeros))


def _chunks(rounds: "_Rounds", q_BTHD, mask: Mask, table):
  """(chunk size, count, `chunk(c)` -> (its start, queries, query-side mask, original
  positions)) of the block's queries on a round's table (`query_chunk`)."""
  size = query_chunk(q_BTHD.shape[1], rounds.capacity, q_BTHD.shape[3])

  def chunk(c):
    start = c * size
    cut = lambda x, axis=1: lax.dynamic_slice_in_dim(x, start, size, axis)
    queries = dataclasses.replace(mask.q, segment_ids=cut(mask.q.segment_ids))
    return start, cut(q_BTHD), Mask(mask.spec, queries, mask.k), cut(rounds.q_index_T, 0)

  return size, q_BTHD.shape[1] // size, chunk


def forward(plan: SinkPlan, order_S, axes, q_BTHD, k_BTKD, v_BTKD, mask: Mask, out_BTHD,
            lse_BTH):
  """The ring's (out, lse) with every round's sinks merged in (float32)."""
  mask = _segments(mask)
  rounds = _Rounds(plan, order_S, mask.q.segment_ids, mask.q.positions, axes)
  batch, _, heads, head_dim = q_BTHD.shape

  def one(r, out_lse):
    table = rounds.table(r)
    k_BCKD, v_BCKD = (rounds.fetch(x, table[1]) for x in (k_BTKD, v_BTKD))
    size, count, chunk = _chunks(rounds, q_BTHD, mask, table)

    def part(c, out_lse):
      start, q_c, mask_c, index_c = chunk(c)
      s, _, visible = _scores(q_c, k_BCKD, mask_c, table, index_c)
      s = jnp.where(visible, s, -jnp.inf)
      top = jnp.max(s, axis=-1, keepdims=True)
      top = jnp.where(jnp.isfinite(top), top, 0.0)
      p = jnp.exp(s - top)
      total = jnp.sum(p, axis=-1)
      lse = jnp.where(total > 0, top[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)),
                      -jnp.inf)
      out = jnp.einsum("bkgtc,bckd->btkgd", p / jnp.where(total > 0, total, 1.0)[..., None],
                       v_BCKD.astype(jnp.float32), precision=lax.Precision.HIGHEST)
      cut = lambda x: lax.dynamic_slice_in_dim(x, start, size, 1)
      merged = merge(*map(cut, out_lse), out.reshape(batch, size, heads, head_dim),
                     jnp.moveaxis(lse.reshape(batch, heads, size), 1, 2))
      return tuple(lax.dynamic_update_slice_in_dim(x, m, start, 1)
                   for x, m in zip(out_lse, merged))

    return lax.fori_loop(0, count, part, out_lse)

  return lax.fori_loop(0, rounds.count, one, (out_BTHD, lse_BTH))


def backward(plan: SinkPlan, order_S, axes, q_BTHD, k_BTKD, v_BTKD, mask: Mask, out_BTHD,
             lse_BTH, dout_BTHD):
  """(dq, dk, dv) float32 of the sink paths, from the global output and lse."""
  mask = _segments(mask)
  rounds = _Rounds(plan, order_S, mask.q.segment_ids, mask.q.positions, axes)
  batch, length, heads, head_dim = q_BTHD.shape
  num_kv = k_BTKD.shape[2]
  split = lambda x: jnp.moveaxis(x.reshape(batch, x.shape[1], num_kv, heads // num_kv), 1, 3)
  lse = jnp.where(lse_BTH == -jnp.inf, jnp.inf, lse_BTH)  # a query that sees nothing: p = 0
  delta_BTH = softmax_delta(dout_BTHD, out_BTHD)
  do_BTKGD = dout_BTHD.astype(jnp.float32).reshape(batch, length, num_kv, heads // num_kv,
                                                    head_dim)
  rows_B1 = jnp.arange(batch)[:, None]
  hi = lax.Precision.HIGHEST

  def one(r, grads):
    dq, dk, dv = grads
    table = rounds.table(r)
    k_BCKD, v_BCKD = (rounds.fetch(x, table[1]).astype(jnp.float32) for x in (k_BTKD, v_BTKD))
    size, count, chunk = _chunks(rounds, q_BTHD, mask, table)

    def part(c, carry):
      dq, dk_t, dv_t = carry
      start, q_c, mask_c, index_c = chunk(c)
      cut = lambda x: lax.dynamic_slice_in_dim(x, start, size, 1)
      s, slope, visible = _scores(q_c, k_BCKD, mask_c, table, index_c)
      p = jnp.where(visible, jnp.exp(s - split(cut(lse))[..., None]), 0.0)
      do_c, q_cKGD = cut(do_BTKGD), q_c.reshape(do_BTKGD[:, :size].shape).astype(jnp.float32)
      dp = jnp.einsum("btkgd,bckd->bkgtc", do_c, v_BCKD, precision=hi)
      ds = p * (dp - split(cut(delta_BTH))[..., None]) * slope
      dq_c = jnp.einsum("bkgtc,bckd->btkgd", ds, k_BCKD, precision=hi).reshape(q_c.shape)
      dq = lax.dynamic_update_slice_in_dim(dq, cut(dq) + dq_c, start, 1)
      return (dq, dk_t + jnp.einsum("bkgtc,btkgd->bckd", ds, q_cKGD, precision=hi),
              dv_t + jnp.einsum("bkgtc,btkgd->bckd", p, do_c, precision=hi))

    dq, dk_t, dv_t = lax.fori_loop(0, count, part, (dq, jnp.zeros_like(k_BCKD),
                                                    jnp.zeros_like(v_BCKD)))
    if axes:
      dk_t, dv_t = lax.psum((dk_t, dv_t), axes)
    local_BC = table[1]
    home = lambda acc, g: acc.at[rows_B1, jnp.maximum(local_BC, 0)].add(
        jnp.where((local_BC >= 0)[:, :, None, None], g, 0.0))
    return dq, home(dk, dk_t), home(dv, dv_t)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  return lax.fori_loop(0, rounds.count, one, (zeros(q_BTHD), zeros(k_BTKD), zeros(v_BTKD)))
