"""Every sequence-parallel strategy against dense causal attention: forward and gradients.

allgather, ulysses and hybrid (Ulysses times a ring) in every layout, with GQA (including
fewer K/V heads than the Ulysses degree, which repeats them), packed documents, and heads
also split over `tensor`. Inputs are permuted into the layout of the ring's size (the
`sequence` axis; a ring of one under pure Ulysses), run on 8 fake CPU devices and
unpermuted for comparison. Float32 throughout; the tolerance is test_ring_attention's.
"""

import functools

import jax
import numpy as np
import pytest

from parallelism.layouts import permute, unpermute
from parallelism.masks import Mask
from parallelism.ring_attention import ring_attention
from parallelism.strategies import kv_repeat
from attention_helpers import F32_TOL, assert_close, make_inputs, reference

RULES = (("activation_batch", "data"), ("activation_seq", ("sequence", "ulysses")),
         ("activation_heads", "tensor"), ("activation_kv_heads", "tensor"))


def packed_segments(batch: int, seq_len: int) -> np.ndarray:
  """Row 0: three documents whose boundaries cut through tiles and devices; others one."""
  seg = np.zeros((batch, seq_len), np.int32)
  seg[0, seq_len // 3:] = 1
  seg[0, seq_len - 7:] = 2
  return seg


def mesh_of(ring: int, ulysses: int, tensor: int = 1):
  return jax.make_mesh((1, ring, ulysses, tensor), ("data", "sequence", "ulysses", "tensor"),
                       devices=jax.devices()[:ring * ulysses * tensor])


def run_strategy(strategy, layout, mesh, q, k, v, dout, index, seg, tile_size=8):
  """out, dq, dk, dv of `strategy` (jitted), in the original order."""
  ring = mesh.shape["sequence"]
  perm = functools.partial(permute, layout=layout, num_shards=ring)

  @jax.jit
  def run(q, k, v, dout, seg):
    attend = lambda q, k, v: ring_attention(q, k, v, Mask.of(segment_ids=seg), layout=layout,
                                            mesh=mesh, rules=RULES, tile_size=tile_size,
                                            strategy=strategy)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))

  results = run(perm(q), perm(k), perm(v), perm(dout), perm(seg))
  return [unpermute(np.asarray(x, np.float32), layout, ring) for x in results]


# Each layout once, each ring size once, GQA 1, 2 and 4 (4 query heads).
@pytest.mark.parametrize("layout,n,num_kv", [("ring", 2, 4), ("striped", 8, 2), ("zigzag", 4, 1)])
def test_allgather_matches_dense(layout, n, num_kv):
  inputs = make_inputs(batch=2, seq_len=64, num_heads=4, num_kv=num_kv, head_dim=8,
                       segments=packed_segments(2, 64), seed=n)
  got = run_strategy("allgather", layout, mesh_of(n, 1), *inputs)
  assert_close(got, reference(*inputs), **F32_TOL)


# Degree 4 over 2 K/V heads (repeated twice) runs under hybrid below: Ulysses is hybrid's
# code around a ring of one, so the degrees here are the two ends and a repeat of eight.
@pytest.mark.parametrize("ulysses,num_kv", [(2, 8), (8, 1)])
def test_ulysses_matches_dense(ulysses, num_kv):
  """GQA 1 and 8 (kv heads 8 and 1 of 8); kv heads fewer than the degree are repeated."""
  inputs = make_inputs(batch=2, seq_len=64, num_heads=8, num_kv=num_kv, head_dim=8,
                       segments=packed_segments(2, 64), seed=ulysses + num_kv)
  got = run_strategy("ulysses", "striped", mesh_of(1, ulysses), *inputs)
  assert_close(got, reference(*inputs), **F32_TOL)


# Each layout once, rings of 2 and 4, K/V heads repeated (Ulysses 4) and not (Ulysses 2).
@pytest.mark.parametrize("layout,ring,ulysses", [("ring", 2, 4), ("striped", 4, 2),
                                                 ("zigzag", 2, 4)])
def test_hybrid_matches_dense(layout, ring, ulysses):
  inputs = make_inputs(batch=2, seq_len=64, num_heads=8, num_kv=2, head_dim=8,
                       segments=packed_segments(2, 64), seed=ring)
  got = run_strategy("hybrid", layout, mesh_of(ring, ulysses), *inputs)
  assert_close(got, reference(*inputs), **F32_TOL)


def test_hybrid_with_heads_over_tensor():
  """Ulysses splits the heads a device holds after `tensor` has split them."""
  inputs = make_inputs(batch=1, seq_len=64, num_heads=8, num_kv=2, head_dim=8,
                       segments=packed_segments(1, 64), seed=11)
  got = run_strategy("hybrid", "zigzag", mesh_of(2, 2, tensor=2), *inputs)
  assert_close(got, reference(*inputs), **F32_TOL)


def test_kv_repeat():
  assert [kv_repeat(kv, 8) for kv in (1, 2, 4, 8, 16, 6)] == [8, 4, 2, 1, 1, 4]
  assert kv_repeat(3, 1) == 1


@pytest.mark.parametrize("strategy,mesh_shape,heads,match", [
    ("ring", (2, 2), 8, "splits the sequence over mesh axis 'sequence' only"),
    ("allgather", (2, 2), 8, "splits the sequence over mesh axis 'sequence' only"),
    ("ulysses", (2, 2), 8, "use 'hybrid'"),
    ("hybrid", (2, 4), 6, r"query heads=6 over 1 head shard\(s\) leaves 6 heads per device, "
                          r"which mesh axis 'ulysses'=4 must divide"),
    ("fast", (2, 1), 8, "unknown sequence-parallel strategy 'fast'"),
])
def test_bad_strategy_setups_say_why(strategy, mesh_shape, heads, match):
  q, k, v, *_ = make_inputs(seq_len=64, num_heads=heads, num_kv=2, head_dim=8)
  with pytest.raises(ValueError, match=match):
    ring_attention(q, k, v, layout="ring", mesh=mesh_of(*mesh_shape), rules=RULES,
                   strategy=strategy)


def test_ulysses_needs_a_second_sequence_axis():
  q, k, v, *_ = make_inputs(seq_len=64, num_heads=8, num_kv=2, head_dim=8)
  rules = (("activation_seq", "sequence"),)
  with pytest.raises(ValueError, match="rules must map activation_seq to"):
    ring_attention(q, k, v, layout="ring", mesh=mesh_of(1, 4), rules=rules, strategy="ulysses")
