"""The `cudnn` block kernel: cuDNN's fused flash attention for the block pairs whose mask it
can express, the Pallas kernel for the rest; and cuDNN attention of whole rows, what
`model.attention='dense'` runs on a CUDA GPU. CUDA GPUs only.

It calls JAX's private cuDNN attention API, read in the source of the JAX versions in
`CHECKED_JAX` (tests/test_kernel_cudnn.py checks it on the CPU as far as a CPU can).
`auto` runs it on GPUs, as `model.kernel=cudnn` does (`kernels.choose` says where not).

Each distinct block pair of the static schedule has a mask shape (`schedule.shapes`); a
call branches once on it (`lax.switch` on the traced pair):
- full: cuDNN without a mask;
- causal (key j visible to query i iff j <= i, equal lengths): cuDNN's causal mask;
- strictly_causal (j < i): one aligned causal T x T call, the queries moved up a row (query
  i + 1 at row i); query 0 sees no key, the last row (zero) adds to no gradient;
- empty: out 0, lse -inf, zero gradients; general: the Pallas kernel.
With segment ids each document's piece of the pair is a sequence of cuDNN's packed layout
(`parallelism.cudnn_packing`); a call whose packing cannot express its mask (more documents
than its static count, say) runs the Pallas kernel instead, decided at run time.
Float32 operands or a head size cuDNN cannot take send the whole call to the Pallas kernel
(`pallas_reason`, at set-up: `kernels.choose`).

Forward: cuDNN also returns its softmax statistics, the natural-log log-sum-exp ([B, H, T];
per sequence when packed). Its backward takes statistics and output as inputs, so given the
ring's merged (global) lse and out it returns this block's share of the global gradient,
as Transformer Engine's context parallelism does; widened to float32 for the ring's sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallelism import cudnn_packing, kernel_pallas, target
from parallelism.kernel_grads import Grads, Merged
from parallelism.masks import Mask, MaskSpec
from parallelism.schedule import RingSchedule, by_pair_shape

# JAX versions whose jax/_src/cudnn/fused_attention_stablehlo.py this module was read
# against; on another the kernel stops with a message instead of calling what may differ.
CHECKED_JAX = ("0.10.2", "0.11.2")
_F32 = jnp.float32


def api():
  """JAX's private cuDNN attention module, on a checked JAX version only."""
  if jax.__version__ not in CHECKED_JAX:
    raise RuntimeError(f"the cudnn kernel {_unchecked_jax()}; model.kernel='auto' or "
                       f"'pallas' runs without it")
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  return fused_attention_stablehlo


def unusable(backend: str | None = None) -> str | None:
  """Why `cudnn` cannot run in this process at all, or None; said of the kernel ('needs a
  CUDA GPU; ...'), so that a named kernel's error and `auto`'s note can both use it."""
  backend = backend or target.backend()
  if backend != "gpu":
    return f"needs a CUDA GPU; this run's backend is {backend}"
  if target.described():
    return ("cannot be planned for described GPUs: cuDNN's attention compiles against the "
            "cuDNN library, which XLA's GPU compiler in .plan_gpu/ does not bring")
  if jax.__version__ not in CHECKED_JAX:
    return _unchecked_jax()
  platform = jax.devices()[0].client.platform_version  # 'gpu' is also ROCm's name
  if "cuda" not in platform.lower():
    return f"needs a CUDA GPU; this GPU's platform is {platform}"
  return None


def _unchecked_jax() -> str:
  return (f"uses JAX's private cuDNN attention API, checked against JAX "
          f"{' and '.join(CHECKED_JAX)}; this is JAX {jax.__version__} (check "
          f"parallelism/kernel_cudnn.py against it and add it to CHECKED_JAX)")


def pallas_reason(q_shape, dtype) -> str | None:
  """Why a call goes to the Pallas kernel whole, or None."""
  if dtype not in (jnp.bfloat16, jnp.float16):
    return f"{jnp.dtype(dtype)} operands: cuDNN's flash attention takes bf16 or fp16"
  head_dim = q_shape[3]
  if head_dim % 8 or head_dim > 128:
    return f"head size {head_dim}: cuDNN's flash attention here takes multiples of 8 up to 128"
  return None


def dense_reason(q_shape, dtype) -> str | None:
  """Why attention of whole rows (`model.attention='dense'`) cannot be cuDNN's here, or None."""
  return unusable() or pallas_reason(q_shape, dtype)


def dense_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, fallback) -> jax.Array:
  """Causal attention of whole rows by cuDNN, each packed document apart (cuDNN's packed
  layout); differentiable through JAX's own rule. A row of more documents than the packing
  takes runs `fallback(q, k, v, segment_ids)` instead."""
  cudnn = api()
  packing = cudnn_packing.whole_rows(segment_ids_BS, cudnn_packing.DOCUMENTS_PER_CALL)

  def by_cudnn(q, k, v):
    return cudnn.dot_product_attention(
        q, k, v, None, None, packing.q_lengths, packing.kv_lengths, packing.q_offsets,
        packing.kv_offsets, scale=q.shape[3] ** -0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH")

  return lax.cond(packing.exact, by_cudnn, lambda q, k, v: fallback(q, k, v, segment_ids_BS),
                  q_BSHD, k_BSKD, v_BSKD)


def _nothing_seen(q_BTHD):
  return (jnp.zeros(q_BTHD.shape, _F32), jnp.full(q_BTHD.shape[:3], -jnp.inf, _F32))


def _mask_type(causal: bool, packing):
  names = {(False, False): "NO_MASK", (True, False): "CAUSAL", (False, True): "PADDING",
           (True, True): "PADDING_CAUSAL"}
  return api().MaskType[names[causal, packing is not None]]


def _packed_args(packing, unused):
  """cuDNN's sequence lengths and offsets (packed documents), else 4 x `unused` (what the
  public forward takes for none, None; the backward primitive, an empty array)."""
  if packing is None:
    return (unused,) * 4
  return packing.q_lengths, packing.kv_lengths, packing.q_offsets, packing.kv_offsets


def _attend(q_BTHD, k_BTKD, v_BTKD, causal: bool, packing=None):
  """cuDNN's (out, lse [B, T, H]), both float32."""
  cudnn = api()
  out_BTHD, stats = cudnn.dot_product_attention(
      q_BTHD, k_BTKD, v_BTKD, None, None, *_packed_args(packing, None),
      scale=q_BTHD.shape[3] ** -0.5, qkv_layout="BTNH", mask_type=_mask_type(causal, packing),
      return_residual=True)
  batch, length, heads = q_BTHD.shape[:3]
  runs = 1 if packing is None else packing.q_lengths.shape[1]
  if stats.shape != (batch * runs, heads, length):
    raise RuntimeError(f"cuDNN's softmax statistics came back {stats.shape}, not [B x M, H, T]"
                       f" = {(batch * runs, heads, length)}: check kernel_cudnn against this JAX")
  if packing is None:
    return out_BTHD.astype(_F32), jnp.swapaxes(stats, 1, 2).astype(_F32)
  # Queries outside every sequence hold whatever cuDNN left there.
  out_BTHD = jnp.where(packing.q_covered[..., None, None], out_BTHD.astype(_F32), 0.0)
  return out_BTHD, cudnn_packing.lse_of_tokens(stats, packing)


def _grads(q_BTHD, k_BTKD, v_BTKD, merged: Merged, causal: bool, packing=None):
  """cuDNN's backward from the global out and lse: this block's (dq, dk, dv), float32."""
  cudnn = api()
  unused = jnp.zeros(0, q_BTHD.dtype)  # bias, page tables
  stats = (jnp.swapaxes(merged.lse, 1, 2) if packing is None
           else cudnn_packing.stats_of_tokens(merged.lse, packing))
  dq, dk, dv = cudnn._dot_product_attention_bwd_p_wrapper.bind(  # pylint: disable=protected-access
      q_BTHD, k_BTKD, v_BTKD, unused, *_packed_args(packing, unused), unused, unused,
      stats.astype(_F32), merged.out.astype(q_BTHD.dtype), merged.dout.astype(q_BTHD.dtype),
      scale=q_BTHD.shape[3] ** -0.5, seed=42, dropout_rate=0.0, variadic_args=(False, False),
      mask_type=_mask_type(causal, packing), layout=cudnn.AttentionLayout.BTNH.value,
      sliding_window_length=None)
  dq, dk, dv = dq.astype(_F32), dk.astype(_F32), dv.astype(_F32)
  if packing is None:
    return dq, dk, dv
  q_in, k_in = packing.q_covered[..., None, None], packing.k_covered[..., None, None]
  return jnp.where(q_in, dq, 0.0), jnp.where(k_in, dk, 0.0), jnp.where(k_in, dv, 0.0)


def unsupported(spec: MaskSpec) -> str | None:
  """What of a mask spec cuDNN's calls here cannot apply (`kernels.choose` runs pallas)."""
  if spec.softcap:
    return "the cudnn kernel has no logit soft-capping (model.attention_softcap)"
  if spec.head_spans:
    return "the cudnn kernel has no per-head windows (model.head_spans)"
  if spec.sparse != "none":
    return "the cudnn kernel has no run-time mask (model.sparse)"
  return None


def _check(spec: MaskSpec) -> None:
  reason = unsupported(spec)
  if reason:
    raise ValueError(f"{reason}: kernels.choose runs another kernel")


def _shifted(x_BT, first: bool):
  """A strictly causal pair's segment ids as a causal pair's: queries from row 1, keys up
  to row T-2 (the packing then leaves the last query and key row out of every sequence)."""
  if x_BT is None:
    return None
  return x_BT[:, 1:] if first else x_BT[:, :-1]


def _up_a_row(x_BT):
  """Row i + 1 at row i, zeros in the last row."""
  return jnp.pad(x_BT[:, 1:], [(0, 0), (0, 1)] + [(0, 0)] * (x_BT.ndim - 2))


def _down_a_row(x_BT, first):
  """Row i at row i + 1, `first` in row 0: `_up_a_row` undone, but for its lost row 0."""
  return jnp.concatenate([jnp.full_like(x_BT[:, :1], first), x_BT[:, :-1]], axis=1)


def _whole_length(packing):
  """A (T-1)-long strictly causal packing for the T-long call: the last row in no sequence."""
  if packing is None:
    return None
  def pad(x_BT):
    return jnp.pad(x_BT, ((0, 0), (0, 1)))  # False, or sequence/index 0 (read where covered)
  return packing._replace(q_covered=pad(packing.q_covered), k_covered=pad(packing.k_covered),
                          q_sequence=pad(packing.q_sequence), q_local=pad(packing.q_local))


def _by_cudnn_or_pallas(q_seg_BT, k_seg_BT, causal: bool, by_cudnn, by_pallas, nothing):
  """`by_cudnn(packing)` where cuDNN can take the call, else `by_pallas()`; with segment ids
  decided at run time by their packing, and `nothing()` where no document meets itself."""
  if q_seg_BT is None:
    return by_cudnn(None)
  packing = cudnn_packing.block_pair(q_seg_BT, k_seg_BT, causal,
                                     cudnn_packing.DOCUMENTS_PER_CALL)
  route = jnp.where(packing.exact, jnp.where(packing.any_pair, 1, 2), 0)
  return lax.switch(route, [by_pallas, lambda: by_cudnn(packing), nothing])


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, schedule: RingSchedule, pair,
              tile: int, index=None) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32)."""
  _check(mask.spec)
  q_seg_BT, k_seg_BT = mask.q.segment_ids, mask.k.segment_ids

  nothing = functools.partial(_nothing_seen, q_BTHD)

  def branch(shape: str, p: int):
    if shape == "empty":
      return nothing()
    by_pallas = functools.partial(kernel_pallas.block_fwd, q_BTHD, k_BTKD, v_BTKD, mask,
                                  schedule=schedule, pair=jnp.int32(p), tile=tile)
    if shape == "general":
      return by_pallas()
    if shape == "strictly_causal":
      def by_cudnn(packing):
        out, lse = _attend(_up_a_row(q_BTHD), k_BTKD, v_BTKD, True, _whole_length(packing))
        return _down_a_row(out, 0.0), _down_a_row(lse, -jnp.inf)
      return _by_cudnn_or_pallas(_shifted(q_seg_BT, True), _shifted(k_seg_BT, False), True,
                                 by_cudnn, by_pallas, nothing)
    causal = shape == "causal"
    return _by_cudnn_or_pallas(
        q_seg_BT, k_seg_BT, causal,
        lambda packing: _attend(q_BTHD, k_BTKD, v_BTKD, causal, packing), by_pallas, nothing)

  return by_pair_shape(schedule, pair, branch)


def block_bwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, schedule: RingSchedule,
              pair, tile: int, index=None) -> Grads:
  """Gradient contributions (float32) of one query block x key block, from the GLOBAL lse
  and out of `merged` (cuDNN forms delta from the out itself)."""
  _check(mask.spec)
  q_seg_BT, k_seg_BT = mask.q.segment_ids, mask.k.segment_ids

  def nothing():
    return Grads(*(jnp.zeros(x.shape, _F32) for x in (q_BTHD, k_BTKD, v_BTKD)))

  def branch(shape: str, p: int):
    if shape == "empty":
      return nothing()
    by_pallas = functools.partial(kernel_pallas.block_bwd, q_BTHD, k_BTKD, v_BTKD, mask,
                                  merged, schedule=schedule, pair=jnp.int32(p), tile=tile)
    if shape == "general":
      return by_pallas()
    if shape == "strictly_causal":
      def by_cudnn(packing):
        # The last row: q, out and dout 0, lse 0 (so P = 1): its softmax's gradient is 0,
        # and so its share of dk and dv. An aligned call: (T-1)-long ones run slower.
        dq, dk, dv = _grads(_up_a_row(q_BTHD), k_BTKD, v_BTKD,
                            Merged(*map(_up_a_row, merged)), True, _whole_length(packing))
        return Grads(_down_a_row(dq, 0.0), dk, dv)
      return _by_cudnn_or_pallas(_shifted(q_seg_BT, True), _shifted(k_seg_BT, False), True,
                                 by_cudnn, by_pallas, nothing)
    causal = shape == "causal"
    return _by_cudnn_or_pallas(
        q_seg_BT, k_seg_BT, causal,
        lambda packing: Grads(*_grads(q_BTHD, k_BTKD, v_BTKD, merged, causal, packing)),
        by_pallas, nothing)

  return by_pair_shape(schedule, pair, branch)
