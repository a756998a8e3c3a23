"""Exact causal attention over a sequence sharded on one mesh axis, by a ring of K/V blocks.

Each device keeps its query block and passes its K/V block (with the keys' token_index
and segment_ids, packed into one buffer) around the `axis` ring with `lax.ppermute`; after
N steps every query block has met every key block. The next transfer is issued before the
current block is computed so communication can overlap compute. Partial (out, lse) pairs
merge by the stable log-sum-exp rule. Which tiles are computed is decided from the indices
alone (`parallelism.tiles`), so the same code is ring, striped or zigzag attention
depending only on how the data pipeline permuted the sequence (see DESIGN.md).

The gradient is a `jax.custom_vjp`: the forward saves its inputs plus the global output
and lse; the backward is a second ring pass that recomputes each block's probabilities
from them. A device keeps the dK/dV of its own block; the accumulators of the others
travel with their K/V block and, after N - 1 hops, arrive back at the device that owns it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parallelism import kernel_pallas, kernel_xla

KERNELS = ("xla", "pallas")
# name -> (block forward, block backward); both share the signatures of kernel_xla.
_BLOCK_KERNELS = {"xla": (kernel_xla.block_fwd, kernel_xla.block_bwd),
                  "pallas": (kernel_pallas.block_fwd, kernel_pallas.block_bwd)}


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
  """Arrays as one flat byte buffer, so a K/V block and its indices move in one transfer.

  Each transfer is a rendezvous of both neighbours (on CPU also a round trip through the
  collectives library, measured 2.5 ms for K/V alone and 4.0 ms with the indices as a second
  array). Bytes are moved, never converted, so the trip is exact for every dtype of one
  byte or more.
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
  """The ring schedule both passes share; returns the last carry.

  Step 0 is `start(*own)` on the device's own block (k, v, index, segment; its keys carry
  its queries' indices), giving the first carry. Steps 1..N-1 are `visit(carry, *block)` on
  the block that arrived, the one that started on device d - s. Each step first issues the
  transfer of the block it holds, so the compute can overlap it; the last needs none.
  """
  if num_shards == 1:
    return start(*own)
  perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]

  def step(state, send: bool):
    carry, kv_bytes = state
    kv_bytes_next = lax.ppermute(kv_bytes, axis, perm) if send else kv_bytes
    return visit(carry, *_unpack(kv_bytes, own)), kv_bytes_next

  state = (start(*own), lax.ppermute(_pack(*own), axis, perm))
  state = lax.fori_loop(1, num_shards - 1, lambda _, s: step(s, True), state)
  return step(state, False)[0]


def _ring_fwd_pass(q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, *, axis: str, num_shards: int,
                   tile: int, kernel: str):
  """Per-device forward ring: returns (out f32 [B,T,Hq,D], lse f32 [B,T,Hq])."""
  block_fwd = functools.partial(_BLOCK_KERNELS[kernel][0], tile=tile)
  attend = lambda k_b, v_b, k_index_BT, k_seg_BT: block_fwd(
      q_BTHD, k_b, v_b, index_BT, seg_BT, k_index_BT, k_seg_BT)
  # Step 0's result starts the (out, lse) pair, so no merge with an empty one.
  return _around_ring((k_BTKD, v_BTKD, index_BT, seg_BT), attend,
                      lambda out_lse, *block: _merge(*out_lse, *attend(*block)),
                      axis=axis, num_shards=num_shards)


def _ring_bwd_pass(q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, out_BTHD, lse_BTH, dout_BTHD, *,
                   axis: str, num_shards: int, tile: int, kernel: str):
  """Per-device backward ring: returns (dq, dk, dv) in float32."""
  perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]
  block_bwd = functools.partial(_BLOCK_KERNELS[kernel][1], tile=tile)
  delta_BTH = jnp.sum(dout_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1)
  grads = lambda k_b, v_b, k_index_BT, k_seg_BT: block_bwd(
      q_BTHD, k_b, v_b, dout_BTHD, lse_BTH, delta_BTH, index_BT, seg_BT, k_index_BT, k_seg_BT)

  def start(*own):
    # The own block's dK/dV stay here; the accumulator that travels (with the block this
    # device sees next) starts empty, so the others make N - 1 hops, not N.
    dq_BTHD, dk_BTKD, dv_BTKD = grads(*own)
    return dq_BTHD, dk_BTKD, dv_BTKD, jnp.zeros((2, *k_BTKD.shape), jnp.float32)

  def visit(carry, *block):
    dq_BTHD, dk_BTKD, dv_BTKD, dkv_2BTKD = carry
    dq_b, dk_b, dv_b = grads(*block)
    # The accumulator follows its K/V block, one hop after each step; after the last step
    # that hop takes it home to the block's owner.
    dkv_2BTKD = lax.ppermute(dkv_2BTKD + jnp.stack([dk_b, dv_b]), axis, perm)
    return dq_BTHD + dq_b, dk_BTKD, dv_BTKD, dkv_2BTKD

  dq_BTHD, dk_BTKD, dv_BTKD, dkv_2BTKD = _around_ring(
      (k_BTKD, v_BTKD, index_BT, seg_BT), start, visit, axis=axis, num_shards=num_shards)
  return dq_BTHD, dk_BTKD + dkv_2BTKD[0], dv_BTKD + dkv_2BTKD[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, axis, num_shards, tile, kernel):
  out_BTHD, _ = _ring_fwd_pass(q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, axis=axis,
                               num_shards=num_shards, tile=tile, kernel=kernel)
  return out_BTHD.astype(q_BTHD.dtype)


def _ring_vjp_fwd(q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, axis, num_shards, tile, kernel):
  out_BTHD, lse_BTH = _ring_fwd_pass(q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, axis=axis,
                                     num_shards=num_shards, tile=tile, kernel=kernel)
  # The output is saved in q's dtype (what the caller holds anyway); lse stays float32.
  out_BTHD = out_BTHD.astype(q_BTHD.dtype)
  return out_BTHD, (q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, out_BTHD, lse_BTH)


def _ring_vjp_bwd(axis, num_shards, tile, kernel, residuals, dout_BTHD):
  q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, out_BTHD, lse_BTH = residuals
  dq, dk, dv = _ring_bwd_pass(q_BTHD, k_BTKD, v_BTKD, index_BT, seg_BT, out_BTHD, lse_BTH,
                              dout_BTHD, axis=axis, num_shards=num_shards, tile=tile,
                              kernel=kernel)
  # Integer indices get no cotangent.
  return dq.astype(q_BTHD.dtype), dk.astype(k_BTKD.dtype), dv.astype(v_BTKD.dtype), None, None


_ring.defvjp(_ring_vjp_fwd, _ring_vjp_bwd)


def _check_shapes(q_BSHD, k_BSKD, v_BSKD, token_index_BS, segment_ids_BS) -> None:
  batch, seq_len, num_heads, head_dim = q_BSHD.shape
  num_kv = k_BSKD.shape[2]
  if (k_BSKD.shape != v_BSKD.shape or k_BSKD.shape[:2] != (batch, seq_len)
      or k_BSKD.shape[3] != head_dim):
    raise ValueError(f"k {k_BSKD.shape} and v {v_BSKD.shape} must be [B, S, Hkv, D] "
                     f"matching q {q_BSHD.shape}")
  for name, x in (("token_index", token_index_BS), ("segment_ids", segment_ids_BS)):
    if x is not None and x.shape != (batch, seq_len):
      raise ValueError(f"{name} {x.shape} must be [B, S] = {(batch, seq_len)}")
  if num_heads % num_kv:
    raise ValueError(f"query heads ({num_heads}) must be divisible by kv heads ({num_kv})")


def block_tile(seq_len: int, num_shards: int, tile_size: int) -> int:
  """The tile the kernels use: `tile_size` clipped to the per-device block."""
  return min(tile_size, seq_len // num_shards)


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


def _specs(mesh, shape_BSHD, num_kv: int, axis: str, batch_axes: Sequence[str],
           head_axis: str | None) -> tuple[P, P]:
  """PartitionSpecs of the [B,S,H,D] and [B,S] arguments; checks they divide evenly."""
  batch, _, num_heads, _ = shape_BSHD
  batch_names = tuple(name for name in batch_axes if name in mesh.axis_names)
  batch_shards = math.prod(mesh.shape[name] for name in batch_names)
  if batch % batch_shards:
    raise ValueError(f"batch {batch} must be divisible by the batch mesh axes "
                     f"{batch_names} (size {batch_shards})")
  head_name = head_axis if head_axis and head_axis in mesh.axis_names else None
  if head_name and (num_heads % mesh.shape[head_name] or num_kv % mesh.shape[head_name]):
    raise ValueError(f"query heads ({num_heads}) and kv heads ({num_kv}) must be divisible "
                     f"by the '{head_name}' mesh axis size {mesh.shape[head_name]}")
  batch_spec = batch_names if batch_names else None
  return P(batch_spec, axis, head_name, None), P(batch_spec, axis)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, token_index: jax.Array,
                   segment_ids: jax.Array | None = None, *, mesh=None, axis: str = "sequence",
                   kernel: str = "xla", tile_size: int = 512,
                   batch_axes: Sequence[str] = ("data", "fsdp"),
                   head_axis: str | None = "tensor") -> jax.Array:
  """Causal attention, exact, of q [B,S,Hq,D] on k/v [B,S,Hkv,D] sharded along S over `axis`.

  Query i sees key j iff token_index[j] <= token_index[i] and segment ids match
  (`segment_ids=None`: one segment). Works for any layout of S. `mesh=None` uses the mesh
  set by `jax.set_mesh`, or, when none is set, computes locally as one block. Batch shards
  over those of `batch_axes` in the mesh and heads over `head_axis` if present.
  `tile_size` is clipped to the per-device block. Returns out [B,S,Hq,D] in q's dtype.
  """
  if kernel not in KERNELS:
    raise ValueError(f"unknown attention kernel '{kernel}'; choose one of {KERNELS}")
  context_mesh = mesh is None
  mesh = jax.sharding.get_abstract_mesh() if context_mesh else mesh
  if context_mesh and mesh.empty:
    # No mesh anywhere (a single-device script, model.init outside a mesh): one block, local.
    _check_shapes(q, k, v, token_index, segment_ids)
    tile = _tile_for(q.shape[1], 1, tile_size, axis)
    segment_ids = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    q, token_index, segment_ids = _tie_to_queries(q, token_index, segment_ids)
    return _ring(q, k, v, token_index, segment_ids, axis, 1, tile, kernel)
  if axis not in mesh.axis_names:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no sequence axis '{axis}' "
                     "(pass mesh=..., or set one with jax.set_mesh)")
  _check_shapes(q, k, v, token_index, segment_ids)
  batch, seq_len = q.shape[:2]
  num_shards = mesh.shape[axis]
  tile = _tile_for(seq_len, num_shards, tile_size, axis)
  heads_spec, index_spec = _specs(mesh, q.shape, k.shape[2], axis, batch_axes, head_axis)
  if segment_ids is None:
    segment_ids = jnp.zeros((batch, seq_len), jnp.int32)

  # check_vma=False: the kernels' branches and loop carries start from replicated constants
  # (the skip branch returns its carry as is) while the computed ones are device-varying; every
  # argument is sharded over `axis`, so the check adds nothing.
  sharded = jax.shard_map(
      lambda *args: _ring(*args, axis, num_shards, tile, kernel),
      mesh=None if context_mesh else mesh, out_specs=heads_spec, check_vma=False,
      in_specs=(heads_spec, heads_spec, heads_spec, index_spec, index_spec))
  q, token_index, segment_ids = _tie_to_queries(q, token_index, segment_ids)
  args = (q, k, v, token_index, segment_ids)
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return sharded(*args)
  # Explicit-sharding meshes make shard_map demand inputs already laid out as in_specs;
  # the output goes back to q's sharding so the caller sees the type it passed in.
  specs = (heads_spec, heads_spec, heads_spec, index_spec, index_spec)
  q_spec = jax.typeof(q).sharding.spec
  args = tuple(jax.reshard(x, _sharding(mesh, spec)) for x, spec in zip(args, specs))
  return jax.reshard(sharded(*args), _sharding(mesh, q_spec))


def _tie_to_queries(q, token_index, segment_ids):
  """Makes the indices depend on q, as int32.

  In a model the indices are the same for every layer, so inside the (differentiated) layer
  scan JAX sees them as loop-invariant and hoists everything computed from them alone -- the
  masks and tile classes of every ring step and tile pair -- out of the loops, stacked: an
  (N - 1) * B * H * T^2 buffer per device, quadratic in the sequence. The barrier ties them
  to q, which changes every layer, so they are recomputed per tile as the kernels intend.
  """
  return lax.optimization_barrier(
      (q, token_index.astype(jnp.int32), segment_ids.astype(jnp.int32)))


def _sharding(mesh, spec: P):
  """A NamedSharding on a concrete mesh; a bare spec for the context's abstract mesh."""
  return NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
