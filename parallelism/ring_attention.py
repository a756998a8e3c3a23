"""Exact causal attention over a sequence sharded on one mesh axis, by a ring of K/V blocks.

Each device keeps its query block and passes its K/V block (and the keys' segment ids when
documents are packed, in one buffer) around the ring with `lax.ppermute`; after N steps
every query block has met every key block. The next transfer is issued before the current
block is computed so communication can overlap compute. Partial (out, lse) pairs merge by
the stable log-sum-exp rule.

What each device computes at each step is the layout's static schedule
(`parallelism.schedule`), built on the host once per compile: the ring looks up its block
pair in a small table by device and step, skips the kernel for a pair with nothing to
compute, and hands the pair to the block kernel (`parallelism.kernels`), which reads the
pair's tile lists. No token index is traced, travels or is compared at run time.

The shard_map's specs come from the same rules table as the activations around the call
(logical names `activation_batch`, `activation_seq`, `activation_heads`,
`activation_kv_heads`), so a change of `mesh.rules` moves both together and adds no reshard.
`activation_seq` names the ring's mesh axis.

The gradient is a `jax.custom_vjp` around the sharded passes: the forward saves its inputs
plus the global output and lse, named `attention_out` and `attention_lse` for remat
policies; the backward is a second ring pass (its own shard_map) that recomputes each
block's probabilities from them. A device keeps the
dK/dV of its own block; the accumulators of the others travel with their K/V block and,
after N - 1 hops, arrive back at the device that owns it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parallelism import kernels
from parallelism.layouts import check_seq_len, required_divisor
from parallelism.mesh import Rules, as_axes, logical_to_spec, spec_on_mesh
from parallelism.schedule import RingSchedule, ring_schedule

Q_NAMES = ("activation_batch", "activation_seq", "activation_heads", None)
KV_NAMES = ("activation_batch", "activation_seq", "activation_kv_heads", None)
SEGMENT_NAMES = ("activation_batch", "activation_seq")
# Without a rules table: the sequence over the `sequence` axis, everything else replicated.
DEFAULT_RULES = (("activation_seq", "sequence"),)
# What the backward needs from the forward; a remat policy that saves these by name keeps
# the backward from running the ring forward again.
SAVED_NAMES = ("attention_out", "attention_lse")


def _merge(out_a_BTHD, lse_a_BTH, out_b_BTHD, lse_b_BTH):
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


def _pack(*arrays):
  """Arrays as one flat byte buffer, so a K/V block (and its segment ids) moves in one transfer.

  Each transfer is a rendezvous of both neighbours (on CPU also a round trip through the
  collectives library, measured 2.5 ms for K/V alone and 4.0 ms with a second array).
  Bytes are moved, never converted, so the trip is exact for every dtype of one byte or more.
  """
  return jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in arrays])


def _unpack(buffer, like):
  """Inverse of `_pack`: arrays with the shapes and dtypes of `like`."""
  arrays, start = [], 0
  for x in like:
    size = x.size * x.dtype.itemsize
    raw = lax.slice_in_dim(buffer, start, start + size)
    raw = raw.reshape(x.shape + ((x.dtype.itemsize,) if x.dtype.itemsize > 1 else ()))
    arrays.append(lax.bitcast_convert_type(raw, x.dtype))
    start += size
  return tuple(arrays)


def _around_ring(own, start, visit, *, axis: str, num_shards: int):
  """The ring's step loop, the same for both passes; returns the last carry.

  Step 0 is `start(*own)` on the device's own block (k, v and, when packed, segment ids),
  giving the first carry. Steps s = 1..N-1 are `visit(carry, s, *block)` on the block that
  arrived, the one that started on device d - s. Each step first issues the transfer of the
  block it holds, so the compute can overlap it; the last needs none.
  """
  if num_shards == 1:
    return start(*own)
  perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]

  def step(s, state, send: bool):
    carry, kv_bytes = state
    kv_bytes_next = lax.ppermute(kv_bytes, axis, perm) if send else kv_bytes
    return visit(carry, s, *_unpack(kv_bytes, own)), kv_bytes_next

  state = (start(*own), lax.ppermute(_pack(*own), axis, perm))
  state = lax.fori_loop(1, num_shards - 1, lambda s, st: step(s, st, True), state)
  return step(num_shards - 1, state, False)[0]


class RingDevice:
  """One device of the ring: its block pair at each step, looked up in the schedule's table
  by device index, and one step of each pass on it. `device` is traced inside the ring
  (`lax.axis_index`); scripts/bench_attention.py passes it as a jitted argument to time
  the steps one by one."""

  def __init__(self, schedule: RingSchedule, device, kernel: str, tile: int):
    self.schedule, self.tile, self.kernel = schedule, tile, kernels.get(kernel)
    self.pair_S = jnp.asarray(schedule.pair)[device]
    self.empty_S = jnp.asarray(schedule.empty)[device]

  def _unless_empty(self, step, carry, compute):
    """`compute()`, or `carry` where this step's block pair has nothing visible. Only
    layouts with such pairs (ring) pay for the conditional; striped and zigzag have none."""
    if not self.schedule.empty.any():
      return compute()
    return lax.cond(self.empty_S[step], lambda: carry, compute)

  def forward_step(self, step, out_lse, q_BTHD, k_BTKD, v_BTKD, q_seg_BT, k_seg_BT):
    """The (out, lse) of the queries on this step's K/V block, merged into `out_lse`; at
    step 0 (`out_lse` None) the own block's (out, lse). A block pair with nothing visible
    skips the kernel and the merge."""
    attend = lambda: self.kernel.fwd(q_BTHD, k_BTKD, v_BTKD, q_seg_BT, k_seg_BT,
                                     schedule=self.schedule, pair=self.pair_S[step],
                                     tile=self.tile)
    if out_lse is None:
      return attend()  # a query always sees itself: the own block is never empty
    return self._unless_empty(step, out_lse, lambda: _merge(*out_lse, *attend()))

  def backward_step(self, step, dq_dkv, q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH,
                    q_seg_BT, k_seg_BT):
    """At step 0 (`dq_dkv` None) the own block's (dq, dk, dv); after it, (dq, dK/dV
    accumulator [2, B, T, Hkv, D]) with this step's block's contributions added."""
    grads = lambda: self.kernel.bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH,
                                    q_seg_BT, k_seg_BT, schedule=self.schedule,
                                    pair=self.pair_S[step], tile=self.tile)
    if dq_dkv is None:
      return grads()

    def add():
      dq_b, dk_b, dv_b = grads()
      return dq_dkv[0] + dq_b, dq_dkv[1] + jnp.stack([dk_b, dv_b])

    return self._unless_empty(step, dq_dkv, add)


def _blocks(k_BTKD, v_BTKD, seg_BT):
  """What travels the ring: K/V, and the keys' segment ids only when documents are packed."""
  return (k_BTKD, v_BTKD) if seg_BT is None else (k_BTKD, v_BTKD, seg_BT)


def _device(axis: str, num_shards: int):
  return lax.axis_index(axis) if num_shards > 1 else 0


def _ring_fwd_pass(q_BTHD, k_BTKD, v_BTKD, seg_BT, *, axis: str, schedule: RingSchedule,
                   tile: int, kernel: str):
  """Per-device forward ring: returns (out f32 [B,T,Hq,D], lse f32 [B,T,Hq])."""
  ring = RingDevice(schedule, _device(axis, schedule.num_shards), kernel, tile)
  step = lambda s, out_lse, k_b, v_b, *seg_b: ring.forward_step(
      s, out_lse, q_BTHD, k_b, v_b, seg_BT, seg_b[0] if seg_b else None)
  with jax.named_scope("ring_forward"):  # how tests find its collectives in compiled HLO
    return _around_ring(_blocks(k_BTKD, v_BTKD, seg_BT), functools.partial(step, 0, None),
                        lambda carry, s, *block: step(s, carry, *block), axis=axis,
                        num_shards=schedule.num_shards)


def _ring_bwd_pass(q_BTHD, k_BTKD, v_BTKD, seg_BT, out_BTHD, lse_BTH, dout_BTHD, *, axis: str,
                   schedule: RingSchedule, tile: int, kernel: str):
  """Per-device backward ring: returns (dq, dk, dv) in float32."""
  num_shards = schedule.num_shards
  perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]
  ring = RingDevice(schedule, _device(axis, num_shards), kernel, tile)
  delta_BTH = jnp.sum(dout_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1)
  step = lambda s, carry, k_b, v_b, *seg_b: ring.backward_step(
      s, carry, q_BTHD, k_b, v_b, dout_BTHD, lse_BTH, delta_BTH, seg_BT,
      seg_b[0] if seg_b else None)

  def start(*own):
    # The own block's dK/dV stay here; the accumulator that travels (with the block this
    # device sees next) starts empty, so the others make N - 1 hops, not N.
    return (*step(0, None, *own), jnp.zeros((2, *k_BTKD.shape), jnp.float32))

  def visit(carry, s, *block):
    dq_BTHD, dk_BTKD, dv_BTKD, dkv_2BTKD = carry
    dq_BTHD, dkv_2BTKD = step(s, (dq_BTHD, dkv_2BTKD), *block)
    # The accumulator follows its K/V block, one hop after each step; after the last step
    # that hop takes it home to the block's owner.
    return dq_BTHD, dk_BTKD, dv_BTKD, lax.ppermute(dkv_2BTKD, axis, perm)

  dq_BTHD, dk_BTKD, dv_BTKD, dkv_2BTKD = _around_ring(
      _blocks(k_BTKD, v_BTKD, seg_BT), start, visit, axis=axis, num_shards=num_shards)
  return dq_BTHD, dk_BTKD + dkv_2BTKD[0], dv_BTKD + dkv_2BTKD[1]


@dataclasses.dataclass(frozen=True)
class _Ring:
  """How one call runs its passes: the static schedule and, on a mesh, the shard_map specs
  (q and out, k and v, segment ids) over which each device runs its ring. Static (hashed
  into the trace) so it can be a non-differentiable argument of the custom_vjp."""
  schedule: RingSchedule
  axis: str
  tile: int
  kernel: str
  mesh: Any = None  # None: the context mesh when `specs` are given
  specs: tuple[P, P, P] | None = None  # None: no mesh, one local block

  def _on_devices(self, per_device, in_specs, out_specs):
    if self.specs is None:
      return per_device
    # check_vma=False: the kernels' loop carries and skip branches start from replicated
    # constants while the computed ones are device-varying. The shard_map is never
    # transposed (the custom_vjp around it supplies the backward), so replicated operands
    # cost no all-reduce of their cotangents.
    return jax.shard_map(per_device, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

  def forward(self, q_BSHD, k_BSKD, v_BSKD, seg_BS):
    """(out in q's dtype, lse float32 [B, S, Hq]), global arrays."""
    q_spec, kv_spec, seg_spec = self.specs or (None,) * 3
    lse_spec = None if q_spec is None else P(*q_spec[:3])

    def per_device(q, k, v, *seg):
      out, lse = _ring_fwd_pass(q, k, v, seg[0] if seg else None, **self._pass_args())
      return out.astype(q.dtype), lse

    run = self._on_devices(per_device, (q_spec, kv_spec, kv_spec) + _if(seg_BS, seg_spec),
                           (q_spec, lse_spec))
    return run(q_BSHD, k_BSKD, v_BSKD, *_if(seg_BS, seg_BS))

  def backward(self, q_BSHD, k_BSKD, v_BSKD, seg_BS, out_BSHD, lse_BSH, dout_BSHD):
    """(dq, dk, dv) in the dtypes of q, k, v, global arrays."""
    q_spec, kv_spec, seg_spec = self.specs or (None,) * 3
    lse_spec = None if q_spec is None else P(*q_spec[:3])

    def per_device(q, k, v, out, lse, dout, *seg):
      dq, dk, dv = _ring_bwd_pass(q, k, v, seg[0] if seg else None, out, lse, dout,
                                  **self._pass_args())
      return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    run = self._on_devices(
        per_device, (q_spec, kv_spec, kv_spec, q_spec, lse_spec, q_spec) + _if(seg_BS, seg_spec),
        (q_spec, kv_spec, kv_spec))
    return run(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BSH, dout_BSHD, *_if(seg_BS, seg_BS))

  def _pass_args(self) -> dict:
    return dict(axis=self.axis, schedule=self.schedule, tile=self.tile, kernel=self.kernel)


def _if(segment_ids, value) -> tuple:
  """(value,) when documents are packed (segment ids given), else ()."""
  return () if segment_ids is None else (value,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BSHD, k_BSKD, v_BSKD, seg_BS, ring: _Ring):
  return ring.forward(q_BSHD, k_BSKD, v_BSKD, seg_BS)[0]


def _attention_fwd(q_BSHD, k_BSKD, v_BSKD, seg_BS, ring: _Ring):
  out_BSHD, lse_BSH = ring.forward(q_BSHD, k_BSKD, v_BSKD, seg_BS)
  # Named so that a remat policy can keep them (SAVED_NAMES); the output is saved in q's
  # dtype (what the caller holds anyway), lse in float32.
  out_BSHD = checkpoint_name(out_BSHD, SAVED_NAMES[0])
  lse_BSH = checkpoint_name(lse_BSH, SAVED_NAMES[1])
  return out_BSHD, (q_BSHD, k_BSKD, v_BSKD, seg_BS, out_BSHD, lse_BSH)


def _attention_bwd(ring: _Ring, residuals, dout_BSHD):
  # Integer segment ids get no cotangent.
  return (*ring.backward(*residuals, dout_BSHD), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_shapes(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS) -> None:
  batch, seq_len, num_heads, head_dim = q_BSHD.shape
  num_kv = k_BSKD.shape[2]
  if (k_BSKD.shape != v_BSKD.shape or k_BSKD.shape[:2] != (batch, seq_len)
      or k_BSKD.shape[3] != head_dim):
    raise ValueError(f"k {k_BSKD.shape} and v {v_BSKD.shape} must be [B, S, Hkv, D] "
                     f"matching q {q_BSHD.shape}")
  if segment_ids_BS is not None and segment_ids_BS.shape != (batch, seq_len):
    raise ValueError(f"segment_ids {segment_ids_BS.shape} must be [B, S] = {(batch, seq_len)}")
  if num_heads % num_kv:
    raise ValueError(f"query heads ({num_heads}) must be divisible by kv heads ({num_kv})")


def block_tile(seq_len: int, num_shards: int, tile_size: int) -> int:
  """The tile the kernels use: `tile_size` clipped to the per-device block."""
  return min(tile_size, seq_len // num_shards)


def shortest_ring_length(length: int, layout: str, num_shards: int, tile_size: int) -> int:
  """The smallest sequence length >= `length` that ring attention of `layout` takes on
  `num_shards` devices (the rule `_tile_for` checks): a multiple of the layout's divisor,
  and of shards x tile once a device's block is longer than one tile."""
  unit = required_divisor(layout, num_shards)
  seq_len = -(-length // unit) * unit
  if seq_len // num_shards > tile_size:
    unit = math.lcm(unit, num_shards * tile_size)
    seq_len = -(-length // unit) * unit
  return seq_len


def _tile_for(seq_len: int, num_shards: int, tile_size: int, axis: str) -> int:
  """The tile actually used (`block_tile`); S must divide into shards x tiles."""
  if seq_len % num_shards:
    raise ValueError(f"sequence length {seq_len} must be divisible by the '{axis}' mesh "
                     f"axis size {num_shards}")
  tile = block_tile(seq_len, num_shards, tile_size)
  if seq_len % (num_shards * tile):
    raise ValueError(f"sequence length {seq_len} must be divisible by {axis} shards x tile "
                     f"= {num_shards} x {tile} = {num_shards * tile}")
  return tile


def _ring_axis(mesh, rules: Rules) -> str:
  """The mesh axis the rules put `activation_seq` on: the ring."""
  seq_axes = as_axes(dict(rules).get("activation_seq"))
  if len(seq_axes) != 1:
    raise ValueError(f"mesh.rules must map activation_seq to one mesh axis, the ring's "
                     f"(got {seq_axes})")
  if seq_axes[0] not in mesh.axis_names:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no sequence axis "
                     f"'{seq_axes[0]}' (pass mesh=..., or set one with jax.set_mesh)")
  return seq_axes[0]


def operand_specs(mesh, rules: Rules, q_shape, num_kv: int) -> tuple[P, P, P]:
  """PartitionSpecs of q/out, k/v and segment ids from the rules table (mesh axes the mesh
  lacks are dropped); checks that the heads pair up and that everything divides."""
  specs = [spec_on_mesh(logical_to_spec(names, rules), mesh)
           for names in (Q_NAMES, KV_NAMES, SEGMENT_NAMES)]
  q_spec, kv_spec, _ = specs
  if q_spec[2] != kv_spec[2]:
    raise ValueError(f"mesh.rules must shard activation_heads and activation_kv_heads over the "
                     f"same mesh axes (got {q_spec[2]} and {kv_spec[2]}): each device's query "
                     f"heads must find their kv heads on it")
  batch, _, num_heads, _ = q_shape
  for what, size, axes in (("batch", batch, q_spec[0]), ("query heads", num_heads, q_spec[2]),
                           ("kv heads", num_kv, q_spec[2])):
    shards = math.prod(mesh.shape[a] for a in as_axes(axes))
    if size % shards:
      raise ValueError(f"{what} ({size}) must be divisible by the mesh axes {as_axes(axes)} "
                       f"they shard over (size {shards})")
  return tuple(specs)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                   *, layout: str, mesh=None, rules: Rules | None = None, kernel: str = "xla",
                   tile_size: int = 512) -> jax.Array:
  """Causal attention, exact, of q [B,S,Hq,D] on k/v [B,S,Hkv,D] sharded along S in `layout`.

  The sequence axis holds the tokens in the order of `layout` (`parallelism.layouts`) over
  the mesh axis that `rules` maps `activation_seq` to; query i sees key j iff j's original
  position is not after i's and their segment ids match (`segment_ids=None`: one document
  per row). Batch and heads shard as `rules` map `activation_batch` and
  `activation_heads`/`activation_kv_heads` (no rules: `DEFAULT_RULES`). `mesh=None` uses
  the mesh set by `jax.set_mesh`, or, when none is set, computes locally as one block.
  Without a mesh the row must be in its original order (a ring of one holds it unpermuted).
  `tile_size` is clipped to the per-device block. Returns out [B,S,Hq,D] in q's dtype.
  """
  kernels.get(kernel)  # an unknown name fails here, before any tracing
  rules = rules or DEFAULT_RULES
  _check_shapes(q, k, v, segment_ids)
  segment_ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
  context_mesh = mesh is None
  mesh = jax.sharding.get_abstract_mesh() if context_mesh else mesh
  seq_len = q.shape[1]
  if context_mesh and mesh.empty:
    # No mesh anywhere (a single-device script, model.init outside a mesh): one block, local.
    check_seq_len(seq_len, layout, 1)
    ring = _Ring(ring_schedule(layout, seq_len, 1), "sequence",
                 _tile_for(seq_len, 1, tile_size, "sequence"), kernel)
    return _attention(q, k, v, segment_ids, ring)
  axis = _ring_axis(mesh, rules)
  specs = operand_specs(mesh, rules, q.shape, k.shape[2])
  num_shards = mesh.shape[axis]
  check_seq_len(seq_len, layout, num_shards, name="sequence length")
  ring = _Ring(ring_schedule(layout, seq_len, num_shards), axis,
               _tile_for(seq_len, num_shards, tile_size, axis), kernel,
               None if context_mesh else mesh, specs)
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return _attention(q, k, v, segment_ids, ring)
  # Explicit-sharding meshes make shard_map demand inputs already laid out as in_specs;
  # the output goes back to q's sharding so the caller sees the type it passed in.
  out_spec = jax.typeof(q).sharding.spec
  q_spec, kv_spec, seg_spec = specs
  q, k, v = (jax.reshard(x, _sharding(mesh, spec))
             for x, spec in ((q, q_spec), (k, kv_spec), (v, kv_spec)))
  if segment_ids is not None:
    segment_ids = jax.reshard(segment_ids, _sharding(mesh, seg_spec))
  return jax.reshard(_attention(q, k, v, segment_ids, ring), _sharding(mesh, out_spec))


def _sharding(mesh, spec: P):
  """A NamedSharding on a concrete mesh; a bare spec for the context's abstract mesh."""
  return NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
