"""Ring attention against a dense causal reference, forward and gradients, in every layout.

Inputs are made in the original order, permuted into a layout, run through
`ring_attention` on a mesh of N fake CPU devices, and unpermuted back for comparison; the
inputs, the reference, the ring run and the tolerance are `tests/attention_helpers.py`'s,
which the other attention tests share.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from configs import base as base_config
from parallelism import kernel_xla
from parallelism.layouts import permute, unpermute
from parallelism.kernel_grads import Merged
from parallelism.masks import Mask
from parallelism.ring import merge, pack, unpack
from parallelism.ring_attention import ring_attention
from parallelism.schedule import ring_schedule, schedule_of_order

from attention_helpers import (F32_TOL, assert_close, block_reference, make_inputs, packed_inputs,
                               pair_mask, reference, ring_in_layout, seq_mesh)


# 2 is the default of make_inputs and the tiny config. Each ratio runs on a data x sequence
# mesh of one axis type, as the model meets both; group 4 also without segment ids.
@pytest.mark.parametrize("group, axis_type, packed", [(1, AxisType.Explicit, True),
                                                      (4, AxisType.Auto, False)])
def test_gqa_ratios_on_a_data_and_sequence_mesh(group, axis_type, packed):
  mesh = jax.make_mesh((2, 4), ("data", "sequence"), axis_types=(axis_type,) * 2)
  inputs = make_inputs(batch=2, num_heads=4, num_kv=4 // group, seq_len=64, head_dim=32, seed=3)
  rules = (("activation_batch", "data"), ("activation_seq", "sequence"))
  got = ring_in_layout("striped", mesh, *inputs, packed=packed, tile_size=8, rules=rules)
  assert_close(got, reference(*inputs), **F32_TOL)


# 512 > block: clipped to the block (one tile per block), here on one device (no ring: the
# whole row one block); 16 runs in test_heads_sharded_over_tensor and
# test_bf16_under_context_mesh, 8 everywhere else.
@pytest.mark.parametrize("tile_size, n", [(4, 4), (512, 1)])
def test_tile_sizes(tile_size, n):
  inputs = packed_inputs(seed=2)
  got = ring_in_layout("zigzag", seq_mesh(n, "data"), *inputs, tile_size=tile_size)
  assert_close(got, reference(*inputs), **F32_TOL)


def test_heads_sharded_over_tensor():
  mesh = jax.make_mesh((2, 2, 2), ("data", "sequence", "tensor"))
  inputs = make_inputs(batch=2, seq_len=64, num_heads=4, num_kv=2, seed=4)
  rules = (("activation_batch", "data"), ("activation_seq", "sequence"),
           ("activation_heads", "tensor"), ("activation_kv_heads", "tensor"))
  got = ring_in_layout("zigzag", mesh, *inputs, tile_size=16, rules=rules)
  assert_close(got, reference(*inputs), **F32_TOL)


def test_bf16_under_context_mesh():
  """As the model calls it: mesh from jax.set_mesh, the config's rules, bf16, inside jit."""
  q, k, v, dout, index, seg = make_inputs(seq_len=128, seed=5)
  n, layout = 4, "striped"
  perm = functools.partial(permute, layout=layout, num_shards=n)
  bf16 = lambda x: jnp.asarray(perm(x), jnp.bfloat16)
  rules = base_config.get_config().mesh.rules

  @jax.jit
  def run(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, layout=layout, rules=rules,
                                                      tile_size=16), q, k, v)
    return (out, *vjp(dout))

  mesh = jax.make_mesh((1, 1, n, 1, 2), ("data", "fsdp", "sequence", "ulysses", "tensor"))
  with jax.set_mesh(mesh):
    got = run(bf16(q), bf16(k), bf16(v), bf16(dout))
  assert all(x.dtype == jnp.bfloat16 for x in got)
  got = [unpermute(np.asarray(x, np.float32), layout, n) for x in got]
  # bf16 has an 8-bit mantissa (relative step 2^-8 ~ 4e-3); inputs are also rounded.
  assert_close(got, reference(q, k, v, dout, index, seg), atol=6e-2, rtol=6e-2)


def test_block_kernel_rows_that_see_nothing():
  """Keys partly and wholly in the future: zeros and lse -inf, never NaN, also merged."""
  rng = np.random.default_rng(6)
  q = rng.standard_normal((1, 16, 2, 8), np.float32)
  k = rng.standard_normal((1, 16, 2, 8), np.float32)
  v = rng.standard_normal((1, 16, 2, 8), np.float32)
  # Two blocks of 16: the queries hold original tokens 0-7 and 16-23, the keys 8-15 and
  # 24-31. Queries 0-7 see none of these keys; queries 16-23 see keys 8-15.
  block = lambda first: np.r_[first:first + 8, first + 16:first + 24]
  schedule = schedule_of_order(np.r_[block(0), block(8)], 2)
  pair = schedule.pair[0, 1]  # device 0 holds block 1 at step 1
  assert schedule.shapes[pair] == "general"
  q_index, k_index = (schedule.order[b][None] for b in (0, 1))
  seg = np.zeros((1, 16), np.int32)
  dout = rng.standard_normal(q.shape, np.float32)
  want = block_reference(q, k, v, dout, q_index, seg, k_index, seg)

  @functools.partial(jax.jit, static_argnums=(0, 1))  # one compile each, not op by op
  def forward(schedule, pair, q, k, v):
    return kernel_xla.block_fwd(q, k, v, Mask(), schedule=schedule, pair=pair, tile=4)

  out, lse = forward(schedule, pair, q, k, v)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(out)[:, :8], 0.0)
  assert np.all(np.asarray(lse)[:, :8] == -np.inf)
  assert np.isfinite(np.asarray(lse)[:, 8:]).all()
  np.testing.assert_allclose(np.asarray(out), np.asarray(want[0]), **F32_TOL)

  # A key block wholly in the future: the ring skips it, and the kernel, given it anyway,
  # visits no tile and sees nothing.
  future = ring_schedule("ring", 32, 2)
  empty_pair = future.pair[0, 1]
  assert future.shapes[empty_pair] == "empty" and future.empty[0, 1]
  out_f, lse_f = forward(future, empty_pair, q, k, v)
  np.testing.assert_array_equal(np.asarray(out_f), 0.0)
  assert np.all(np.asarray(lse_f) == -np.inf)
  merged, merged_lse = merge(out_f, lse_f, out_f, lse_f)
  np.testing.assert_array_equal(np.asarray(merged), 0.0)
  assert np.all(np.asarray(merged_lse) == -np.inf)
  merged, _ = merge(out_f, lse_f, out, lse)
  np.testing.assert_allclose(np.asarray(merged), np.asarray(out), **F32_TOL)

  # With one block its lse is the global one, so block_bwd is the whole gradient.
  grads = jax.jit(lambda q, k, v, out, lse, dout: kernel_xla.block_bwd(
      q, k, v, Mask(), Merged.of(out, lse, dout), schedule=schedule, pair=pair, tile=4))(
          q, k, v, out, lse, dout)
  for got, w in zip(grads, want[1:]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(w), **F32_TOL)
  np.testing.assert_array_equal(np.asarray(grads[0])[:, :8], 0.0)



@pytest.mark.parametrize("order", ["striped", "random"])
def test_block_kernel_masks_of_any_shape(order, monkeypatch):
  """The xla kernel's forward and backward on one block pair, against dense. Every layout's
  masks leave a tile's first queries blind to its last keys, and MASKED tiles skip that
  quarter (`upper_right_empty`); a random order's masks do not, and are computed whole."""
  schedule = (ring_schedule("striped", 64, 2) if order == "striped" else
              schedule_of_order(np.random.default_rng(3).permutation(64), 2))
  halves = order == "striped"
  assert schedule.tiles(8).upper_right_empty == halves
  traced = []  # the halves' updates, as the loops trace them
  for name in ("_fwd_update_in_halves", "_bwd_update_in_halves"):
    update = getattr(kernel_xla, name)
    monkeypatch.setattr(kernel_xla, name, lambda *a, update=update, name=name, **kw: (
        traced.append(name), update(*a, **kw))[1])
  q, k, v, dout, _, _ = make_inputs(batch=2, seq_len=32, num_heads=4, num_kv=2, seed=7)
  seg_BT = np.stack([np.zeros(32, np.int32), (np.arange(32) >= 13).astype(np.int32)])

  @jax.jit  # One compile for every pair (an argument, as in the ring), not op by op for each.
  def forward_and_backward(q, k, v, dout, q_seg, k_seg, pair):
    at = dict(schedule=schedule, pair=pair, tile=8)
    out, lse = kernel_xla.block_fwd(q, k, v, pair_mask(q_seg, k_seg), **at)
    delta = jnp.sum(out * dout, axis=-1)
    return out, kernel_xla.block_bwd(q, k, v, pair_mask(q_seg, k_seg),
                                     Merged(out, lse, dout, delta), **at)

  for pair, (q_block, k_block) in enumerate(schedule.pair_blocks):
    q_index, k_index = (np.stack([schedule.order[b]] * 2) for b in (q_block, k_block))
    q_seg, k_seg = seg_BT, np.roll(seg_BT, 5, axis=1)
    out, grads = forward_and_backward(q, k, v, dout, q_seg, k_seg, pair)
    assert_close((out, *grads), block_reference(q, k, v, dout, q_index, q_seg, k_index, k_seg),
                 **F32_TOL)
  assert set(traced) == ({"_fwd_update_in_halves", "_bwd_update_in_halves"} if halves else set())


def test_ring_hop_buffer_moves_bits_exactly():
  """K/V and segment ids travel as one byte buffer; every bit comes back (NaN payloads,
  bf16, one-byte dtypes), in the shapes and dtypes of the templates it is unpacked against."""
  rng = np.random.default_rng(7)
  bits = rng.integers(0, 2**16, (2, 6, 3, 4), dtype=np.uint16)
  k = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)  # NaNs and denormals too
  v = jnp.asarray(rng.standard_normal((2, 6, 3, 4)), jnp.float32).at[0, 0, 0, 0].set(jnp.nan)
  index = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (2, 6)), jnp.int32)
  small = jnp.asarray(rng.integers(-128, 127, (2, 5)), jnp.int8)
  fp8 = jax.lax.bitcast_convert_type(jnp.asarray(rng.integers(0, 256, (3,), np.uint8)),
                                     jnp.float8_e4m3fn)
  arrays = (k, v, index, small, fp8)
  buffer = jax.jit(pack)(*arrays)
  assert buffer.dtype == jnp.uint8 and buffer.shape == (sum(x.nbytes for x in arrays),)
  # The templates carry only shapes and dtypes, as on the receiving device.
  templates = tuple(jnp.zeros_like(x) for x in arrays)
  for got, want in zip(jax.jit(unpack)(buffer, templates), arrays):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)),
                                  np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint8)))


def test_no_mesh_computes_locally():
  """Without any mesh (e.g. model.init outside one) the whole sequence is one local block."""
  inputs = make_inputs(seq_len=64, seed=7)
  q, k, v, dout, index, seg = inputs

  @jax.jit  # jit adds no mesh; one compile where op-by-op dispatch compiled each op
  def run(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, Mask.of(segment_ids=seg), layout="zigzag",
                                                      tile_size=16), q, k, v)
    return (out, *vjp(dout))

  assert_close(run(q, k, v, dout), reference(*inputs), **F32_TOL)


def test_errors_are_clear():
  q, k, v, _, _, _ = make_inputs(seq_len=96)
  attend = functools.partial(ring_attention, layout="striped")
  with pytest.raises(ValueError, match=r"96 must be divisible by sequence shards x tile"):
    attend(q, k, v, mesh=seq_mesh(4), tile_size=16)  # block 24, tile 16
  with pytest.raises(ValueError, match=r"sequence length=40 must be divisible by 16"):
    ring_attention(q[:, :40], k[:, :40], v[:, :40], layout="zigzag", mesh=seq_mesh(8))
  with pytest.raises(ValueError, match=r"query heads \(4\) must be divisible by kv heads \(3\)"):
    attend(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), mesh=seq_mesh(4))
  data_only = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match="no sequence axis 'sequence'"):
    attend(q, k, v, mesh=data_only)
  with jax.set_mesh(data_only), pytest.raises(ValueError, match="no sequence axis"):
    attend(q, k, v)
  tensor_rules = (("activation_seq", "sequence"), ("activation_heads", "tensor"),
                  ("activation_kv_heads", "tensor"))
  with pytest.raises(ValueError, match=r"kv heads \(1\) must be divisible by the mesh axes"):
    attend(q, k[:, :, :1], v[:, :, :1], rules=tensor_rules,
           mesh=jax.make_mesh((2, 2), ("sequence", "tensor"), devices=jax.devices()[:4]))
  with pytest.raises(ValueError, match="they must shard over the same mesh axes"):
    attend(q, k, v, rules=tensor_rules[:2],
           mesh=jax.make_mesh((2, 2), ("sequence", "tensor"), devices=jax.devices()[:4]))
  with pytest.raises(ValueError, match="splits the sequence over mesh axis 'sequence' only"):
    attend(q, k, v, rules=(("activation_seq", ("sequence", "tensor")),),
           mesh=jax.make_mesh((2, 2), ("sequence", "tensor"), devices=jax.devices()[:4]))
  with pytest.raises(ValueError, match="must map activation_seq to the ring's mesh axis"):
    attend(q, k, v, rules=(("activation_seq", ("sequence", "tensor", "data")),), mesh=seq_mesh(4))
  with pytest.raises(ValueError, match="unknown attention kernel 'cuda'"):
    attend(q, k, v, mesh=seq_mesh(4), kernel="cuda")
