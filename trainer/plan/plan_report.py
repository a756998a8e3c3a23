"""How `--dry_run` prints a plan (`trainer.plan.dry_run`): the figures, then the verdict line."""

from __future__ import annotations

import math
from typing import Any

import parallelism
from model.config import named_strategy
from trainer.config import flops

GIB = 2.0 ** 30


def human_bytes(n: float) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
    if n >= size:
      return f"{n / size:8.2f} {unit}"
  return f"{n:8.0f} B  "


def human_seconds(s: float) -> str:
  return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def print_plan(config, out: dict[str, Any], memory_gib: float, mfu: float, accelerator: str,
               budget: str | None = None) -> None:
  m, t = config.model, config.train
  mesh = " x ".join(f"{axis}={size}" for axis, size in out["mesh"].items())
  analytic_dev = out["analytic_flops"] / out["devices"]
  xla_dev = out["xla_flops_per_device"]
  strategy = named_strategy(m.attention, m.sequence_parallel)
  strategy = f", {strategy} sequence-parallel" if strategy else ""
  lines = [
      f"dry run: {out['params'] / 1e6:,.1f}M params, {m.num_layers} layers, attention "
      f"{m.attention} ({_kernel_label(m.kernel, out)}{strategy}), {t.batch_size} x "
      f"{config.data.seq_len:,} tokens per step in {t.micro_batches} micro-batch(es), "
      f"remat {t.remat}",
      f"mesh: {mesh} = {out['devices']} devices ({_devices_label(out)}; compiled in "
      f"{out['compile_s']:.0f} s)",
      "per device (bytes of this device's shard):",
      f"  parameters             {human_bytes(out['param_bytes'])}   {m.param_dtype} master "
      f"weights",
      f"  optimizer state        {human_bytes(out['opt_state_bytes'])}",
      "XLA memory analysis of the compiled step (per device):",
      f"  arguments              {human_bytes(out['argument_bytes'])}   state + batch shard",
      f"  outputs                {human_bytes(out['output_bytes'])}   new state + metrics",
      f"  aliased (donated)      {human_bytes(out['alias_bytes'])}   outputs reusing argument "
      f"buffers",
      f"  temporaries            {human_bytes(out['temp_bytes'])}   activations, gradients, "
      f"scratch",
      f"  generated code         {human_bytes(out['code_bytes'])}",
      f"  peak estimate          {human_bytes(out['peak_bytes'])}   args + temps + outputs - "
      f"aliased",
      *([f"  offloaded layer inputs {human_bytes(out['offloaded_bytes'])}   remat 'offload' keeps "
         f"them in pinned host memory ({_offload_label(out)})"]
        if out["offloaded_bytes"] else []),
      f"  total                  {human_bytes(out['total_bytes'])}   peak + code"
      f"{' - offloaded' if out['offloaded_bytes'] and _on_cpu(out) else ''}: the verdict's "
      f"figure",
      *([] if _on_cpu(out) or _on_tpu(out) else [
          "  not in it: the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers (~0.5-2 GiB "
          "on a real GPU, outside what JAX allocates); GEMM configs are XLA's defaults (no "
          "autotuning)"]),
      f"FLOPs per step: analytic {out['analytic_flops']:.3e} ({analytic_dev:.3e} per device; "
      f"6 x matmul params + attention: causal as half, local layers their window; no remat)",
      f"  XLA cost_analysis      {xla_dev:.3e} per device ({xla_dev / analytic_dev:.2f}x "
      f"analytic): XLA counts each loop body once (scanned layers, ring and tile loops) "
      f"and adds remat recompute, so this is not the step's total" if math.isfinite(xla_dev)
      else "  XLA cost_analysis      not reported by this compile",
      f"step time at {mfu:.0%} MFU on {out['devices']} x {accelerator} "
      f"({flops.PEAK_FLOPS[accelerator] / 1e12:.0f} TFLOP/s each): "
      f"{human_seconds(out['step_time_s'])}, {out['tokens_per_sec']:,.0f} tokens/s "
      f"({out['tokens_per_sec'] / out['devices']:,.0f} per device)",
  ]
  after_total = [i for i, line in enumerate(lines) if line.startswith("  total ")][0] + 1
  if "float32_temp_bytes" in out:
    lines.insert(after_total, f"  float32 compile temps  "
                 f"{human_bytes(out['float32_temp_bytes'])}   "
                 f"halved (every promoted buffer as bf16): total "
                 f"{human_bytes(out['floor_total_bytes']).strip()}")
  if "ring_overlap" in out:
    lines.append(out["ring_overlap"])
  lines += out.get("ring_links", [])
  if "layout_table" in out:
    best = out["best_layout"]
    lines += ["attention schedule per layout (tiles on the ring's critical path, summed over "
              "the layers and their windows):",
              *("  " + row for row in out["layout_table"].splitlines()),
              f"  shortest: {best}" + ("" if best == m.attention else
                                       f" (this config runs {m.attention}: set "
                                       f"--config.model.attention={best})")]
  lines.append(verdict_line(out, memory_gib) + (f" [{budget}]" if budget else ""))
  print("\n".join(lines), flush=True)


def _on_cpu(out: dict[str, Any]) -> bool:
  return out["compiled_for"] == "cpu"


def _on_tpu(out: dict[str, Any]) -> bool:
  return out["compiled_for"].startswith("TPU")


def _devices_label(out: dict[str, Any]) -> str:
  if _on_cpu(out):
    return "fake CPU"
  return (f"{out['compiled_for']}, described to XLA's {'TPU' if _on_tpu(out) else 'GPU'} "
          f"compiler, none attached")


def _offload_label(out: dict[str, Any]) -> str:
  return ("the CPU compile does not: subtracted here" if _on_cpu(out) else
          "placed there by the compile; not in the device figures")


def _kernel_label(kernel: str, out: dict[str, Any]) -> str:
  """The kernel this plan compiles, and the one on its accelerator where that differs: a CPU
  plan compiles `auto` as xla, a plan for described GPUs as pallas (`out['kernel_why']`),
  since cuDNN's attention compiles only on an attached GPU, and one for a TPU slice as
  splash, or xla where splash cannot tile the blocks."""
  platform = "tpu" if _on_tpu(out) else "gpu"
  on_target = parallelism.describe_kernel(kernel, platform)
  if _on_cpu(out):
    here = parallelism.describe_kernel(kernel)
    return f"{here} kernel" if here == kernel else f"{here} kernel, {on_target}"
  if out.get("kernel") in (None, parallelism.resolve_kernel(kernel, platform)):
    return f"{on_target} kernel"
  return f"{on_target} kernel, compiled here as {out['kernel_why']}"


def verdict_line(out: dict[str, Any], memory_gib: float) -> str:
  """The plan's last line: fits, may fit (between floor and CPU figure), or does NOT fit."""
  total, floor, limit = out["total_bytes"], out["floor_total_bytes"], memory_gib * GIB
  if out["fits"]:
    return f"fits in {memory_gib:.4g} GiB per device ({total / GIB:.1f} GiB, {total / limit:.0%})"
  if out["may_fit"]:
    return (f"may fit in {memory_gib:.4g} GiB per device: between {floor / GIB:.1f} GiB "
            f"(floor) and {total / GIB:.1f} GiB (CPU figure), depending on how many "
            f"buffers the accelerator keeps in bf16")
  return (f"does NOT fit in {memory_gib:.4g} GiB per device ({total / GIB:.1f} GiB, "
          f"{total / limit:.0%}" + (f"; floor {floor / GIB:.1f} GiB)" if floor < total else ")"))
