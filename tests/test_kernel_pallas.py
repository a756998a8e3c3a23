"""The Pallas block kernel (interpret mode on CPU) against dense attention.

Block pairs come from the static schedules of real layouts: device `dq`'s query block
against the key block of device `dk` in ring, striped and zigzag order, plus an order no
layout produces (tile-sized chunks shuffled: non-monotone indices, so SKIP and UNMASKED
tiles interleave and a row's UNMASKED tiles form several runs).
Row 1 of every batch is packed with three documents whose boundaries fall inside tiles, so
some of its queries see no key of some blocks (out 0, lse -inf) next to ones that do.

Tolerance: kernel and reference compute in float32 on unit-normal inputs (O(1) values,
D = 16) and differ only in summation order (tiled online softmax vs one dense softmax;
exp2 vs exp), so they agree to float32 rounding, a few ulps times the O(sqrt(T))
accumulation. `_F32_TOL` (1e-5 absolute and relative) allows that and nothing coarser, as
in test_ring_attention.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from parallelism import kernel_pallas, tiles
from parallelism.layouts import LAYOUTS
from parallelism.kernel_grads import Merged
from parallelism.masks import Mask, MaskSpec, Side
from parallelism.schedule import ring_schedule, schedule_of_order
from attention_helpers import dense_attention

_F32_TOL = dict(atol=1e-5, rtol=1e-5)
N, BLOCK, HEADS, HEAD_DIM, TILE = 4, 64, 4, 16, 16
PAIRS = ((0, 0), (2, 2), (2, 1), (1, 2), (3, 0))  # (query device, key device)


def _export_for_cuda(function, *avals):
  """`function` jitted and exported for CUDA from this CPU machine. Triton's lowering reads
  the target GPU from the context's abstract mesh (JAX 0.11: without one it looks for an
  attached GPU), so an H100 is named there, as a plan's described devices name theirs."""
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                   abstract_device=h100)
  with jax.sharding.use_abstract_mesh(mesh):
    return export.export(jax.jit(function), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)


def _segments(index_BT):
  """Row 0: one document; row 1: three, boundaries at original tokens 37 and 150."""
  seg = (index_BT >= 37).astype(np.int32) + (index_BT >= 150)
  seg[0] = 0
  return seg


def _schedule(layout: str):
  if layout == "shuffled":
    chunks = np.arange(N * BLOCK, dtype=np.int32).reshape(-1, TILE)
    return schedule_of_order(np.random.default_rng(0).permutation(chunks).reshape(-1), N)
  return ring_schedule(layout, N * BLOCK, N)


def _block_pair(layout: str, dq: int, dk: int):
  """(schedule, pair id, query segment ids, key segment ids) of device dq's query block on
  the key block of device dk."""
  schedule = _schedule(layout)
  pair = schedule.pair[dq, (dq - dk) % N]  # the step at which dq holds dk's block
  q_seg, k_seg = (_segments(np.stack([schedule.order[d]] * 2)) for d in (dq, dk))
  return schedule, pair, q_seg, k_seg


def _fwd_bwd(schedule, **config):
  """The Pallas forward, then its backward given that forward's lse and delta as the global
  ones."""
  @jax.jit
  def run(q, k, v, dout, pair, q_seg, k_seg):
    at = dict(schedule=schedule, pair=pair, tile=TILE, **config)
    mask = Mask(MaskSpec(), Side(q_seg), Side(k_seg))
    out, lse = kernel_pallas.block_fwd(q, k, v, mask, **at)
    delta = jnp.sum(out * dout, axis=-1)
    grads = kernel_pallas.block_bwd(q, k, v, mask, Merged(out, lse, dout, delta), **at)
    return out, lse, grads
  return run


# Jitted once for every layout and pair: the tokens' indices are arguments (a kernel's
# schedule is static, one compile per layout).
@jax.jit
def _dense_block(q, k, v, dout, q_index, q_seg, k_index, k_seg):
  """Dense attention of queries at original tokens `q_index` on keys at `k_index`: out,
  lse [B, T, H] (-inf where a query sees no key) and the pair's own gradients."""
  out, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, q_index, q_seg, k_index, k_seg),
                     q, k, v)
  group = q.shape[2] // k.shape[2]
  s_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, axis=2),
                      precision="highest") * q.shape[-1] ** -0.5
  visible_BQK = ((k_index[:, None, :] <= q_index[:, :, None])
                 & (k_seg[:, None, :] == q_seg[:, :, None]))
  lse_BHQ = jax.nn.logsumexp(jnp.where(visible_BQK[:, None], s_BHQK, -jnp.inf), axis=-1)
  return out, jnp.swapaxes(lse_BHQ, 1, 2), vjp(dout)


# Every call with query and key tiles of different sizes (each call's schedule at its own
# tiles, masks [query tile, key tile] read in each call's orientation).
_UNEVEN = kernel_pallas.KernelConfig(fwd_q=16, fwd_k=8, dkv_q=16, dkv_k=8, dq_q=8, dq_k=16)


# GQA (group 2) runs with the uneven tiles (each case is ~15 s of interpret-mode compiles;
# wider groups add nothing here: a group only indexes K/V heads, as in the xla kernel).
@pytest.mark.parametrize("group, config", [(1, None), (2, _UNEVEN)])
def test_block_matches_dense(group, config):
  """Forward and backward of every pair in PAIRS, in every layout and the shuffled order;
  ring's pair of device 1's queries on device 2's keys is wholly in the future (`empty`):
  zeros and lse -inf, exactly."""
  rng = np.random.default_rng(group)
  kv_shape = (2, BLOCK, HEADS // group, HEAD_DIM)
  q, dout = (rng.standard_normal((2, BLOCK, HEADS, HEAD_DIM), np.float32) for _ in range(2))
  k, v = (rng.standard_normal(kv_shape, np.float32) for _ in range(2))
  seen_some = partly_seen = wholly_future = 0
  for layout in (*LAYOUTS, "shuffled"):
    schedule = _schedule(layout)
    pallas = _fwd_bwd(schedule, **({"config": config} if config else {}))
    for dq, dk in PAIRS:
      _, pair, q_seg, k_seg = _block_pair(layout, dq, dk)
      # Packed rows exercise the segment mask; one layout also runs without segment ids.
      segs = (None, None) if layout == "ring" else (q_seg, k_seg)
      out, lse, grads = pallas(q, k, v, dout, pair, *segs)
      q_index, k_index = (np.stack([schedule.order[d]] * 2) for d in (dq, dk))
      if layout == "ring":  # one document: what no segment ids mean
        q_seg, k_seg = np.zeros_like(q_seg), np.zeros_like(k_seg)
      want_out, want_lse, want_grads = _dense_block(q, k, v, dout, q_index, q_seg, k_index,
                                                    k_seg)
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
      np.testing.assert_array_equal(np.asarray(grads[0])[unseen], 0.0, err_msg=where)
      if schedule.shapes[pair] == "empty":
        assert unseen.all(), where
        for name, got in zip(("dq", "dk", "dv"), grads):
          np.testing.assert_array_equal(np.asarray(got), 0.0, err_msg=f"{name} {where}")
        wholly_future += 1
      seen_some += int((~unseen).any())
      partly_seen += int((unseen.any(axis=(1, 2)) & (~unseen).any(axis=(1, 2))).any())
  assert seen_some and partly_seen, "the cases must include rows that see only some keys"
  assert wholly_future, "the cases must include a key block wholly in the future"


def test_cases_cover_every_tile_class():
  """The pairs above exercise SKIP, UNMASKED and MASKED tiles at the kernels' finest tiles
  (TILE here), rows where a SKIP tile lies between live ones, and rows whose UNMASKED tiles
  form more than one run."""
  found, skip_inside, split_runs = set(), False, False
  for layout in (*LAYOUTS, "shuffled"):
    for dq, dk in PAIRS:
      schedule, pair, _, _ = _block_pair(layout, dq, dk)
      plan = schedule.tiles(TILE)
      found |= set(np.unique(plan.classes[pair]).tolist())
      for row in plan.classes[pair]:
        live = np.flatnonzero(row != tiles.SKIP)
        skip_inside |= live.size > 0 and (live[-1] - live[0] + 1) > live.size
      split_runs |= (plan.by_query.num_runs[pair] > 1).any()
  assert found == {tiles.SKIP, tiles.UNMASKED, tiles.MASKED}
  assert skip_inside and split_runs


@pytest.mark.parametrize("packed", [False, True])
def test_kernels_lower_to_triton_for_cuda(monkeypatch, packed):
  """The Pallas kernels lower to Triton for a CUDA target (cross-lowering, no GPU needed):
  what interpret mode cannot catch, a construct Triton's lowering rejects, fails here. The
  packed case also has a sliding window and soft-capped logits (tanh in Triton)."""
  monkeypatch.setattr(kernel_pallas, "_interpret", lambda: False)
  schedule = ring_schedule("striped", 1024, 4, 300 if packed else None)
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)

  def fwd_bwd(q, k, v, seg, pair):
    seg = seg if packed else None
    attend = dict(schedule=schedule, pair=pair, tile=256)
    spec = MaskSpec(300, softcap=30.0) if packed else MaskSpec()
    mask = Mask(spec, Side(seg), Side(seg))
    out, lse = kernel_pallas.block_fwd(q, k, v, mask, **attend)
    delta = jnp.sum(out, axis=-1)
    return kernel_pallas.block_bwd(q, k, v, mask, Merged(out, lse, q, delta), **attend)

  exported = _export_for_cuda(fwd_bwd, q, kv, kv, seg, jax.ShapeDtypeStruct((), jnp.int32))
  assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 3  # fwd, dK/dV, dQ


def _dense(q, k, v, index, seg, window=None, softcap=0.0):
  """Plain causal attention in float32 (rows that see nothing give 0), optionally windowed
  and soft-capped."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  behind = index[:, :, None] - index[:, None, :]
  visible = (behind >= 0) & (behind < (window or behind.shape[-1] + 1)) & (
      seg[:, None, :] == seg[:, :, None])
  p = jnp.where(visible[:, None], jax.nn.softmax(jnp.where(visible[:, None], s, -jnp.inf)), 0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")



@pytest.mark.parametrize("q_len, heads, head_dim, tile", [
    (256, 6, 64, 256),  # GQA group 3: Pallas pads it
    (768, 4, 64, 256),  # a block of 3 x 256: the tiles are 64 and 128
    (256, 4, 96, 256),  # head_dim 96
    (100, 4, 64, 100),  # a block of 100: the ring clips the tile to it
    (192, 4, 64, 192),  # a block of 192: not a whole number of 128-token tiles
])
def test_auto_runs_xla_on_gpus_where_triton_cannot_lower(monkeypatch, q_len, heads, head_dim,
                                                         tile):
  """`kernel_pallas.gpu_unsupported` says no exactly where the CUDA cross-lowering of the
  forward and backward fails, and `auto` then runs xla for the blocks, and why: on an
  attached GPU instead of cudnn (whose pallas branches need the lowering too), for a plan's
  described GPUs instead of pallas (cuDNN's attention compiles only on an attached GPU)."""
  from parallelism import kernels
  schedule = ring_schedule("striped", 4 * q_len, 4)
  q = jax.ShapeDtypeStruct((1, q_len, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, q_len, 2, head_dim), jnp.bfloat16)
  reason = kernel_pallas.gpu_unsupported(q.shape, kv.shape, tile, q.dtype)
  monkeypatch.setattr(kernel_pallas, "_interpret", lambda: False)
  monkeypatch.setattr(kernel_pallas, "_check_shapes", lambda *_: None)  # Lower regardless.

  def fwd_bwd(q, k, v, pair):
    attend = dict(schedule=schedule, pair=pair, tile=tile)
    out, lse = kernel_pallas.block_fwd(q, k, v, Mask(), **attend)
    return kernel_pallas.block_bwd(q, k, v, Mask(), Merged(q, lse, q, lse), **attend)

  try:
    _export_for_cuda(fwd_bwd, q, kv, kv, jax.ShapeDtypeStruct((), jnp.int32))
    lowered = True
  except ValueError as error:  # Triton's lowering, or the kernel's own tile division.
    assert "power of 2" in str(error) or "not divisible by the kernel tile" in str(error)
    lowered = False
  assert lowered == (reason is None), reason
  cannot = f"the pallas kernel cannot take these attention blocks ({reason})"
  with kernels.target.compiling_for("gpu"):
    planned, why = kernels.choose("auto", MaskSpec(), q.shape, kv.shape, tile, q.dtype)
  assert why.startswith("the cudnn kernel cannot be planned for described GPUs")
  assert (planned, why.endswith(cannot)) == (("pallas", False) if lowered else ("xla", True))
  monkeypatch.setattr(kernels.target, "backend", lambda: "gpu")
  monkeypatch.setattr(kernels.kernel_cudnn, "unusable", lambda *_: None)  # as on a CUDA GPU
  assert kernels.choose("auto", MaskSpec(), q.shape, kv.shape, tile, q.dtype) == (
      ("cudnn", None) if lowered else ("xla", cannot))
