"""One device's passes of ring attention: its K/V block goes around a ring of devices.

Each device keeps its query block and passes its K/V block (and the keys' segment ids when
documents are packed, in one buffer) around the ring with `lax.ppermute`; after N steps
every query block has met every key block. With hash attention the keys' bucket codes travel
in the same buffer, with SparseK the keys' scores (and their gradient with dK/dV). The next
transfer is issued before the current block is computed so communication can overlap compute.
Partial (out, lse) pairs merge by the stable log-sum-exp rule.

What each device computes at each step is the layout's static schedule
(`parallelism.schedule`): the ring looks up its block pair in a small table by device and
step, skips the kernel for a pair with nothing to compute, and hands the pair to the block
kernel (`parallelism.kernels`), which reads the pair's tile lists.

The backward is a second ring pass that recomputes each block's probabilities from the
global output and lse. A device keeps the dK/dV of its own block; the accumulators of the
others travel with their K/V block and, after N - 1 hops, arrive back at the device that
owns it.

A ring cut short: where the schedule has steps at which no device computes anything (a
sliding window under `ring` or `zigzag`: `RingSchedule.needed_steps`), only the steps it
needs run, and each of their K/V blocks is sent straight to the device that needs it
(`ppermute` by its shift, one transfer, not s hops); in the backward its dK/dV go straight
back the same way. These functions run inside a shard_map (`parallelism.ring_attention`);
the other strategies (`parallelism.strategies`) reuse `RingDevice` and the merge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import kernels
from parallelism.schedule import RingSchedule


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
  block it holds, so the compute can overlap it; the last needs none. A ring cut short
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
    kv_bytes_next = lax.ppermute(kv_bytes, axis, perm) if send else kv_bytes
    return visit(carry, s, *unpack(kv_bytes, own)), kv_bytes_next

  state = (start(*own), lax.ppermute(pack(*own), axis, perm))
  state = lax.fori_loop(1, num_shards - 1, lambda s, st: step(s, st, True), state)
  return step(num_shards - 1, state, False)[0]


class RingDevice:
  """One device of the ring: its block pair at each step, looked up in the schedule's table
  by device index, and one step of each pass on it. `device` is traced inside the ring
  (`lax.axis_index`); scripts/bench_attention.py passes it as a jitted argument to time
  the steps one by one."""

  def __init__(self, schedule: RingSchedule, device, kernel: str, tile: int,
               softcap: float = 0.0, spans_H=None, sparsek_window: int | None = None):
    self.schedule, self.tile, self.kernel = schedule, tile, kernels.KERNELS[kernel]
    # Per-head spans and SparseK's window reach the kernels only when given (the cudnn
    # kernel takes neither).
    self.options = (dict(softcap=softcap) | ({} if spans_H is None else dict(spans_H=spans_H))
                    | ({} if sparsek_window is None else dict(sparsek_window=sparsek_window)))
    self.pair_S = jnp.asarray(schedule.pair)[device]
    self.empty_S = jnp.asarray(schedule.empty)[device]
    self.device, self.sparsek = device, sparsek_window is not None

  def _step_options(self, step) -> dict:
    """The kernel's options at `step`: with SparseK also the token indices of this device's
    query block and of the K/V block it holds (its window depends on their distance, which a
    schedule's representative pair does not keep)."""
    if not self.sparsek:
      return self.options
    order_NT = jnp.asarray(self.schedule.order, jnp.int32)
    held = (self.device - step) % self.schedule.num_shards
    return self.options | dict(sparsek_index=(order_NT[self.device], order_NT[held]))

  def _unless_empty(self, step, carry, compute):
    """`compute()`, or `carry` where this step's block pair has nothing visible. Only
    layouts with such pairs (ring) pay for the conditional; striped and zigzag have none."""
    if not self.schedule.empty.any():
      return compute()
    return lax.cond(self.empty_S[step], lambda: carry, compute)

  def forward_step(self, step, out_lse, q_BTHD, k_BTKD, v_BTKD, q_seg_BT, k_seg_BT,
                   codes=None):
    """The (out, lse) of the queries on this step's K/V block, merged into `out_lse`; at
    step 0 (`out_lse` None) the own block's (out, lse). A block pair with nothing visible
    skips the kernel and the merge. `codes`: (the queries', this block's keys') bucket codes
    of hash attention, or None."""
    attend = lambda: self.kernel.fwd(q_BTHD, k_BTKD, v_BTKD, q_seg_BT, k_seg_BT,
                                     schedule=self.schedule, pair=self.pair_S[step],
                                     tile=self.tile, **self._step_options(step),
                                     **_code_args(codes))
    if out_lse is None:
      return attend()  # a query always sees itself: the own block is never empty
    return self._unless_empty(step, out_lse, lambda: merge(*out_lse, *attend()))

  def backward_step(self, step, dq_dkv, q_BTHD, k_BTKD, v_BTKD, out_BTHD, dout_BTHD, lse_BTH,
                    delta_BTH, q_seg_BT, k_seg_BT, codes=None):
    """At step 0 (`dq_dkv` None) the kernel's gradients (dq, dk, dv[, dtau, du]); after
    it, (query side, key side) (`query_grads`, `key_grads`) with this step's block's
    contributions added."""
    grads = lambda: self.kernel.bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH,
                                    q_seg_BT, k_seg_BT, schedule=self.schedule,
                                    pair=self.pair_S[step], tile=self.tile, out_BTHD=out_BTHD,
                                    **self._step_options(step), **_code_args(codes))
    if dq_dkv is None:
      return grads()

    def add():
      g = grads()
      return _add(dq_dkv[0], query_grads(g)), _add(dq_dkv[1], key_grads(g))

    return self._unless_empty(step, dq_dkv, add)


def query_grads(grads):
  """The query side of a kernel's gradients: dq, or (dq, dtau) with SparseK."""
  return grads[0] if len(grads) == 3 else (grads[0], grads[3])


def key_grads(grads):
  """The key side, what travels with K/V: dK/dV [2, B, T, Hkv, D], or (it, du) with SparseK."""
  dkv_2BTKD = jnp.stack([grads[1], grads[2]])
  return dkv_2BTKD if len(grads) == 3 else (dkv_2BTKD, grads[4])


def _add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _code_args(codes) -> dict:
  """The block kernels' bucket-code arguments: only with hash attention (`parallelism.kernels`)."""
  return {} if codes is None else dict(q_codes_BTH=codes[0], k_codes_BTK=codes[1])


def blocks(k_BTKD, v_BTKD, seg_BT, k_codes_BTK=None):
  """What travels the ring: K/V, then the keys' segment ids only when documents are packed
  and their bucket codes only with hash attention (run-time masks both, as the keys')."""
  return (k_BTKD, v_BTKD, *(x for x in (seg_BT, k_codes_BTK) if x is not None))


def key_side(block, packed: bool, hashed: bool):
  """(k, v, segment ids or None, bucket codes or None) of a block `blocks` made."""
  k_BTKD, v_BTKD, *rest = block
  seg_BT = rest.pop(0) if packed else None
  return k_BTKD, v_BTKD, seg_BT, rest.pop(0) if hashed else None


def _with_keys(codes, k_codes_BTK):
  """(the queries', a held block's keys') codes; None without hash attention."""
  return None if codes is None else (codes[0], k_codes_BTK)


def softmax_delta(dout_BTHD, out_BTHD):
  """`delta = sum(dout * out, -1)` of the global output, float32: what every block's
  backward subtracts (the kernels' contract)."""
  return jnp.sum(dout_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1)


def device_index(axis: str, num_shards: int):
  return lax.axis_index(axis) if num_shards > 1 else 0


def forward_pass(q_BTHD, k_BTKD, v_BTKD, seg_BT, *, axis: str, schedule: RingSchedule,
                 tile: int, kernel: str, softcap: float = 0.0, spans_H=None, codes=None,
                 sparsek_window: int | None = None):
  """Per-device forward ring: returns (out f32 [B,T,Hq,D], lse f32 [B,T,Hq]); `spans_H`: this
  device's query heads' spans ([Hq] int32), or None; `codes`: the bucket codes of hash
  attention, (queries' [B,T,Hq], keys' [B,T,Hkv]) int32, or None (the keys' travel); with
  `sparsek_window`, SparseK's (thresholds, scores) float32 instead."""
  ring = RingDevice(schedule, device_index(axis, schedule.num_shards), kernel, tile, softcap,
                    spans_H, sparsek_window)

  def step(s, out_lse, *block):
    k_b, v_b, seg_b, k_codes_b = key_side(block, seg_BT is not None, codes is not None)
    return ring.forward_step(s, out_lse, q_BTHD, k_b, v_b, seg_BT, seg_b,
                             _with_keys(codes, k_codes_b))

  own = blocks(k_BTKD, v_BTKD, seg_BT, None if codes is None else codes[1])
  with jax.named_scope("ring_forward"):  # how tests find its collectives in compiled HLO
    return around_ring(own, functools.partial(step, 0, None),
                       lambda carry, s, *block: step(s, carry, *block), axis=axis,
                       schedule=schedule)


def backward_pass(q_BTHD, k_BTKD, v_BTKD, seg_BT, out_BTHD, lse_BTH, dout_BTHD, *, axis: str,
                  schedule: RingSchedule, tile: int, kernel: str, softcap: float = 0.0,
                  spans_H=None, codes=None, sparsek_window: int | None = None):
  """Per-device backward ring: returns (dq, dk, dv) in float32, and with SparseK the
  thresholds' and scores' gradients (dtau, du) after them."""
  num_shards = schedule.num_shards
  ring = RingDevice(schedule, device_index(axis, num_shards), kernel, tile, softcap, spans_H,
                    sparsek_window)
  delta_BTH = softmax_delta(dout_BTHD, out_BTHD)

  def step(s, carry, *block):
    k_b, v_b, seg_b, k_codes_b = key_side(block, seg_BT is not None, codes is not None)
    return ring.backward_step(s, carry, q_BTHD, k_b, v_b, out_BTHD, dout_BTHD, lse_BTH,
                              delta_BTH, seg_BT, seg_b, _with_keys(codes, k_codes_b))

  def start(*own):
    # The own block's dK/dV (and with SparseK the scores' gradient: the key side) stay
    # here; the accumulator that travels (with the block this device sees next) starts
    # empty, so the others make N - 1 hops, not N.
    grads = step(0, None, *own)
    own_side = key_grads(grads)
    return query_grads(grads), own_side, jax.tree.map(jnp.zeros_like, own_side)

  def visit(carry, s, *block):
    dq, own_side, travelling = carry
    if cut_short(schedule):
      # The block came straight from device d - s: its dK/dV go straight back, summed
      # there with those of the other steps (`travelling` holds what came home).
      dq, side_s = step(s, (dq, jax.tree.map(jnp.zeros_like, travelling)), *block)
      home = lax.ppermute(side_s, axis, shifted(-s, num_shards))
      return dq, own_side, _add(travelling, home)
    dq, travelling = step(s, (dq, travelling), *block)
    # The accumulator follows its K/V block, one hop after each step; after the last step
    # that hop takes it home to the block's owner.
    return dq, own_side, lax.ppermute(travelling, axis, shifted(1, num_shards))

  dq, own_side, travelling = around_ring(
      blocks(k_BTKD, v_BTKD, seg_BT, None if codes is None else codes[1]), start, visit,
      axis=axis, schedule=schedule)
  if sparsek_window is None:
    dkv_2BTKD = own_side + travelling
    return dq, dkv_2BTKD[0], dkv_2BTKD[1]
  (dkv_2BTKD, du_BTK), (dq_BTHD, dtau_BTH) = _add(own_side, travelling), dq
  return dq_BTHD, dkv_2BTKD[0], dkv_2BTKD[1], dtau_BTH, du_BTK
