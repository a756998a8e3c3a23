"""The block-kernel contract and the registry of kernels that keep it.

A block kernel computes attention of one device's query block on one K/V block: the pair
that the static schedule (`parallelism.schedule`) assigns to that device at that ring step.
The ring (`parallelism.ring_attention`) merges the partial results and drives the backward.

    block_fwd(q_BTHD, k_BTKD, v_BTKD, q_seg_BT, k_seg_BT, *, schedule, pair, tile)
        -> (out_BTHD, lse_BTH)
    block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, q_seg_BT, k_seg_BT, *,
              schedule, pair, tile, out_BTHD=None)
        -> (dq_BTHD, dk_BTKD, dv_BTKD)

- q `[B, Tq, Hq, D]`, k/v `[B, Tk, Hkv, D]` with Hq % Hkv == 0 (q head h reads kv head
  h // (Hq / Hkv)); operands in the compute dtype (bf16 or float32).
- `schedule` is the host-built `RingSchedule` (static, hashable), `pair` a traced int32
  scalar: the distinct block pair to compute (`schedule.pair[device, step]`, which differs
  between devices). A kernel reads the tile metadata it needs at its own tile sizes
  (`schedule.tiles(tq, tk)`, indexed by `pair`). A kernel that needs a static mask (a
  library kernel with a causal flag) branches once per call with
  `lax.switch(pair, [one function per distinct pair])`, each knowing its pair's mask shape
  (`schedule.shapes[p]`: empty, full, causal, strictly_causal or general).
  `tile` is the attention tile of the config, already clipped to the block; a kernel may
  use finer tiles, never coarser ones.
- Segment ids `[B, T]` int32, or None for one document per row: with them, query i sees key
  j only if their ids match, on top of the schedule's mask.
- Forward returns the block's output and its natural-log log-sum-exp, both float32; a query
  that sees no key of the block gets output 0 and lse -inf, never NaN.
- Backward takes the GLOBAL (merged over all key blocks) lse and `delta = sum(dout * out,
  -1)` of the global output, float32, recomputes the block's probabilities from them, and
  returns this block's contributions to dq, dk, dv in float32. The ring also hands it the
  global output itself (`out_BTHD`), for a library kernel that forms delta on its own
  (cuDNN's backward takes the output, not delta); `xla` and `pallas` ignore it.

`xla` is the reference, in plain JAX on any backend; `pallas` is fused (Triton on GPUs,
interpret mode on CPU for tests); `cudnn` (CUDA GPUs only) is cuDNN's flash attention for
the pairs whose mask it can express and `pallas` for the rest. A new
kernel is one module with these two functions and one line below. `auto` (the default of
`model.kernel`) is the fastest exact one of the backend for each block, chosen while
tracing (`resolve`, `_for_blocks`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax

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
  described GPUs). `auto` is `pallas` on GPUs: fused, 0.56-0.59x cuDNN forward+backward on
  an H100 (results/bench_kernel.jsonl), where `xla` materialises every tile's scores in
  memory; not timed against `xla` on a GPU yet. For a
  block whose shapes Triton cannot take (`kernel_pallas.gpu_unsupported`) `auto` runs `xla`
  and says so once. Not `cudnn` until that kernel has been checked and timed on a GPU.
  Elsewhere `auto` is `xla`: on the CPU `pallas` only interprets, and its Triton kernel has
  no TPU (Mosaic) lowering."""
  if name != AUTO:
    return name
  return "pallas" if (backend or target.backend()) == "gpu" else "xla"


def describe(name: str, backend: str | None = None) -> str:
  """`name` as the run states it: 'xla', or 'auto on cpu: xla'."""
  backend = backend or target.backend()
  kernel = resolve(name, backend)
  return kernel if kernel == name else f"{name} on {backend}: {kernel}"


_SAID: set[str] = set()


def _they_run_on(kernel: str) -> str:
  return f"they run on {kernel}"


# How the line ends that `auto` prints for blocks it moves to xla; `bench_kernel --parts e2e`
# looks for it in the trainer's output to record the fallback.
FALLBACK_SAID = _they_run_on("xla")


def _for_blocks(q_shape, k_shape, tile: int, dtype, name: str = AUTO) -> BlockKernel:
  """The kernel that runs `name` on these operands, chosen while tracing: `auto` resolved
  for the backend, then the fallback for calls a kernel cannot take (`pallas` under `auto`:
  shapes Triton cannot take, to `xla`; `cudnn`: operands and masks cuDNN cannot take, to
  `pallas`). A fallback is said once per process (by process 0)."""
  chosen = resolve(name)
  reason, instead = None, None
  if name == AUTO and chosen == "pallas":
    reason, instead = kernel_pallas.gpu_unsupported(q_shape, k_shape, tile, dtype), "xla"
  elif chosen == "cudnn":
    reason, instead = kernel_cudnn.pallas_reason(q_shape, dtype), "pallas"
  if not reason:
    return KERNELS[chosen]
  if reason not in _SAID and jax.process_index() == 0:
    _SAID.add(reason)
    print(f"model.kernel='{name}': the {chosen} kernel cannot take these attention blocks "
          f"({reason}); {_they_run_on(instead)}", flush=True)
  return KERNELS[instead]


def _chosen_per_call(name: str, which: str) -> Callable:
  def call(q, k, *args, **kwargs):  # Both halves take q and k first.
    kernel = _for_blocks(q.shape, k.shape, kwargs["tile"], q.dtype, name)
    return getattr(kernel, which)(q, k, *args, **kwargs)
  return call


def get(name: str) -> BlockKernel:
  if name != AUTO and name not in KERNELS:
    raise ValueError(f"unknown attention kernel '{name}'; choose one of "
                     f"{(AUTO, *KERNELS)}")
  return BlockKernel(_chosen_per_call(name, "fwd"), _chosen_per_call(name, "bwd"))
