"""The `splash` block kernel: JAX's Pallas TPU splash attention for the block pairs whose
mask it can express, the `xla` kernel for the rest. What `auto` runs on TPUs; elsewhere (the
CPU, in tests) splash runs in Pallas's interpret mode.

Splash is a maintained kernel library (`jax.experimental.pallas.ops.tpu.splash_attention`),
so this module only maps the contract onto it. A call branches once on the distinct block
pair (`lax.switch`, static per pair): an `empty` pair gives out 0, lse -inf, zero gradients.
Where both blocks' tokens are evenly spaced with one stride (ring's and striped's blocks),
what query i sees of key j is a band of i - j (`band`): splash's FullMask, CausalMask with
an offset (causal, strictly causal: splash's rule i + offset >= j) or, with a window,
LocalMask; splash builds its block-sparse MaskInfo on the host, once per band (`_splash`).
Other pairs (zigzag's halves) run the xla kernel.
Packed documents are its SegmentIds; GQA its MHA path with fewer K/V heads (q head h reads
K/V head h // G, as the contract). Splash takes no softmax scale: q is scaled before the
call (dq by the scale after); its soft cap then caps the scaled logits, as `masks.logits`.

Forward: the public kernel with `save_residuals=True`, whose residual is the natural-log
logsumexp (`log(l) + m`, [H, T]). Backward: splash's private dq and dK/dV kernels take the
logsumexp and `di` (delta) as inputs, so given the ring's GLOBAL lse and delta they return
this pair's share of the global gradient; they are read against the JAX versions in
`CHECKED_JAX` (another stops with a message). Output and gradients come in the operands'
dtype, widened to float32 for the ring's merge and sums (as cuDNN's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from parallelism import kernel_xla, target
from parallelism.kernel_grads import Grads, Merged
from parallelism.masks import Mask, MaskSpec
from parallelism.schedule import RingSchedule, by_pair_shape

# JAX versions whose splash_attention_kernel.py (`_splash_attention_bwd_dq`, `_dkv`, the
# logsumexp residual) this module was read against.
CHECKED_JAX = ("0.11.2",)
LANES = 128  # splash's key blocks (and the dK/dV kernel's query blocks) are lane multiples
_F32 = jnp.float32


def api():
  """Splash's kernel and mask modules, on a checked JAX version only."""
  if jax.__version__ not in CHECKED_JAX:
    raise RuntimeError(f"the splash kernel {_unchecked_jax()}")
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask
  return splash_attention_kernel, splash_attention_mask


def _unchecked_jax() -> str:
  return (f"calls splash attention's private backward, checked against JAX "
          f"{' and '.join(CHECKED_JAX)}; this is JAX {jax.__version__} (check "
          f"parallelism/kernel_splash.py against it and add it to CHECKED_JAX)")


def unsupported(spec: MaskSpec) -> str | None:
  """What of a mask spec splash's calls here cannot apply (`kernels.choose` runs xla)."""
  if spec.head_spans:
    return "the splash kernel has no per-head windows (model.head_spans)"
  if spec.sparse != "none":
    return "the splash kernel has no run-time mask (model.sparse)"
  return None


def block_size(length: int, tile: int) -> int | None:
  """Splash's query and key block: the tile where it is a multiple of 128, else 128; None
  where neither divides the block's `length`."""
  for size in (tile, LANES):
    if size % LANES == 0 and length % size == 0:
      return size
  return None


def shape_reason(q_shape, tile: int) -> str | None:
  """Why blocks of this shape run the xla kernel instead (at set-up: `kernels.choose`)."""
  if jax.__version__ not in CHECKED_JAX:
    return f"the splash kernel {_unchecked_jax()}"
  if block_size(q_shape[1], tile) is None:
    return (f"attention blocks of {q_shape[1]} tokens: splash's blocks are multiples of "
            f"{LANES} that divide them")
  return None


def _interpret() -> bool:
  """Mosaic compiles for TPUs only (attached, or described to a plan); elsewhere splash
  runs interpreted, which is how the tests check it on the CPU."""
  return target.backend() != "tpu"


def band(q_index_T, k_index_T, window: int | None) -> tuple[int, int | None] | None:
  """(lo, hi): query i of the pair sees key j (segment ids aside) iff lo <= i - j <= hi
  (hi None: no bound), where both blocks' original token indices are evenly spaced with one
  stride; None where they are not. Query i's distance to key j is then
  stride * (i - j) + gap, seen from 0 to the window less one (`masks.visible`)."""
  q, k = (np.asarray(x, np.int64) for x in (q_index_T, k_index_T))
  stride = int(q[1] - q[0]) if q.size > 1 else 1
  if stride < 1 or (np.diff(q) != stride).any() or (np.diff(k) != stride).any():
    return None
  gap, length = int(q[0] - k[0]), q.size
  lo = max(-(gap // stride), 1 - length)  # below 1 - T every key is on that side
  hi = None if window is None else (window - 1 - gap) // stride
  return lo, (None if hi is None or hi >= length - 1 else hi)


@functools.lru_cache(maxsize=64)
def _splash(lo: int, hi: int | None, length: int, heads: int, block: int, softcap: float,
            interpret: bool):
  """Splash's kernel for one band (`band`): its MaskInfo (forward, dq, dK/dV) is built with
  NumPy here, once per band, length, heads and block."""
  kernel_lib, mask_lib = api()
  size = (length, length)
  if hi is not None:  # i - lo - (hi - lo) <= j <= i - lo
    one = mask_lib.LocalMask(size, window_size=(hi - lo, 0), offset=-lo)
  elif lo > 1 - length:  # j <= i - lo
    one = mask_lib.CausalMask(size, offset=-lo)
  else:
    one = mask_lib.FullMask(size)
  sizes = kernel_lib.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  with jax.ensure_compile_time_eval():  # concrete MaskInfo arrays, safe to cache across traces
    return kernel_lib.make_splash_mha(
        mask_lib.MultiHeadMask([one] * heads), block_sizes=sizes, save_residuals=True,
        attn_logits_soft_cap=softcap or None, head_shards=1, q_seq_shards=1,
        interpret=interpret)


def _kernel(schedule: RingSchedule, p: int, q_BTHD, spec: MaskSpec, tile: int):
  """Splash's kernel for distinct pair `p`, or None where its mask is no band."""
  length = q_BTHD.shape[1]
  block = block_size(length, tile)
  if block is None:
    raise ValueError(f"model.kernel='splash': {shape_reason(q_BTHD.shape, tile)}")
  bounds = band(*(index_PT[p] for index_PT in schedule.pair_index), spec.window)
  if bounds is None:
    return None
  return _splash(*bounds, length, q_BTHD.shape[2], block, float(spec.softcap), _interpret())


def _heads_first(*xs_BTH):
  """[B, T, H, ...] -> [B, H, T, ...], splash's layout (vmapped over B)."""
  return tuple(jnp.swapaxes(x, 1, 2) for x in xs_BTH)


def _segments(mask: Mask):
  if mask.q.segment_ids is None:
    return None
  return api()[0].SegmentIds(mask.q.segment_ids, mask.k.segment_ids)


def _splash_fwd(kernel, q_BTHD, k_BTKD, v_BTKD, mask: Mask):
  """Splash's (out, lse), float32 [B, T, H, D] and [B, T, H]. A query that sees no key of
  the pair comes back as the mean of V with an lse near splash's mask value (its masked
  logits), or NaN and -inf where no tile of its row ran: 0 and -inf here."""
  scale = q_BTHD.shape[3] ** -0.5
  q, k, v = _heads_first(q_BTHD * scale, k_BTKD, v_BTKD)
  out_BHTD, (lse_BHT,) = jax.vmap(kernel)(q, k, v, _segments(mask))
  out_BTHD, lse_BTH = jnp.swapaxes(out_BHTD, 1, 2), jnp.swapaxes(lse_BHT, 1, 2)
  seen_BTH = lse_BTH > kernel.kwargs["mask_value"] / 2  # real logits are never near it
  return (jnp.where(seen_BTH[..., None], out_BTHD.astype(_F32), 0.0),
          jnp.where(seen_BTH, lse_BTH.astype(_F32), -jnp.inf))


def _splash_bwd(kernel, q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged) -> Grads:
  """Splash's dq and dK/dV kernels (private), given the GLOBAL lse and delta."""
  kernel_lib = api()[0]
  kwargs, sizes = kernel.kwargs, kernel.kwargs["block_sizes"]
  common = dict(is_mqa=False, mask_value=kwargs["mask_value"],
                attn_logits_soft_cap=kwargs["attn_logits_soft_cap"],
                q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
                mask_function=kwargs["mask_function"], interpret=kwargs["interpret"])
  scale = q_BTHD.shape[3] ** -0.5

  def one_row(q, k, v, segments, lse, dout, delta):
    # The no-sinks argument is None; a query that sees no key globally has lse +inf.
    _, dk, dv = kernel_lib._splash_attention_bwd_dkv(  # pylint: disable=protected-access
        q, k, v, segments, None, lse, dout, delta, bq=sizes.block_q_dkv,
        bkv=sizes.block_kv_dkv, bkv_compute=sizes.block_kv_dkv_compute,
        mask_info=kernel.dkv_mask_info, use_fused_bwd_kernel=False, **common)
    dq = kernel_lib._splash_attention_bwd_dq(  # pylint: disable=protected-access
        q, k, v, segments, None, lse, dout, delta, bq=sizes.block_q_dq,
        bkv=sizes.block_kv_dq, mask_info=kernel.dq_mask_info, **common)
    return dq, dk, dv

  operands = _heads_first(q_BTHD * scale, k_BTKD, v_BTKD)
  rows = _heads_first(merged.safe_lse(), merged.dout.astype(q_BTHD.dtype),
                      merged.delta.astype(_F32))
  dq, dk, dv = jax.vmap(one_row)(*operands, _segments(mask), *rows)
  dq, dk, dv = _heads_first(dq, dk, dv)  # (the swap is its own inverse)
  return Grads(dq.astype(_F32) * scale, dk.astype(_F32), dv.astype(_F32))


def _check(spec: MaskSpec) -> None:
  reason = unsupported(spec)
  if reason:
    raise ValueError(f"{reason}: kernels.choose runs another kernel")


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, schedule: RingSchedule, pair,
              tile: int, index=None) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32)."""
  _check(mask.spec)

  def branch(shape: str, p: int):
    if shape == "empty":
      return (jnp.zeros(q_BTHD.shape, _F32), jnp.full(q_BTHD.shape[:3], -jnp.inf, _F32))
    kernel = _kernel(schedule, p, q_BTHD, mask.spec, tile)
    if kernel is None:
      return kernel_xla.block_fwd(q_BTHD, k_BTKD, v_BTKD, mask, schedule=schedule,
                                  pair=jnp.int32(p), tile=tile, index=index)
    return _splash_fwd(kernel, q_BTHD, k_BTKD, v_BTKD, mask)

  return by_pair_shape(schedule, pair, branch)


def block_bwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, schedule: RingSchedule,
              pair, tile: int, index=None) -> Grads:
  """Gradient contributions (float32) of one query block x key block, from the GLOBAL lse
  and delta of `merged`."""
  _check(mask.spec)

  def branch(shape: str, p: int):
    if shape == "empty":
      return Grads(*(jnp.zeros(x.shape, _F32) for x in (q_BTHD, k_BTKD, v_BTKD)))
    kernel = _kernel(schedule, p, q_BTHD, mask.spec, tile)
    if kernel is None:
      return kernel_xla.block_bwd(q_BTHD, k_BTKD, v_BTKD, mask, merged, schedule=schedule,
                                  pair=jnp.int32(p), tile=tile, index=index)
    return _splash_bwd(kernel, q_BTHD, k_BTKD, v_BTKD, mask, merged)

  return by_pair_shape(schedule, pair, branch)
