"""Shared helpers of the attention tests: inputs, the dense causal reference, a ring run in
any layout, and the one tolerance.

Inputs are made in the original order, permuted into a layout, run through
`ring_attention` on a mesh of N fake CPU devices, and unpermuted back for comparison.

Tolerance: values, outputs and gradients here are O(1) (unit normal inputs, D <= 32), and
both sides compute in float32 with a different summation order (tiled online softmax vs
one dense softmax), so they agree to float32 rounding: a few ulps times O(sqrt(S))
accumulation, observed ~3e-6. `F32_TOL` (1e-5) allows that and nothing coarser.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from parallelism.layouts import permute, unpermute
from parallelism.masks import Mask, MaskSpec, Side
from parallelism.ring_attention import ring_attention

F32_TOL = dict(atol=1e-5, rtol=1e-5)


def dense_attention(q_BSHD, k_BSKD, v_BSKD, token_index_BS, segment_ids_BS,
                    k_index_BS=None, k_segment_BS=None, window=None, softcap=0.0):
  """Plain causal attention in float32, each query seeing the `window` keys up to itself
  (None: all before it), logits capped at `softcap` (0: not); rows that see no key give 0.

  Keys have their own indices only in the block-kernel test; else they are the queries'.
  """
  k_index_BS = token_index_BS if k_index_BS is None else k_index_BS
  k_segment_BS = segment_ids_BS if k_segment_BS is None else k_segment_BS
  group = q_BSHD.shape[2] // k_BSKD.shape[2]
  k_BSHD = jnp.repeat(k_BSKD.astype(jnp.float32), group, axis=2)
  v_BSHD = jnp.repeat(v_BSKD.astype(jnp.float32), group, axis=2)
  s_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BSHD.astype(jnp.float32), k_BSHD,
                      precision="highest") * q_BSHD.shape[-1] ** -0.5
  if softcap:
    s_BHQK = softcap * jnp.tanh(s_BHQK / softcap)
  behind_BQK = token_index_BS[:, :, None] - k_index_BS[:, None, :]
  visible_BQK = ((behind_BQK >= 0) & (k_segment_BS[:, None, :] == segment_ids_BS[:, :, None]))
  if window is not None:
    visible_BQK &= behind_BQK < window
  s_BHQK = jnp.where(visible_BQK[:, None], s_BHQK, -jnp.inf)
  p_BHQK = jnp.where(visible_BQK[:, None], jax.nn.softmax(s_BHQK, axis=-1), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", p_BHQK, v_BSHD, precision="highest")


def make_inputs(batch=1, seq_len=128, num_heads=4, num_kv=2, head_dim=16, segments=None,
                seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, seq_len, num_heads, head_dim), np.float32)
  k = rng.standard_normal((batch, seq_len, num_kv, head_dim), np.float32)
  v = rng.standard_normal((batch, seq_len, num_kv, head_dim), np.float32)
  dout = rng.standard_normal(q.shape, np.float32)
  index = np.tile(np.arange(seq_len, dtype=np.int32), (batch, 1))
  seg = np.zeros((batch, seq_len), np.int32) if segments is None else segments
  return q, k, v, dout, index, seg


# Jitted: one compile per shape, where op-by-op dispatch compiled each of its ops (3x the time).
@functools.partial(jax.jit, static_argnames=("window", "softcap"))
def reference(q, k, v, dout, index, seg, window=None, softcap=0.0):
  out, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, index, seg, window=window,
                                                     softcap=softcap), q, k, v)
  return (out, *vjp(dout))


# Keys with their own indices (the block-kernel tests); jitted as `reference`.
@jax.jit
def block_reference(q, k, v, dout, q_index, q_seg, k_index, k_seg):
  out, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, q_index, q_seg, k_index, k_seg),
                     q, k, v)
  return (out, *vjp(dout))


def ring_in_layout(layout, mesh, q, k, v, dout, index, seg, packed=True, spec=MaskSpec(),
                   positions=None, spans=None, codes=(None, None), **kwargs):
  """Runs ring_attention (jitted) on permuted inputs; returns out, dq, dk, dv unpermuted.

  The mask is `spec` with the operands given (`positions` and `codes` in the original order,
  permuted here); `packed=False` passes no segment ids (one document per row; `seg` must be
  all one id).
  """
  n = mesh.shape["sequence"]
  perm = functools.partial(permute, layout=layout, num_shards=n)
  optional = lambda x: None if x is None else perm(x)
  mask = Mask.of(spec, perm(seg) if packed else None, positions=optional(positions),
                 spans=spans, codes=tuple(map(optional, codes)))

  @jax.jit
  def run(q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, mask, layout=layout, mesh=mesh,
                                                      **kwargs), q, k, v)
    return (out, *vjp(dout))

  results = run(perm(q), perm(k), perm(v), perm(dout))
  return [unpermute(np.asarray(x, np.float32), layout, n) for x in results]


def pair_mask(q_seg=None, k_seg=None, spec=MaskSpec()):
  """A block pair's mask for a kernel: its spec, the queries' and the keys' segment ids."""
  return Mask(spec, Side(q_seg), Side(k_seg))


def assert_close(got, want, **tol):
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, np.asarray(w, np.float32), err_msg=name, **tol)


def seq_mesh(n, *extra):
  """A mesh of n devices on 'sequence', plus size-1 axes `extra`."""
  return jax.make_mesh((*[1] * len(extra), n), (*extra, "sequence"),
                       devices=jax.devices()[:n])


def packed_inputs(seq_len=128, seed=1):
  """Row 0: three documents with boundaries not aligned to tiles; row 1: one document."""
  seg = np.zeros((2, seq_len), np.int32)
  seg[0, 37:90] = 1
  seg[0, 90:] = 2
  return make_inputs(batch=2, seq_len=seq_len, segments=seg, seed=seed)
