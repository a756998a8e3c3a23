"""How attention splits the sequence over devices: one device's passes under each strategy.

`model.sequence_parallel` picks one; every strategy takes every layout (the layout is the
order the data pipeline permuted the tokens into, the strategy how devices exchange them):

- `ring` (default): K/V blocks travel a ring of the `sequence` devices (`parallelism.ring`);
  memory per device stays one block, traffic overlaps compute.
- `allgather`: every device gathers all K/V blocks with one all-gather over `sequence`,
  computes its queries against them in the ring's order and schedule, and in the backward
  sends each block's dK/dV home with one reduce-scatter (Llama 3's context parallelism).
  It holds the whole sequence's K/V (small under GQA) and, in the backward, float32 dK/dV
  for the whole sequence (twice the bytes of bf16 K/V), and trades N - 1 latency-bound
  hops for one collective.
- `ulysses`: an all-to-all over the `ulysses` axis turns each device's sequence shard of
  every head into the whole sequence of a shard of the heads (DeepSpeed Ulysses);
  attention runs locally; a second all-to-all turns the output back. Balanced by heads, so
  the layout changes nothing (a ring of one device holds the tokens unpermuted).
- `hybrid`: Ulysses over the `ulysses` axis (inside a node) times a ring over `sequence`
  (across nodes): the all-to-all gathers a whole ring block of a head shard, and that
  block goes around the ring in the layout's order.

Under Ulysses K/V heads that do not divide by the degree are repeated first (`kv_repeat`)
and the backward sums the copies' gradients. Each method runs per device inside the
shard_map of `parallelism.ring_attention` and returns float32 (out, lse) or (dq, dk, dv).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from parallelism import ring, sorting
from parallelism.kernels import Grads, Merged
from parallelism.masks import Mask, Side
from parallelism.schedule import RingSchedule

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
# Strategies whose all-to-all runs over a second sequence axis (the rules' activation_seq
# maps to (ring axis, Ulysses axis)).
ULYSSES = ("ulysses", "hybrid")


def splits(devices: int, heads: int) -> list[tuple[str, int, int]]:
  """(strategy, ring, Ulysses degree) ways to split one row's sequence over `devices`, for
  `heads` query heads per device (after `tensor`): Ulysses degrees must divide them."""
  out = [("ring", devices, 1), ("allgather", devices, 1)]
  for ulysses in range(2, devices + 1):
    if devices % ulysses == 0 and heads % ulysses == 0:
      out.append(("ulysses", 1, ulysses) if ulysses == devices
                 else ("hybrid", devices // ulysses, ulysses))
  return out


def kv_repeat(num_kv_heads: int, ulysses: int) -> int:
  """How many copies of each K/V head Ulysses needs so that the heads split evenly."""
  return ulysses // math.gcd(num_kv_heads, ulysses)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One device's side of a strategy; static (part of the traced program's identity)."""
  name: str
  schedule: RingSchedule  # of the ring over `axis` (of one device under `ulysses`)
  axis: str  # the ring's mesh axis (the all-gather's under `allgather`)
  tile: int
  kernel: str  # the block kernel that runs (`parallelism.kernels.choose`)
  ulysses_axis: str | None = None
  kv_repeat: int = 1
  kernel_fallback: str | None = None  # why `kernel` is not the one the setup named

  def forward(self, q_BTHD, k_BTKD, v_BTKD, mask: Mask):
    """(out, lse) of this device's queries, float32; out [B,T,Hq,D], lse [B,T,Hq]; `mask`
    this device's operands (`parallelism.masks`).

    Under Ulysses the ring runs on L = T x U tokens (the ring block) of h = Hq / U query
    and k = Hkv x repeat / U key/value heads."""
    if self.ulysses_axis is None:
      run = _gathered_forward_pass if self._gathers else ring.forward_pass
      return run(q_BTHD, k_BTKD, v_BTKD, mask, **self._ring_args())
    q_BLhD = self._to_heads(q_BTHD)
    k_BLkD, v_BLkD = (self._to_heads(self._repeat(x)) for x in (k_BTKD, v_BTKD))
    out_BLhD, lse_BLh = ring.forward_pass(q_BLhD, k_BLkD, v_BLkD, self._mask_to_heads(mask),
                                          **self._ring_args())
    # The output moves in q's dtype (half the bytes at bf16); it is cast to it anyway.
    out_BTHD = self._to_sequence(out_BLhD.astype(q_BTHD.dtype)).astype(jnp.float32)
    return out_BTHD, self._to_sequence(lse_BLh)

  def backward(self, q_BTHD, k_BTKD, v_BTKD, mask: Mask, out_BTHD, lse_BTH,
               dout_BTHD) -> Grads:
    """The gradients of this device's blocks, float32 (shapes as in `forward`)."""
    if self.ulysses_axis is None:
      run = _gathered_backward_pass if self._gathers else ring.backward_pass
      return run(q_BTHD, k_BTKD, v_BTKD, mask, Merged.of(out_BTHD, lse_BTH, dout_BTHD),
                 **self._ring_args())
    k_BLkD, v_BLkD = (self._to_heads(self._repeat(x)) for x in (k_BTKD, v_BTKD))
    q_BLhD, out_BLhD, lse_BLh, dout_BLhD = map(self._to_heads,
                                               (q_BTHD, out_BTHD, lse_BTH, dout_BTHD))
    g = ring.backward_pass(q_BLhD, k_BLkD, v_BLkD, self._mask_to_heads(mask),
                           Merged.of(out_BLhD, lse_BLh, dout_BLhD), **self._ring_args())
    # Each moves in its input's dtype (half the bytes at bf16), cast to it anyway, except
    # the dK/dV of repeated heads: their copies are summed after the move, in float32, so
    # that they are rounded once, as the ring rounds them.
    kv_dtype = jnp.float32 if self.kv_repeat > 1 else k_BTKD.dtype
    dq_BTHD, dk_BTKD, dv_BTKD = (
        self._to_sequence(x.astype(dtype)).astype(jnp.float32)
        for x, dtype in ((g.dq, q_BTHD.dtype), (g.dk, kv_dtype), (g.dv, kv_dtype)))
    return Grads(dq_BTHD, self._sum_copies(dk_BTKD), self._sum_copies(dv_BTKD))

  @property
  def _gathers(self) -> bool:
    """All-gather K/V: `allgather` with more than one device (one device is a ring of one)."""
    return self.name == "allgather" and self.schedule.num_shards > 1

  def _ring_args(self) -> dict:
    return dict(axis=self.axis, schedule=self.schedule, tile=self.tile, kernel=self.kernel)

  def _mask_to_heads(self, mask: Mask) -> Mask:
    """The mask's operands as `_to_heads` moves q and (repeated) k: per-head ones like lse,
    segment ids gathered over the ring block, spans of this device's head shard."""
    def side(s: Side, per_head) -> Side:
      return Side(self._whole_block(s.segment_ids), self._whole_block(s.positions),
                  *(None if x is None else self._to_heads(per_head(x)) for x in (s.codes,
                                                                                 s.scores)),
                  self._head_shard(s.spans))
    return Mask(mask.spec, side(mask.q, lambda x: x), side(mask.k, self._repeat))

  def _head_shard(self, spans_H):
    """The spans of the query heads `_to_heads` leaves this device (its Ulysses shard)."""
    if spans_H is None:
      return None
    size = spans_H.shape[0] // lax.axis_size(self.ulysses_axis)
    return lax.dynamic_slice_in_dim(spans_H, lax.axis_index(self.ulysses_axis) * size, size)

  def _to_heads(self, x_BTH):
    """[B, T, H, ...] sequence shard of all heads -> [B, T x U, H / U, ...]: the ring block
    of a head shard (the received shards concatenate in the Ulysses axis's order, which is
    the sequence's: `activation_seq` puts the ring axis first, the Ulysses axis second)."""
    return lax.all_to_all(x_BTH, self.ulysses_axis, split_axis=2, concat_axis=1, tiled=True)

  def _to_sequence(self, x_BTH):
    """Inverse of `_to_heads`."""
    return lax.all_to_all(x_BTH, self.ulysses_axis, split_axis=1, concat_axis=2, tiled=True)

  def _whole_block(self, x_BT):
    """A per-token [B, T] operand of the ring block: every Ulysses device's shard, gathered
    in order."""
    if x_BT is None:
      return None
    return lax.all_gather(x_BT, self.ulysses_axis, axis=1, tiled=True)

  def _repeat(self, x_BTKD):
    return x_BTKD if self.kv_repeat == 1 else jnp.repeat(x_BTKD, self.kv_repeat, axis=2)

  def _sum_copies(self, dx_BTKD):
    if self.kv_repeat == 1:
      return dx_BTKD
    batch, length, heads, head_dim = dx_BTKD.shape
    return dx_BTKD.reshape(batch, length, heads // self.kv_repeat, self.kv_repeat,
                           head_dim).sum(axis=3)


def _every_block(k_BTKD, v_BTKD, mask: Mask, axis: str):
  """All devices' K/V blocks (with their keys' operands), gathered as bytes in one
  collective, and a function returning block b of them (traced b) as (k, v, the mask with
  block b's key side)."""
  own = ring.blocks(k_BTKD, v_BTKD, mask.k)
  every = lax.all_gather(ring.pack(*own), axis)  # [N, bytes]

  def block(b):
    return ring.key_side(ring.unpack(lax.dynamic_index_in_dim(every, b, keepdims=False), own),
                         mask)

  return block


def _over_needed_steps(schedule: RingSchedule, visit, carry):
  """`visit(step, carry)` over the ring steps after 0 at which some device has work."""
  steps = jnp.asarray(schedule.needed_steps, jnp.int32)
  return lax.fori_loop(1, steps.shape[0], lambda i, c: visit(steps[i], c), carry)


def _gathered_forward_pass(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, axis: str,
                           schedule: RingSchedule, tile: int, kernel: str):
  """All-gather forward: the ring's steps in order, each block read from the gathered K/V
  (sorted first with run-time codes, as the ring's)."""
  num_shards = schedule.num_shards
  device = lax.axis_index(axis)
  runner = ring.RingDevice(schedule, device, kernel, tile)
  q_BTHD, k_BTKD, v_BTKD, mask, q_order, _ = sorting.sort_device(
      q_BTHD, k_BTKD, v_BTKD, mask, ring.own_index(schedule, device))
  block = _every_block(k_BTKD, v_BTKD, mask, axis)

  def visit(step, out_lse):
    k_b, v_b, mask_b = block((device - step) % num_shards)  # schedule.held_block
    return runner.forward_step(step, out_lse, q_BTHD, k_b, v_b, mask_b)

  out_lse = runner.forward_step(0, None, q_BTHD, k_BTKD, v_BTKD, mask)
  return sorting.unsorted(_over_needed_steps(schedule, visit, out_lse), q_order)


def _gathered_backward_pass(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, axis: str,
                            schedule: RingSchedule, tile: int, kernel: str) -> Grads:
  """All-gather backward: dK/dV of every block accumulate here, then one reduce-scatter
  sends each block's sum to its owner."""
  num_shards = schedule.num_shards
  device = lax.axis_index(axis)
  runner = ring.RingDevice(schedule, device, kernel, tile)
  q_BTHD, k_BTKD, v_BTKD, mask, q_order, k_order = sorting.sort_device(
      q_BTHD, k_BTKD, v_BTKD, mask, ring.own_index(schedule, device))
  merged = Merged(*sorting.sorted_like(merged, q_order))
  block = _every_block(k_BTKD, v_BTKD, mask, axis)
  grads = lambda step, carry, k_b, v_b, mask_b: runner.backward_step(
      step, carry, q_BTHD, k_b, v_b, mask_b, merged)

  def visit(step, carry):
    dq_BTHD, dkv_N2BTKD = carry
    held = (device - step) % num_shards
    (dq_BTHD, _), (dkv_2BTKD, _) = grads(step, (dq_BTHD, None), *block(held))
    return dq_BTHD, lax.dynamic_update_index_in_dim(dkv_N2BTKD, dkv_N2BTKD[held] + dkv_2BTKD,
                                                    held, 0)

  own = grads(0, None, k_BTKD, v_BTKD, mask)
  # The own block's slot stays zero: its dK/dV are the ones just computed.
  dkv_N2BTKD = jnp.zeros((num_shards, 2, *k_BTKD.shape), jnp.float32)
  dq_BTHD, dkv_N2BTKD = _over_needed_steps(schedule, visit, (own.dq, dkv_N2BTKD))
  dkv_2BTKD = lax.psum_scatter(dkv_N2BTKD, axis, scatter_dimension=0, tiled=False)
  dq_BTHD, = sorting.unsorted((dq_BTHD,), q_order)
  return Grads(dq_BTHD, *sorting.unsorted((own.dk + dkv_2BTKD[0], own.dv + dkv_2BTKD[1]),
                                          k_order))
