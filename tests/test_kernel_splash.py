"""The splash block kernel (Pallas TPU splash attention, interpreted on the CPU) against the
xla reference kernel, and the choice that runs it on TPUs only.

Block pairs come from real schedules: ring's full, causal and empty pairs, striped's causal
and strictly causal ones, and striped's pairs that a window cuts (splash's LocalMask),
with GQA (4 query heads on 2 K/V heads). Row 1 of each batch is
packed with three documents whose boundaries fall inside blocks, so some of its queries see
no key of a pair (out 0, lse -inf) next to ones that do. The backward gets a GLOBAL `Merged`
(its own out, dout and an lse that other blocks raised; a few queries that see nothing at
all, lse -inf), the same for both kernels, so a kernel that used its block's own statistics
would differ.

Tolerance: both compute in float32 on unit-normal inputs and differ only in summation order
and where the scale is applied (splash scales q before its matmul), so they agree to
float32 rounding: 1e-5 absolute and relative, as test_kernel_pallas, nothing coarser.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallelism import kernel_splash, kernel_xla, kernels
from parallelism.kernel_grads import Merged
from parallelism.masks import Mask, MaskSpec, Side
from parallelism.schedule import ring_schedule
from attention_helpers import packed_inputs, reference, ring_in_layout, seq_mesh

_F32_TOL = dict(atol=1e-5, rtol=1e-5)
N, BLOCK, HEADS, KV_HEADS, HEAD_DIM, TILE = 4, 256, 4, 2, 16, 128  # splash: 128-token blocks


def _segments(index_BT):
  """Row 0: one document; row 1: three, boundaries at original tokens 300 and 600."""
  seg = (index_BT >= 300).astype(np.int32) + (index_BT >= 600)
  seg[0] = 0
  return seg


def _pairs(layout, window=None):
  """(query device, key device) of each distinct pair of the layout's schedule."""
  schedule = ring_schedule(layout, N * BLOCK, N, window)
  found = {}
  for dq in range(N):
    for step in range(N):
      found.setdefault(int(schedule.pair[dq, step]), (dq, (dq - step) % N))
  return schedule, found


def _run(schedule, spec):
  """Both kernels' forward, then both backwards from one global Merged built from xla's."""
  @jax.jit
  def run(q, k, v, dout, out_g, lift, pair, q_seg, k_seg):
    mask = Mask(spec, Side(q_seg), Side(k_seg))
    at = dict(schedule=schedule, pair=pair, tile=TILE)
    want_fwd = kernel_xla.block_fwd(q, k, v, mask, **at)
    got_fwd = kernel_splash.block_fwd(q, k, v, mask, **at)
    merged = Merged.of(out_g, jnp.logaddexp(want_fwd[1], lift), dout)
    return (got_fwd, kernel_splash.block_bwd(q, k, v, mask, merged, **at),
            want_fwd, kernel_xla.block_bwd(q, k, v, mask, merged, **at))
  return run


def _errors(got, want):
  """(max abs error, max error relative to the largest |want|) over finite entries."""
  got, want = np.asarray(got), np.asarray(want)
  finite = np.isfinite(want)
  err = np.abs(got[finite] - want[finite]).max(initial=0.0)
  return err, err / max(np.abs(want[finite]).max(initial=0.0), 1e-30)


@pytest.mark.parametrize("layout, packed, softcap, window", [
    ("ring", True, 0.0, None), ("striped", True, 0.0, None), ("striped", False, 2.0, 300)])
def test_splash_matches_xla(layout, packed, softcap, window):
  """Forward (out, lse) and backward (dq, dk, dv) of every distinct pair of the layout;
  with a window every non-empty pair is one splash takes (a band), none left to xla."""
  rng = np.random.default_rng(0)
  q, dout, out_g = (rng.standard_normal((2, BLOCK, HEADS, HEAD_DIM), np.float32)
                    for _ in range(3))
  k, v = (rng.standard_normal((2, BLOCK, KV_HEADS, HEAD_DIM), np.float32) for _ in range(2))
  lift = rng.standard_normal((2, BLOCK, HEADS)).astype(np.float32) + 1.0
  lift[1, ::7] = -np.inf  # with the block's own -inf: queries that see nothing at all
  schedule, pairs = _pairs(layout, window)
  run = _run(schedule, MaskSpec(window, softcap=softcap))
  shapes, partly_seen = set(), False
  for pair, (dq, dk) in sorted(pairs.items()):
    segs = ((_segments(np.stack([schedule.order[d]] * 2)) for d in (dq, dk)) if packed
            else (None, None))
    got_fwd, got_bwd, want_fwd, want_bwd = run(q, k, v, dout, out_g, lift, pair, *segs)
    where = f"{layout} {schedule.shapes[pair]} pair (q block {dq}, k block {dk})"
    got_lse, want_lse = np.asarray(got_fwd[1]), np.asarray(want_fwd[1])
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse), err_msg=where)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, want in zip(names, (*got_fwd, *got_bwd[:3]), (*want_fwd, *want_bwd[:3])):
      assert not np.isnan(np.asarray(got)).any(), f"{name} NaN: {where}"
      finite = np.isfinite(np.asarray(want))
      np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite],
                                 err_msg=f"{name} {where}", **_F32_TOL)
      print(f"{where} {name}: max abs error %.2e, relative to max %.2e" % _errors(got, want))
    shapes.add(schedule.shapes[pair])
    assert kernel_splash.band(*(x[pair] for x in schedule.pair_index), window), where
    unseen_BT = np.isneginf(want_lse).all(-1)
    partly_seen |= bool((unseen_BT.any(-1) & ~unseen_BT.all(-1)).any())
  if window:
    assert "general" in shapes, shapes
  else:
    assert shapes == ({"full", "causal", "empty"} if layout == "ring"
                      else {"causal", "strictly_causal"}), shapes
  assert partly_seen, "the cases must include rows of which only some queries see keys"


def test_auto_runs_splash_on_tpus_only():
  """`auto` is splash where the backend is a TPU (attached or a plan's described slice),
  xla on the CPU; splash hands xla what it cannot take, saying why."""
  assert kernels.resolve("auto", "tpu") == "splash"
  assert kernels.resolve("auto", "cpu") == "xla" and kernels.resolve("auto", "gpu") == "cudnn"
  shape, kv_shape = (1, BLOCK, HEADS, HEAD_DIM), (1, BLOCK, KV_HEADS, HEAD_DIM)
  assert kernels.choose("splash", MaskSpec(softcap=5.0), shape, kv_shape, 512,
                        jnp.bfloat16) == ("splash", None)
  chosen, why = kernels.choose("splash", MaskSpec(8, narrowest=4), shape, kv_shape, TILE,
                               jnp.bfloat16)
  assert chosen == "xla" and "per-head windows" in why
  chosen, why = kernels.choose("splash", MaskSpec(), (1, 96, 4, 16), (1, 96, 2, 16), 32,
                               jnp.bfloat16)
  assert chosen == "xla" and "multiples of 128" in why
  assert kernel_splash.block_size(BLOCK, 512) == 128 and kernel_splash.block_size(1024, 512) == 512
  zigzag = ring_schedule("zigzag", N * BLOCK, N)  # its halves are no band: xla's
  assert not all(kernel_splash.band(q, k, None) for q, k in zip(*zigzag.pair_index))


@pytest.mark.slow(10)
def test_ring_attention_with_splash_matches_dense():
  """Striped ring attention over 4 fake devices, the splash kernel named: exact to dense."""
  inputs = packed_inputs(seq_len=N * 128, seed=5)
  got = ring_in_layout("striped", seq_mesh(N), *inputs, kernel="splash", tile_size=128)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, reference(*inputs)):
    np.testing.assert_allclose(g, np.asarray(w, np.float32), err_msg=name, **_F32_TOL)
