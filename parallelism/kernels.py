"""The block-kernel contract and the registry of kernels that keep it.

A block kernel computes attention of one device's query block on one K/V block, the pair
the static schedule (`parallelism.schedule`) gives that device at that ring step:

    block_fwd(q_BTHD, k_BTKD, v_BTKD, q_seg_BT, k_seg_BT, *, schedule, pair, tile,
              softcap=0.0[, spans_H][, q_codes_BTH, k_codes_BTK]) -> (out_BTHD, lse_BTH)
    block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, q_seg_BT, k_seg_BT, *,
              schedule, pair, tile, out_BTHD=None, softcap=0.0[, spans_H][, q_codes_BTH,
              k_codes_BTK])
              -> (dq_BTHD, dk_BTKD, dv_BTKD)

- q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], Hq % Hkv == 0 (q head h reads kv head
  h // (Hq / Hkv)), in the compute dtype; segment ids [B, T] int32 or None (one document).
- `schedule` is static, `pair` a traced int32 (`schedule.pair[device, step]`); a kernel
  reads its tile tables at its own tile sizes, no coarser than `tile`, or branches once per
  call on the pair's mask shape (`schedule.shapes[p]`) with `lax.switch`.
- `softcap` > 0 caps each logit (scaled q.k) at `softcap * tanh(logit / softcap)` (Gemma 2).
- `spans_H` ([Hq] int32, only with per-head spans; xla and pallas): query head h sees keys
  fewer than `spans_H[h]` positions back; MASKED tiles narrow their mask by it (the
  schedule's `narrowest` and `window` bound the spans; `RingSchedule.pair_index`).
- `q_codes_BTH` [B, Tq, Hq] and `k_codes_BTK` [B, Tk, Hkv] (int32, only with hash attention;
  xla only): a run-time mask, like segment ids, applied in every computed tile: query head h
  sees a key only where its code equals the key's code of kv head h // (Hq / Hkv).
- Forward: the block's output and natural-log log-sum-exp, float32; a query that sees no key
  gets output 0 and lse -inf, never NaN. Backward: from the GLOBAL lse and `delta = sum(dout
  * out, -1)` (and the global output `out_BTHD`, for cuDNN, whose backward forms delta
  itself), this block's dq, dk, dv in float32.

`xla` is the reference (any backend); `pallas` is fused (Triton on GPUs, interpreted on the
CPU); `cudnn` is cuDNN's flash attention where the pair's mask allows, `pallas` elsewhere.
`auto` resolves per backend; the kernel a setup runs is chosen once for its blocks
(`choose`, from `parallelism.split`). A new kernel is one module and one line in `KERNELS`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from parallelism import kernel_cudnn, kernel_pallas, kernel_xla, target

AUTO = "auto"


class BlockKernel(NamedTuple):
  fwd: Callable
  bwd: Callable


KERNELS = {
    "xla": BlockKernel(kernel_xla.block_fwd, kernel_xla.block_bwd),
    "pallas": BlockKernel(kernel_pallas.block_fwd, kernel_pallas.block_bwd),
    "cudnn": BlockKernel(kernel_cudnn.block_fwd, kernel_cudnn.block_bwd),
}


def resolve(name: str, backend: str | None = None) -> str:
  """The kernel `name` runs on `backend` (default: `target.backend()`, JAX's or a plan's
  described GPUs). `auto` is `pallas` on GPUs (fused; `xla` holds every tile's scores in
  memory) and `xla` elsewhere: on the CPU `pallas` only interprets, and its Triton kernel
  has no TPU (Mosaic) lowering. Not `cudnn`, until it is measured against `pallas` on a GPU
  (`make gpu_check`)."""
  check_name(name)
  if name != AUTO:
    return name
  return "pallas" if (backend or target.backend()) == "gpu" else "xla"


def check_name(name: str) -> None:
  if name != AUTO and name not in KERNELS:
    raise ValueError(f"unknown attention kernel '{name}'; choose one of {(AUTO, *KERNELS)}")


def describe(name: str, backend: str | None = None) -> str:
  """`name` as the run states it: 'xla', or 'auto on cpu: xla'."""
  backend = backend or target.backend()
  kernel = resolve(name, backend)
  return kernel if kernel == name else f"{name} on {backend}: {kernel}"


def choose(name: str, q_shape, k_shape, tile: int, dtype, softcap: float = 0.0,
           head_spans: bool = False, buckets: bool = False) -> tuple[str, str | None]:
  """The kernel that runs `name` on blocks of these shapes, and why it is not the one `name`
  resolves to (None when it is): blocks Triton cannot take run `xla` under `auto`; operands
  cuDNN cannot take, capped logits or per-head spans (`head_spans`) run `pallas` under
  `cudnn`; bucket codes (`buckets`, hash attention) run `xla`, the one kernel that applies
  them. Decided once per attention setup (`parallelism.split`), never per call."""
  chosen = resolve(name)
  if buckets and chosen != "xla":
    return "xla", f"the {chosen} kernel has no bucket mask (model.sparse='hash')"
  if chosen == "cudnn" and softcap:
    return "pallas", "the cudnn kernel has no logit soft-capping (model.attention_softcap)"
  if chosen == "cudnn" and head_spans:
    return "pallas", "the cudnn kernel has no per-head windows (model.head_spans)"
  if name == AUTO and chosen == "pallas":
    reason = kernel_pallas.gpu_unsupported(q_shape, k_shape, tile, dtype)
    return ("xla", f"the pallas kernel cannot take these attention blocks ({reason})"
            ) if reason else (chosen, None)
  if chosen == "cudnn":
    reason = kernel_cudnn.pallas_reason(q_shape, dtype)
    return ("pallas", f"the cudnn kernel cannot take these attention blocks ({reason})"
            ) if reason else (chosen, None)
  return chosen, None


def for_blocks(name: str, q_shape, k_shape, tile: int, dtype,
               softcap: float = 0.0) -> BlockKernel:
  """The block kernel that runs `name` on blocks of these shapes (`choose`)."""
  return KERNELS[choose(name, q_shape, k_shape, tile, dtype, softcap)[0]]
