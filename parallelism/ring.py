"""One device's passes of ring attention: its K/V block goes around a ring of devices.

Each device keeps its query block and passes its K/V block, with the mask's key side (its
run-time operands: segment ids when documents are packed, run-time codes, SparseK's scores;
`parallelism.masks`), as one buffer around the ring with `lax.ppermute`; after N steps every
query block has met every key block, and SparseK's scores' gradient travels with dK/dV. With
run-time codes the queries and keys are sorted first, the keys travel sorted, and the
results are unsorted at the end (`parallelism.sorting`). The next transfer is issued before
the current block is computed so communication can overlap compute. Partial (out, lse) pairs
merge by the stable log-sum-exp rule. Each step's block pair is the layout's static schedule
(`parallelism.schedule`), looked up by device and step; a pair with nothing to compute skips
the kernel, the others go to the block kernel (`parallelism.kernels`).

The backward is a second ring pass that recomputes each block's probabilities from the
global output and lse. Each block's dK/dV accumulator starts on its owner and follows its
K/V block one step behind, sent while the next step's kernels run, then makes one last hop
home (N hops); XLA's GPU scheduler overlaps both transfers of a step with its kernels given
`trainer.core.xla_options` (`parallelism.overlap` reads the compiled schedule).

A ring cut short (steps at which no device computes anything, a sliding window under `ring`
or `zigzag`: `RingSchedule.needed_steps`) runs only the steps it needs, each K/V block sent
straight to the device that needs it (`ppermute` by its shift) and its dK/dV straight back.
These functions run inside a shard_map (`parallelism.ring_attention`); the other strategies
(`parallelism.strategies`) reuse `RingDevice` and the merge.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import kernels, sorting
from parallelism.kernels import Grads, Merged
from parallelism.masks import Mask, Side
from parallelism.schedule import RingSchedule


# The named scope of the hop that takes each dK/dV accumulator home after the last step.
HOME_HOP = "ring_dkv_home"


def merge(out_a_BTHD, lse_a_BTH, out_b_BTHD, lse_b_BTH):
  """Combines two partial softmax results over disjoint key sets (float32)."""
  lse_max = jnp.maximum(lse_a_BTH, lse_b_BTH)
  # Both -inf means neither part saw a key: shift by 0 so the weights are 0, not NaN.
  shift = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  w_a, w_b = jnp.exp(lse_a_BTH - shift), jnp.exp(lse_b_BTH - shift)
  total = w_a + w_b
  seen = total > 0
  lse_BTH = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
  out_BTHD = out_a_BTHD * (w_a * inv)[..., None] + out_b_BTHD * (w_b * inv)[..., None]
  return out_BTHD, lse_BTH


def pack(*arrays):
  """Arrays as one flat byte buffer, so a K/V block (and its segment ids) moves in one transfer.

  Each transfer is a rendezvous of both neighbours (on CPU also a round trip through the
  collectives library, whose cost grows with the number of arrays).
  Bytes are moved, never converted, so the trip is exact for every dtype of one byte or more.
  """
  return jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in arrays])


def unpack(buffer, like):
  """Inverse of `pack`: arrays with the shapes and dtypes of `like`."""
  arrays, start = [], 0
  for x in like:
    size = x.size * x.dtype.itemsize
    raw = lax.slice_in_dim(buffer, start, start + size)
    raw = raw.reshape(x.shape + ((x.dtype.itemsize,) if x.dtype.itemsize > 1 else ()))
    arrays.append(lax.bitcast_convert_type(raw, x.dtype))
    start += size
  return tuple(arrays)


def shifted(shift: int, num_shards: int) -> list[tuple[int, int]]:
  """The ppermute pairs that send each device's array to the device `shift` after it."""
  return [(i, (i + shift) % num_shards) for i in range(num_shards)]


def cut_short(schedule: RingSchedule) -> bool:
  """Whether the ring skips steps (and sends blocks straight by their shift)."""
  return len(schedule.needed_steps) < schedule.num_shards


def around_ring(own, start, visit, *, axis: str, schedule: RingSchedule):
  """The ring's step loop, the same for both passes; returns the last carry.

  Step 0 is `start(*own)` on the device's own block (k, v and, when packed, segment ids),
  giving the first carry. Steps s = 1..N-1 are `visit(carry, s, *block)` on the block that
  arrived, the one that started on device d - s. Each step first issues the transfer of the
  block it holds, so the compute can overlap it, and waits for it only after its compute
  (`in_flight_over`); the last needs none. A ring cut short
  issues every transfer first, each straight by its shift, then visits its steps (s static).
  """
  num_shards = schedule.num_shards
  if num_shards == 1:
    return start(*own)
  if cut_short(schedule):
    steps = schedule.needed_steps[1:]
    arrived = [lax.ppermute(pack(*own), axis, shifted(s, num_shards)) for s in steps]
    carry = start(*own)
    for s, kv_bytes in zip(steps, arrived):
      carry = visit(carry, s, *unpack(kv_bytes, own))
    return carry
  perm = shifted(1, num_shards)

  def step(s, state, send: bool):
    carry, kv_bytes = state
    if not send:
      return visit(carry, s, *unpack(kv_bytes, own)), kv_bytes
    return in_flight_over(lax.ppermute(kv_bytes, axis, perm),
                          visit(carry, s, *unpack(kv_bytes, own)))

  state = in_flight_over(lax.ppermute(pack(*own), axis, perm), start(*own))
  state = lax.fori_loop(1, num_shards - 1, lambda s, st: step(s, st, True), state)
  return step(num_shards - 1, state, False)[0]


def in_flight_over(sent, carry):
  """(carry, sent): the block in flight is not waited for before the step's compute that
  made `carry` is done. XLA's GPU scheduler otherwise may wait for it first: with a ring of
  2 under Ulysses (hybrid 2 x 4 on 8 H100s) it put the wait on step 0's forward K/V before
  the kernel, with nothing between (parallelism/overlap.py)."""
  sent, carry = lax.optimization_barrier((sent, carry))
  return carry, sent


class RingDevice:
  """One device of the ring: its block pair at each step, looked up in the schedule's table
  by device index, and one step of each pass on it. `device` is traced inside the ring
  (`lax.axis_index`); scripts/bench_attention.py passes it as a jitted argument to time
  the steps one by one."""

  def __init__(self, schedule: RingSchedule, device, kernel: str, tile: int):
    self.schedule, self.tile, self.kernel = schedule, tile, kernels.KERNELS[kernel]
    self.pair_S = jnp.asarray(schedule.pair)[device]
    self.empty_S = jnp.asarray(schedule.empty)[device]
    self.device = device

  def _index(self, step, mask: Mask):
    """The token indices of this device's query block and of the K/V block it holds, where
    the mask needs them (SparseK's window depends on their distance, which a schedule's
    representative pair does not keep); else None."""
    if not mask.spec.selects:
      return None
    order_NT = jnp.asarray(self.schedule.order, jnp.int32)
    held = (self.device - step) % self.schedule.num_shards
    return order_NT[self.device], order_NT[held]

  def _unless_empty(self, step, carry, compute):
    """`compute()`, or `carry` where this step's block pair has nothing visible. Only
    layouts with such pairs (ring) pay for the conditional; striped and zigzag have none."""
    if not self.schedule.empty.any():
      return compute()
    return lax.cond(self.empty_S[step], lambda: carry, compute)

  def forward_step(self, step, out_lse, q_BTHD, k_BTKD, v_BTKD, mask: Mask):
    """The (out, lse) of the queries on this step's K/V block (its key side in `mask`),
    merged into `out_lse`; at step 0 (`out_lse` None) the own block's (out, lse). A block
    pair with nothing visible skips the kernel and the merge."""
    attend = lambda: self.kernel.fwd(q_BTHD, k_BTKD, v_BTKD, mask, schedule=self.schedule,
                                     pair=self.pair_S[step], tile=self.tile,
                                     index=self._index(step, mask))
    if out_lse is None:
      return attend()  # a query always sees itself: the own block is never empty
    return self._unless_empty(step, out_lse, lambda: merge(*out_lse, *attend()))

  def backward_step(self, step, q_side, q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged):
    """At step 0 (`q_side` None) the kernel's `Grads`; after it, (`q_side` with this step's
    block's contributions added (`query_side`), the block's own key side (`key_side_grads`;
    zeros where the pair has nothing visible)). The key side comes back apart, for the
    caller to add: the ring's accumulator is still in flight while the kernels run."""
    grads = lambda: self.kernel.bwd(q_BTHD, k_BTKD, v_BTKD, mask, merged,
                                    schedule=self.schedule, pair=self.pair_S[step],
                                    tile=self.tile, index=self._index(step, mask))
    if q_side is None:
      return grads()

    def add():
      g = grads()
      return _add(q_side, query_side(g)), key_side_grads(g)

    if not self.schedule.empty.any():
      return add()
    nothing = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(add)[1])
    return lax.cond(self.empty_S[step], lambda: (q_side, nothing), add)


def query_side(g: Grads):
  """What stays with the queries: (dq, SparseK's thresholds' gradient or None)."""
  return g.dq, g.dq_scores


def key_side_grads(g: Grads):
  """What travels with K/V: (dK/dV [2, B, T, Hkv, D], SparseK's scores' gradient or None)."""
  return jnp.stack([g.dk, g.dv]), g.dk_scores


def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


def blocks(k_BTKD, v_BTKD, k_side: Side):
  """What travels the ring: K/V, then the keys' run-time operands (`Side.travelling`)."""
  return (k_BTKD, v_BTKD, *jax.tree.leaves(k_side.travelling()))


def key_side(block, mask: Mask):
  """(k, v, `mask` with the key side of the block `blocks` made from its own keys)."""
  k_BTKD, v_BTKD, *operands = block
  k_side = jax.tree.unflatten(jax.tree.structure(mask.k.travelling()), operands)
  return k_BTKD, v_BTKD, dataclasses.replace(mask, k=k_side)


def device_index(axis: str, num_shards: int):
  return lax.axis_index(axis) if num_shards > 1 else 0


def own_index(schedule: RingSchedule, device):
  """[T] int32: the original positions of the device's own block."""
  return jnp.asarray(schedule.order, jnp.int32)[device]


def forward_pass(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, axis: str, schedule: RingSchedule,
                 tile: int, kernel: str):
  """Per-device forward ring: returns (out f32 [B,T,Hq,D], lse f32 [B,T,Hq]); `mask` is this
  device's (`parallelism.masks`), its key side travelling with K/V. Run-time codes sort
  queries and keys first (`parallelism.sorting`: the keys travel sorted), and the results
  are unsorted once at the end."""
  device = device_index(axis, schedule.num_shards)
  ring = RingDevice(schedule, device, kernel, tile)
  q_BTHD, k_BTKD, v_BTKD, mask, q_order, _ = sorting.sort_device(
      q_BTHD, k_BTKD, v_BTKD, mask, own_index(schedule, device))

  def step(s, out_lse, *block):
    return ring.forward_step(s, out_lse, q_BTHD, *key_side(block, mask))

  with jax.named_scope("ring_forward"):  # how tests find its collectives in compiled HLO
    out_lse = around_ring(blocks(k_BTKD, v_BTKD, mask.k), functools.partial(step, 0, None),
                          lambda carry, s, *block: step(s, carry, *block), axis=axis,
                          schedule=schedule)
  return sorting.unsorted(out_lse, q_order)


def backward_pass(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, axis: str,
                  schedule: RingSchedule, tile: int, kernel: str) -> Grads:
  """Per-device backward ring: the `Grads` of this device's blocks, float32 (sorted and
  unsorted as `forward_pass`; dK/dV come home in their owner's order)."""
  num_shards = schedule.num_shards
  device = device_index(axis, num_shards)
  ring = RingDevice(schedule, device, kernel, tile)
  q_BTHD, k_BTKD, v_BTKD, mask, q_order, k_order = sorting.sort_device(
      q_BTHD, k_BTKD, v_BTKD, mask, own_index(schedule, device))
  merged = Merged(*sorting.sorted_like(merged, q_order))

  def step(s, q_side, *block):
    return ring.backward_step(s, q_side, q_BTHD, *key_side(block, mask), merged)

  def start(*own):
    # The own block's key side (dK/dV, with SparseK the scores' gradient) starts the
    # accumulator that follows the block around the ring and home.
    grads = step(0, None, *own)
    return query_side(grads), key_side_grads(grads)

  def visit(carry, s, *block):
    q_side, travelling = carry
    if cut_short(schedule):
      # The block came straight from device d - s: its key side goes straight back, summed
      # there with the own block's and those of the other steps.
      q_side, side_s = step(s, q_side, *block)
      return q_side, _add(travelling, lax.ppermute(side_s, axis, shifted(-s, num_shards)))
    # dK/dV travel one step behind their K/V block: the accumulator the last step added to
    # is sent on now, in flight while this step's kernels run, and this step's share is
    # added once it has arrived. Sent after the kernels instead, it had nothing to overlap
    # under `ring` (its empty pairs' conditional waits for it) and only the dq kernel
    # under striped and zigzag (parallelism/overlap.py reads the compiled schedule).
    arrived = lax.ppermute(travelling, axis, shifted(1, num_shards))
    q_side, side_s = step(s, q_side, *block)
    return q_side, _add(arrived, side_s)

  (dq_BTHD, dq_scores), travelling = around_ring(
      blocks(k_BTKD, v_BTKD, mask.k), start, visit, axis=axis, schedule=schedule)
  if num_shards > 1 and not cut_short(schedule):
    # The last hop home: the accumulator has met all N devices, so it makes N hops, one
    # more than one started empty on the next device would, each but this one hidden.
    with jax.named_scope(HOME_HOP):  # how parallelism.overlap tells it from the steps'
      travelling = lax.ppermute(travelling, axis, shifted(1, num_shards))
  dkv_2BTKD, dk_scores = travelling
  dq_BTHD, = sorting.unsorted((dq_BTHD,), q_order)
  dk_BTKD, dv_BTKD = sorting.unsorted((dkv_2BTKD[0], dkv_2BTKD[1]), k_order)
  return Grads(dq_BTHD, dk_BTKD, dv_BTKD, dq_scores, dk_scores)
