"""The `cudnn` block kernel: cuDNN's fused flash attention for the block pairs whose mask it
can express, the Pallas kernel for the rest. CUDA GPUs only.

NOT YET RUN ON A GPU (issue #16). It calls JAX's private cuDNN attention API, read in the
source of the JAX versions in `CHECKED_JAX` (identical there) and checked on the CPU only
as far as the names and parameters it uses (tests/test_kernel_cudnn.py). `auto` does not
pick it; `model.kernel=cudnn` does. Its first GPU run is `scripts/bench_kernel.py --parts
cudnn_kernel`: against the Pallas kernel and the xla reference on causal and strictly causal
blocks.

Each distinct block pair of the static schedule has a mask shape (`schedule.shapes`); a
call branches once on it (`lax.switch` on the traced pair):
- full: cuDNN without a mask;
- causal (key j visible to query i iff j <= i, equal lengths): cuDNN's causal mask;
- strictly_causal (j < i): the causal (T-1) x (T-1) pair shifted by a row: queries 1..T-1
  on keys 0..T-2. Query 0 sees no key of the block (out 0, lse -inf) and key T-1 no query
  (zero dK, dV);
- empty: out 0, lse -inf, zero gradients;
- general: the Pallas kernel.
Packed documents (segment ids), float32 operands or a head size cuDNN cannot take send the
whole call to the Pallas kernel (`pallas_reason`; `kernels.get` routes it and says so once).
The trainer's batches always carry segment ids (`data/packing.py`, padding included), so in
`python -m trainer` this kernel is Pallas until it uses cuDNN's packed layout
(`q_offsets`/`kv_offsets`); without segment ids (benchmarks, direct `ring_attention`
callers) it is cuDNN.

Forward: `dot_product_attention(..., return_residual=True)` also returns cuDNN's softmax
statistics, the natural-log log-sum-exp of the scaled scores, [B, H, T]. Backward: cuDNN's
backward primitive takes those statistics and the forward output as inputs, so handing it
the ring's merged (global) lse and out makes it return this block's share of the global
gradient, as Transformer Engine's context parallelism does. cuDNN returns dq, dk, dv in the
operands' dtype; they are widened to float32 for the ring's sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import kernel_pallas, target
from parallelism.schedule import RingSchedule

# JAX versions whose jax/_src/cudnn/fused_attention_stablehlo.py this module was read
# against; on another the kernel stops with a message instead of calling what may differ.
CHECKED_JAX = ("0.10.2", "0.11.2")
_F32 = jnp.float32


def api():
  """JAX's private cuDNN attention module, on a checked JAX version only."""
  if jax.__version__ not in CHECKED_JAX:
    raise RuntimeError(
        f"model.kernel='cudnn' uses JAX's private cuDNN attention API, checked against JAX "
        f"{' and '.join(CHECKED_JAX)}; this is JAX {jax.__version__}. Use model.kernel="
        f"'pallas', or check parallelism/kernel_cudnn.py against this version and add it "
        f"to CHECKED_JAX")
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  return fused_attention_stablehlo


def unusable(backend: str | None = None) -> str | None:
  """Why `cudnn` cannot run in this process at all, or None."""
  backend = backend or target.backend()
  if backend != "gpu":
    return f"model.kernel='cudnn' needs a CUDA GPU; this run's backend is {backend}"
  if target.described():
    return ("model.kernel='cudnn' cannot be planned for described GPUs: cuDNN's attention "
            "compiles against the cuDNN library, which XLA's GPU compiler in .plan_gpu/ does "
            "not bring; plan with model.kernel=pallas, or on a GPU")
  platform = jax.devices()[0].client.platform_version  # 'gpu' is also ROCm's name
  if "cuda" not in platform.lower():
    return f"model.kernel='cudnn' needs a CUDA GPU; this GPU's platform is {platform}"
  return None


def pallas_reason(q_shape, dtype, segments: bool) -> str | None:
  """Why a call goes to the Pallas kernel whole, or None."""
  if segments:
    return "packed documents (segment ids): cuDNN's causal and no-mask kernels cannot mask them"
  if dtype not in (jnp.bfloat16, jnp.float16):
    return f"{jnp.dtype(dtype)} operands: cuDNN's flash attention takes bf16 or fp16"
  head_dim = q_shape[3]
  if head_dim % 8 or head_dim > 128:
    return f"head size {head_dim}: cuDNN's flash attention here takes multiples of 8 up to 128"
  return None


def _nothing_seen(q_BTHD):
  return (jnp.zeros(q_BTHD.shape, _F32), jnp.full(q_BTHD.shape[:3], -jnp.inf, _F32))


def _attend(q_BTHD, k_BTKD, v_BTKD, causal: bool):
  """cuDNN's (out, lse [B, T, H]), both float32."""
  cudnn = api()
  out_BTHD, stats = cudnn.dot_product_attention(
      q_BTHD, k_BTKD, v_BTKD, scale=q_BTHD.shape[3] ** -0.5, qkv_layout="BTNH",
      mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK,
      return_residual=True)
  batch, length, heads = q_BTHD.shape[:3]
  if stats.shape != (batch, heads, length):
    raise RuntimeError(f"cuDNN's softmax statistics came back {stats.shape}, not [B, H, T] = "
                       f"{(batch, heads, length)}: check kernel_cudnn against this JAX")
  return out_BTHD.astype(_F32), jnp.swapaxes(stats, 1, 2).astype(_F32)


def _grads(q_BTHD, k_BTKD, v_BTKD, out_BTHD, dout_BTHD, lse_BTH, causal: bool):
  """cuDNN's backward from the global out and lse: this block's (dq, dk, dv), float32."""
  cudnn = api()
  unused = jnp.zeros(0, q_BTHD.dtype)  # bias, sequence lengths, offsets, page tables
  dq, dk, dv = cudnn._dot_product_attention_bwd_p_wrapper.bind(  # pylint: disable=protected-access
      q_BTHD, k_BTKD, v_BTKD, unused, unused, unused, unused, unused, unused, unused,
      jnp.swapaxes(lse_BTH, 1, 2).astype(_F32), out_BTHD.astype(q_BTHD.dtype),
      dout_BTHD.astype(q_BTHD.dtype), scale=q_BTHD.shape[3] ** -0.5, seed=42,
      dropout_rate=0.0, variadic_args=(False, False),
      mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK,
      layout=cudnn.AttentionLayout.BTNH.value, sliding_window_length=None)
  return dq.astype(_F32), dk.astype(_F32), dv.astype(_F32)


def _by_shape(schedule: RingSchedule, pair, branch):
  """`branch(shape, p)` of the traced `pair`, one static branch per distinct pair."""
  branches = [functools.partial(branch, shape, p) for p, shape in enumerate(schedule.shapes)]
  return branches[0]() if len(branches) == 1 else lax.switch(pair, branches)


def block_fwd(q_BTHD, k_BTKD, v_BTKD, q_seg_BT, k_seg_BT, *, schedule: RingSchedule, pair,
              tile: int) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32).
  Segment ids are never given here (`pallas_reason`)."""
  del q_seg_BT, k_seg_BT

  def branch(shape: str, p: int):
    if shape == "empty":
      return _nothing_seen(q_BTHD)
    if shape == "general":
      return kernel_pallas.block_fwd(q_BTHD, k_BTKD, v_BTKD, None, None, schedule=schedule,
                                     pair=jnp.int32(p), tile=tile)
    if shape == "strictly_causal":
      out, lse = _attend(q_BTHD[:, 1:], k_BTKD[:, :-1], v_BTKD[:, :-1], causal=True)
      row0_out, row0_lse = _nothing_seen(q_BTHD[:, :1])
      return (jnp.concatenate([row0_out, out], axis=1),
              jnp.concatenate([row0_lse, lse], axis=1))
    return _attend(q_BTHD, k_BTKD, v_BTKD, causal=shape == "causal")

  return _by_shape(schedule, pair, branch)


def block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, q_seg_BT, k_seg_BT, *,
              schedule: RingSchedule, pair, tile: int, out_BTHD=None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradient contributions (dq, dk, dv, float32) of one query block x key block, from the
  GLOBAL lse and out (`out_BTHD`; cuDNN forms delta from it itself)."""
  del q_seg_BT, k_seg_BT  # never given (`pallas_reason`)
  if out_BTHD is None:
    raise ValueError("the cudnn kernel's backward needs the global output (out_BTHD)")

  def branch(shape: str, p: int):
    if shape == "empty":
      return tuple(jnp.zeros(x.shape, _F32) for x in (q_BTHD, k_BTKD, v_BTKD))
    if shape == "general":
      return kernel_pallas.block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH,
                                     None, None, schedule=schedule, pair=jnp.int32(p),
                                     tile=tile)
    if shape == "strictly_causal":
      dq, dk, dv = _grads(q_BTHD[:, 1:], k_BTKD[:, :-1], v_BTKD[:, :-1], out_BTHD[:, 1:],
                          dout_BTHD[:, 1:], lse_BTH[:, 1:], causal=True)
      first_row, last_key = ((0, 0), (1, 0), (0, 0), (0, 0)), ((0, 0), (0, 1), (0, 0), (0, 0))
      return jnp.pad(dq, first_row), jnp.pad(dk, last_key), jnp.pad(dv, last_key)
    return _grads(q_BTHD, k_BTKD, v_BTKD, out_BTHD, dout_BTHD, lse_BTH,
                  causal=shape == "causal")

  return _by_shape(schedule, pair, branch)
