"""The block-kernel contract and the registry of kernels that keep it.

A block kernel computes attention of one device's query block on the K/V block the static
schedule (`parallelism.schedule`) gives that device at that ring step:

    block_fwd(q, k, v, mask, *, schedule, pair, tile, index=None) -> (out_BTHD, lse_BTH)
    block_bwd(q, k, v, mask, merged, *, schedule, pair, tile, index=None) -> Grads

- q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] (head h reads kv head h // (Hq / Hkv)); `mask` the
  block pair's (`parallelism.masks.Mask`: its spec, the queries' side and the held block's
  key side, as the ring's `spec.on_ring`: no sinks).
- `schedule` is static, `pair` a traced int32 (`schedule.pair[device, step]`); a kernel
  reads its tile tables (tiles no coarser than `tile`) or switches on `schedule.shapes[p]`.
  `index`: the query and held key blocks' token indices ([T] int32 each) where the mask
  needs them beyond the pair's representative (`RingSchedule.pair_index`), else None.
- Forward: output and natural-log lse, float32 (no key seen: 0 and -inf, never NaN).
  Backward: float32 `Grads` from the `Merged` (global) out, lse, dout and delta, with
  SparseK's thresholds' and scores' gradients where the mask has them.

Each kernel declares the specs it cannot apply (`BlockKernel.unsupported`); `choose` is the
one function that picks the kernel for a layer's spec, once per setup. `xla` is the
reference (any backend, every spec); `pallas` is fused (Triton on GPUs, interpreted on the
CPU); `cudnn` is cuDNN's flash attention where the pair's mask allows; `splash` is JAX's
Pallas TPU splash attention likewise (interpreted off TPUs). A new kernel is one module and
one line in `KERNELS`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from parallelism import kernel_cudnn, kernel_pallas, kernel_splash, kernel_xla, target
from parallelism.kernel_grads import Grads, Merged  # noqa: F401  (the contract's types)
from parallelism.masks import MaskSpec

AUTO = "auto"


class BlockKernel(NamedTuple):
  fwd: Callable
  bwd: Callable
  unsupported: Callable[[MaskSpec], str | None]  # why it cannot apply a spec, or None


KERNELS = {
    "xla": BlockKernel(kernel_xla.block_fwd, kernel_xla.block_bwd, lambda spec: None),
    "pallas": BlockKernel(kernel_pallas.block_fwd, kernel_pallas.block_bwd,
                          kernel_pallas.unsupported),
    "cudnn": BlockKernel(kernel_cudnn.block_fwd, kernel_cudnn.block_bwd,
                         kernel_cudnn.unsupported),
    "splash": BlockKernel(kernel_splash.block_fwd, kernel_splash.block_bwd,
                          kernel_splash.unsupported),
}
# Where a kernel cannot take a layer's blocks, the next that may.
_NEXT = {"cudnn": "pallas", "pallas": "xla", "splash": "xla"}
_BY_BACKEND = {"gpu": "cudnn", "tpu": "splash"}  # what `auto` resolves to; elsewhere xla


def resolve(name: str, backend: str | None = None) -> str:
  """The kernel `name` runs on `backend` (default: `target.backend()`, JAX's or a plan's
  described GPUs or TPUs). `auto` is `cudnn` on GPUs, the faster fused kernel there by `make
  gpu_check` (figures: docs/gpus.md, results/gpu_check/), `splash` on TPUs (Pallas Mosaic, the
  only fused kernel with a TPU lowering), and `xla` elsewhere: on the CPU the Pallas
  kernels only interpret. Where cuDNN cannot take a layer, `choose` goes on to `pallas`,
  then `xla`; where splash cannot, to `xla`."""
  check_name(name)
  if name != AUTO:
    return name
  return _BY_BACKEND.get(backend or target.backend(), "xla")


def check_name(name: str) -> None:
  if name != AUTO and name not in KERNELS:
    raise ValueError(f"unknown attention kernel '{name}'; choose one of {(AUTO, *KERNELS)}")


def check_spec(name: str, spec: MaskSpec, field: str = "kernel") -> None:
  """A kernel named by the user (not `auto`) that cannot apply the spec is a ValueError
  naming `field`: a named kernel runs as named or not at all."""
  check_name(name)
  reason = None if name == AUTO else KERNELS[name].unsupported(spec)
  if reason:
    raise ValueError(f"{field}='{name}' cannot run this attention: {reason}; 'auto' picks a "
                     f"kernel that can")


def describe(name: str, backend: str | None = None) -> str:
  """`name` as the run states it: 'xla', or 'auto on cpu: xla'."""
  backend = backend or target.backend()
  kernel = resolve(name, backend)
  return kernel if kernel == name else f"{name} on {backend}: {kernel}"


def choose(name: str, spec: MaskSpec, q_shape, k_shape, tile: int, dtype,
           general: bool = False) -> tuple[str, str | None]:
  """The kernel that runs `name` on blocks of these shapes under the mask `spec` (the ring's:
  `MaskSpec.on_ring`), and why it is not the one `name` resolves to (None when it is): the
  one decision, made once per attention setup (`parallelism.split`), never per call.

  Under `auto`, a kernel that cannot apply the spec (`BlockKernel.unsupported`: run-time
  masks are the `xla` kernel's alone; cuDNN has no soft cap or per-head spans) hands it to
  the next, as `cudnn` does operands cuDNN cannot take (a named kernel that cannot is an
  error first: `check_spec`). `auto` on GPUs goes on from there: `pallas` also
  where cuDNN cannot run here (a plan's described GPUs, another JAX) and for schedules with
  `general` blocks (windows, zigzag), which the cudnn kernel hands to pallas anyway (and
  was measured slower doing so); then `xla` where Triton cannot take the blocks, which the
  cudnn kernel's own pallas branches need too. `splash` (TPUs) hands to `xla` the specs it
  cannot apply and blocks it cannot tile (`kernel_splash.shape_reason`); pairs whose mask is
  no band of i - j (zigzag's halves) it hands to xla itself."""
  chosen, reasons = resolve(name), []
  while chosen in _NEXT:
    reason = KERNELS[chosen].unsupported(spec)
    if chosen == "cudnn" and not reason:
      reason = _cudnn_reason(q_shape, dtype, auto=name == AUTO)
      if name == AUTO and general and not reason:
        reason = ("blocks whose masks cuDNN cannot express (a window, zigzag's halves): the "
                  "cudnn kernel would hand them to pallas")
    if chosen == "splash" and not reason:
      reason = kernel_splash.shape_reason(q_shape, tile)
    if not reason:
      break
    chosen, reasons = _NEXT[chosen], reasons + [reason]
  if name == AUTO and chosen in ("cudnn", "pallas"):
    reason = kernel_pallas.gpu_unsupported(q_shape, k_shape, tile, dtype)
    if reason:
      chosen = "xla"
      reasons.append(f"the pallas kernel cannot take these attention blocks ({reason})")
  return chosen, "; ".join(reasons) or None


def _cudnn_reason(q_shape, dtype, auto: bool) -> str | None:
  """Why blocks of a layer that names (or under `auto` resolves to) `cudnn` run `pallas`."""
  unusable = kernel_cudnn.unusable() if auto else None  # a named cudnn is a config error
  if unusable:
    return f"the cudnn kernel {unusable}"
  reason = kernel_cudnn.pallas_reason(q_shape, dtype)
  return f"the cudnn kernel cannot take these attention blocks ({reason})" if reason else None
