"""The block-kernel contract and the registry of kernels that keep it.

A block kernel computes attention of one device's query block on the K/V block the static
schedule (`parallelism.schedule`) gives that device at that ring step:

    block_fwd(q, k, v, q_seg, k_seg, *, schedule, pair, tile, softcap=0.0[, spans_H]
              [, q_codes_BTH, k_codes_BTK]) -> (out_BTHD, lse_BTH)
    block_bwd(q, k, v, dout, lse, delta, q_seg, k_seg, *, schedule, pair, tile,
              out_BTHD=None, ...as block_fwd) -> (dq_BTHD, dk_BTKD, dv_BTKD)

- q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] (head h reads kv head h // (Hq / Hkv)), segments
  [B, T] int32 or None; `softcap` > 0 caps each logit at `softcap * tanh(logit / softcap)`.
- `schedule` is static, `pair` a traced int32 (`schedule.pair[device, step]`); a kernel
  reads its tile tables (tiles no coarser than `tile`) or switches on `schedule.shapes[p]`.
- `spans_H` ([Hq] int32; xla, pallas): head h sees keys fewer than `spans_H[h]` back; MASKED
  tiles narrow their mask by it (the schedule's `narrowest` and `window` bound the spans).
- `q_codes_BTH`, `k_codes_BTK` (xla): hash/QK-dropping's int32 codes, a key seen only where
  they are equal (`kernel_hash`); with `sparsek_window`, SparseK's float32 thresholds and
  scores, a soft mask whose gradients (dtau, du) block_bwd also returns (`kernel_sparsek`).
- Forward: output and natural-log lse, float32 (no key seen: 0 and -inf, never NaN).
  Backward: float32 dq, dk, dv from the GLOBAL lse and `delta = sum(dout * out, -1)`.

`xla` is the reference (any backend); `pallas` is fused (Triton on GPUs, interpreted on the
CPU); `cudnn` is cuDNN's flash attention where the pair's mask allows. `auto` resolves per
backend, once per setup (`choose`). A new kernel is one module and one line in `KERNELS`.
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
  described GPUs). `auto` is `cudnn` on GPUs, the faster fused kernel there by `make
  gpu_check` (figures: README, results/gpu_check/), and `xla` elsewhere: on the CPU `pallas`
  only interprets, and neither has a TPU lowering. Where cuDNN cannot take a layer, `choose`
  goes on to `pallas`, then `xla`."""
  check_name(name)
  if name != AUTO:
    return name
  return "cudnn" if (backend or target.backend()) == "gpu" else "xla"


def check_name(name: str) -> None:
  if name != AUTO and name not in KERNELS:
    raise ValueError(f"unknown attention kernel '{name}'; choose one of {(AUTO, *KERNELS)}")


def describe(name: str, backend: str | None = None) -> str:
  """`name` as the run states it: 'xla', or 'auto on cpu: xla'."""
  backend = backend or target.backend()
  kernel = resolve(name, backend)
  return kernel if kernel == name else f"{name} on {backend}: {kernel}"


def choose(name: str, q_shape, k_shape, tile: int, dtype, softcap: float = 0.0,
           head_spans: bool = False, buckets: bool = False,
           general: bool = False) -> tuple[str, str | None]:
  """The kernel that runs `name` on blocks of these shapes, and why it is not the one `name`
  resolves to (None when it is). Bucket codes (`buckets`, hash attention) run `xla`, the one
  kernel that applies them. Under `cudnn`, operands cuDNN cannot take, capped logits and
  per-head spans (`head_spans`) run `pallas`. `auto` on GPUs goes on from there: `pallas`
  also where cuDNN cannot run here (a plan's described GPUs, another JAX) and for schedules
  with `general` blocks (windows, zigzag), which the cudnn kernel hands to pallas anyway
  (and was measured slower doing so); then `xla` where Triton cannot take the blocks, which
  the cudnn kernel's own pallas branches need too. Decided once per attention setup
  (`parallelism.split`), never per call."""
  chosen = resolve(name)
  if buckets and chosen != "xla":
    return "xla", f"the {chosen} kernel has no bucket mask (model.sparse's run-time codes)"
  reasons = []
  if chosen == "cudnn":
    reason = _cudnn_reason(q_shape, dtype, softcap, head_spans, auto=name == AUTO)
    if name == AUTO and general and not reason:
      reason = ("blocks whose masks cuDNN cannot express (a window, zigzag's halves): the "
                "cudnn kernel would hand them to pallas")
    if reason:
      chosen, reasons = "pallas", [reason]
  if name == AUTO and chosen in ("cudnn", "pallas"):
    reason = kernel_pallas.gpu_unsupported(q_shape, k_shape, tile, dtype)
    if reason:
      reasons.append(f"the pallas kernel cannot take these attention blocks ({reason})")
      chosen = "xla"
  return chosen, "; ".join(reasons) or None


def _cudnn_reason(q_shape, dtype, softcap: float, head_spans: bool, auto: bool) -> str | None:
  """Why blocks of a layer that names (or under `auto` resolves to) `cudnn` run `pallas`."""
  if softcap:
    return "the cudnn kernel has no logit soft-capping (model.attention_softcap)"
  if head_spans:
    return "the cudnn kernel has no per-head windows (model.head_spans)"
  unusable = kernel_cudnn.unusable() if auto else None  # a named cudnn is a config error
  if unusable:
    return f"the cudnn kernel {unusable}"
  reason = kernel_cudnn.pallas_reason(q_shape, dtype)
  return f"the cudnn kernel cannot take these attention blocks ({reason})" if reason else None
