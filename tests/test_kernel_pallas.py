"""The Pallas block kernel (interpret mode on CPU) against the xla kernel and dense attention.

Block pairs come from real layouts: device `dq`'s query block against the key block of
device `dk` in ring, striped and zigzag order (`parallelism.layouts.permutation`), plus an
order no layout produces (tile-sized chunks shuffled: non-monotone indices, so SKIP and
UNMASKED tiles interleave and the kernel's per-tile edge loops run, not only its
branch-free middle loop).
Row 1 of every batch is packed with three documents whose boundaries fall inside tiles, so
some of its queries see no key of some blocks (out 0, lse -inf) next to ones that do.

Tolerance: both kernels compute in float32 on unit-normal inputs (O(1) values, D = 16) and
differ only in summation order (different tiles; exp2 vs exp), so they agree to float32
rounding, a few ulps times the O(sqrt(T)) accumulation: observed <= 2e-6. `_F32_TOL`
(1e-5 absolute and relative) allows that and nothing coarser, as in test_ring_attention.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallelism import kernel_pallas, kernel_xla, tiles
from parallelism.layouts import LAYOUTS, permutation, permute, unpermute
from parallelism.ring_attention import ring_attention

_F32_TOL = dict(atol=1e-5, rtol=1e-5)
N, BLOCK, HEADS, HEAD_DIM, TILE = 4, 64, 4, 16, 16
PAIRS = ((0, 0), (2, 2), (2, 1), (1, 2), (3, 0))  # (query device, key device)


def _segments(index_BT):
  """Row 0: one document; row 1: three, boundaries at original tokens 37 and 150."""
  seg = (index_BT >= 37).astype(np.int32) + (index_BT >= 150)
  seg[0] = 0
  return seg


def _order(layout: str) -> np.ndarray:
  if layout == "shuffled":
    chunks = np.arange(N * BLOCK, dtype=np.int32).reshape(-1, TILE)
    return np.random.default_rng(0).permutation(chunks).reshape(-1)
  return permutation(layout, N * BLOCK, N)


def _block_indices(layout: str, dq: int, dk: int):
  order = _order(layout)
  q_index, k_index = (np.stack([order[d * BLOCK:(d + 1) * BLOCK]] * 2) for d in (dq, dk))
  return q_index, _segments(q_index), k_index, _segments(k_index)


def _fwd_bwd(kernel):
  """Forward, then the backward given that forward's lse and delta as the global ones."""
  @jax.jit
  def run(q, k, v, dout, q_index, q_seg, k_index, k_seg):
    out, lse = kernel.block_fwd(q, k, v, q_index, q_seg, k_index, k_seg, tile=TILE)
    delta = jnp.sum(out * dout, axis=-1)
    grads = kernel.block_bwd(q, k, v, dout, lse, delta, q_index, q_seg, k_index, k_seg,
                             tile=TILE)
    return out, lse, grads
  return run


_PALLAS, _XLA = _fwd_bwd(kernel_pallas), _fwd_bwd(kernel_xla)


@pytest.mark.parametrize("group", [1, 2, 4])  # GQA ratio Hq / Hkv
def test_block_matches_xla(group):
  rng = np.random.default_rng(group)
  kv_shape = (2, BLOCK, HEADS // group, HEAD_DIM)
  q, dout = (rng.standard_normal((2, BLOCK, HEADS, HEAD_DIM), np.float32) for _ in range(2))
  k, v = (rng.standard_normal(kv_shape, np.float32) for _ in range(2))
  seen_some = partly_seen = 0
  for layout in (*LAYOUTS, "shuffled"):
    for dq, dk in PAIRS:
      idx = _block_indices(layout, dq, dk)
      out, lse, grads = _PALLAS(q, k, v, dout, *idx)
      want_out, want_lse, want_grads = _XLA(q, k, v, dout, *idx)
      where = f"{layout} q block {dq} k block {dk}"
      lse, want_lse = np.asarray(lse), np.asarray(want_lse)
      unseen = np.isneginf(want_lse)
      np.testing.assert_array_equal(np.isneginf(lse), unseen, err_msg=where)
      np.testing.assert_allclose(lse[~unseen], want_lse[~unseen], err_msg=where, **_F32_TOL)
      np.testing.assert_allclose(out, want_out, err_msg=where, **_F32_TOL)
      np.testing.assert_array_equal(np.asarray(out)[unseen], 0.0, err_msg=where)
      for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert np.isfinite(np.asarray(got)).all(), f"{name} not finite: {where}"
        np.testing.assert_allclose(got, want, err_msg=f"{name} {where}", **_F32_TOL)
      seen_some += int((~unseen).any())
      partly_seen += int((unseen.any(axis=(1, 2)) & (~unseen).any(axis=(1, 2))).any())
  assert seen_some and partly_seen, "the cases must include rows that see only some keys"


def test_cases_cover_every_tile_class():
  """The pairs above exercise SKIP, UNMASKED and MASKED tiles (at the kernel's tiles, TILE
  here), and rows where a SKIP tile lies between live ones and UNMASKED tiles form more
  than one run, which only the per-tile edge loops handle."""
  found, skip_inside, split_runs = set(), False, False
  for layout in (*LAYOUTS, "shuffled"):
    for dq, dk in PAIRS:
      q_index, q_seg, k_index, k_seg = _block_indices(layout, dq, dk)
      classes = tiles.classify_all(tiles.summarize_tiles(q_index[1:], q_seg[1:], TILE),
                                   tiles.summarize_tiles(k_index[1:], k_seg[1:], TILE))
      found |= set(np.unique(classes).tolist())
      for row in classes:
        live = np.flatnonzero(row != tiles.SKIP)
        skip_inside |= live.size > 0 and (live[-1] - live[0] + 1) > live.size
        starts = np.diff(np.r_[0, (row == tiles.UNMASKED).astype(int)]) == 1
        split_runs |= starts.sum() > 1
  assert found == {tiles.SKIP, tiles.UNMASKED, tiles.MASKED}
  assert skip_inside and split_runs


def test_wholly_future_block_gives_zeros():
  rng = np.random.default_rng(7)
  q, k, v = (rng.standard_normal((1, 32, 2, 8), np.float32) for _ in range(3))
  index = np.arange(32, dtype=np.int32)[None]
  seg = np.zeros_like(index)
  out, lse = kernel_pallas.block_fwd(q, k, v, index, seg, index + 100, seg, tile=8)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  assert np.all(np.isneginf(np.asarray(lse)))
  grads = kernel_pallas.block_bwd(q, k, v, q, lse, jnp.zeros(lse.shape), index, seg,
                                  index + 100, seg, tile=8)
  for g in grads:
    np.testing.assert_array_equal(np.asarray(g), 0.0)


def _dense(q, k, v, index, seg):
  """Plain causal attention in float32 (rows that see nothing give 0)."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
  visible = ((index[:, None, :] <= index[:, :, None]) & (seg[:, None, :] == seg[:, :, None]))
  p = jnp.where(visible[:, None], jax.nn.softmax(jnp.where(visible[:, None], s, -jnp.inf)), 0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_ring_attention_pallas_matches_dense(layout):
  """kernel='pallas' inside the ring on 4 of the 8 fake devices: forward and gradients."""
  seq_len, n = 128, 4
  rng = np.random.default_rng(8)
  q, dout = (rng.standard_normal((2, seq_len, 4, HEAD_DIM), np.float32) for _ in range(2))
  k, v = (rng.standard_normal((2, seq_len, 2, HEAD_DIM), np.float32) for _ in range(2))
  index = np.tile(np.arange(seq_len, dtype=np.int32), (2, 1))
  seg = _segments(index)
  mesh = jax.make_mesh((n,), ("sequence",), devices=jax.devices()[:n])
  perm = functools.partial(permute, layout=layout, num_shards=n)

  @jax.jit
  def run(q, k, v, dout):
    attend = lambda q, k, v: ring_attention(q, k, v, perm(index), perm(seg), mesh=mesh,
                                            kernel="pallas", tile_size=8)
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))

  got = [unpermute(np.asarray(x), layout, n) for x in run(perm(q), perm(k), perm(v), perm(dout))]
  out, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, index, seg), q, k, v)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, (out, *vjp(dout))):
    np.testing.assert_allclose(g, np.asarray(w), err_msg=name, **_F32_TOL)
