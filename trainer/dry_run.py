"""`--dry_run`: will a config fit, and how long will a step take, before renting hardware?

    python -m trainer --config configs/7b_256k_striped.py --dry_run [--device_memory_gib=80]

The planner fakes as many CPU devices as the config's mesh has, builds the mesh, and
ahead-of-time compiles the real train step (`trainer.step.jit_train_step`, the same jit the
loop runs) from `jax.ShapeDtypeStruct`s that carry shapes, dtypes and shardings only: no
parameter, optimizer moment or batch is ever allocated. It then reads back:

- per-device bytes of parameters and of optimizer state: for each leaf of the abstract
  state, the bytes of ONE device's shard under its sharding (so ZeRO/tensor sharding shows);
- XLA's memory analysis of the per-device program: arguments (state shard + batch shard),
  outputs, temporaries (activations, gradients, attention scratch, collectives' buffers),
  generated code, and the bytes of outputs aliased to donated arguments. The peak estimate
  is args + temps + outputs - aliased: the donated old state and the new state share
  buffers. The verdict compares peak + code with `device_memory_gib`;
- FLOPs per step: analytic model FLOPs (`trainer.flops.flops_per_token`: 6 x matmul params
  plus causal attention counted as half, no remat recompute) next to XLA's `cost_analysis()`
  of the per-device program, and the step time and tokens/sec they imply at `mfu` of the
  named accelerator's peak.

Caveat: the numbers come from XLA's CPU compiler. It fuses and schedules differently from
a GPU/TPU compile and, lacking bf16 arithmetic, keeps some bf16 buffers as float32 (e.g. the
per-layer residual stream saved for the backward pass), so temporaries are an estimate that
errs high, not a guarantee. XLA's FLOP count is per device and counts each loop body once.
"""

from __future__ import annotations

import math
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections

import parallelism
from data import packing
from trainer import flops
from trainer.config_check import ConfigError, check_config
from trainer.loop import build_training, model_config

GIB = 2.0 ** 30
# The per-token arrays of a batch and their dtypes, as the packer makes them; the batch is a
# ShapeDtypeStruct, so no data is read or prepared.
# What the loop sends to the train step (the rest of a row stays on the host).
BATCH_DTYPES = {name: row.dtype for name, row in packing.empty_row(1, 0).items()
                if name in packing.TRAIN_FIELDS}


def plan_device_count(config: ml_collections.ConfigDict) -> int:
  """Devices of the config's mesh; with a -1 axis, `config.cpu_devices` (else 8) in all."""
  sizes = [config.mesh[axis] for axis in parallelism.MESH_AXES]
  if -1 in sizes:
    return config.cpu_devices or 8
  return math.prod(sizes)


def fake_devices(count: int) -> list[jax.Device]:
  """`count` CPU devices: configured here if JAX's backend has not started, else reused."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
    if jax.config.jax_num_cpu_devices < 0:  # Unset; a test harness may have set its own.
      jax.config.update("jax_num_cpu_devices", count)
  devices = jax.devices("cpu")
  if len(devices) != count:
    raise ConfigError(f"the dry run needs {count} CPU devices for this mesh, but JAX already "
                      f"started with {len(devices)}; run it in a fresh process")
  return devices


def shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(tree))


def compile_step(config: ml_collections.ConfigDict, mesh) -> tuple[Any, Any]:
  """AOT-compiles the loop's train step from abstract shapes: (compiled, abstract state)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    parts = build_training(config, mesh)
    batch = {name: jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len), dtype,
                                        sharding=parts.batch_sharding)
             for name, dtype in BATCH_DTYPES.items()}
    compiled = parts.step_fn.lower(parts.abstract_state, batch).compile()
  return compiled, parts.abstract_state


def memory_figures(compiled) -> dict[str, int]:
  """XLA's per-device memory analysis; peak = args + temps + outputs - aliased (donated)."""
  memory = compiled.memory_analysis()
  out = {"argument_bytes": memory.argument_size_in_bytes,
         "output_bytes": memory.output_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
         "alias_bytes": memory.alias_size_in_bytes,
         "code_bytes": memory.generated_code_size_in_bytes}
  out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                       - out["alias_bytes"])
  return out


def plan(config: ml_collections.ConfigDict, device_memory_gib: float = 80.0, mfu: float = 0.4,
         accelerator: str = "h100") -> dict[str, Any]:
  """Compiles the config's train step on fake devices and prints (and returns) the plan.

  Byte figures are per device; FLOPs are per step, for the whole mesh unless named
  `per_device`. Raises ConfigError for a config that cannot run or an unknown accelerator.
  """
  if accelerator not in flops.PEAK_FLOPS:
    raise ConfigError(f"--plan_accelerator={accelerator!r} is not one of "
                      f"{', '.join(flops.PEAK_FLOPS)}")
  start = time.monotonic()
  count = plan_device_count(config)
  devices = fake_devices(count)
  check_config(config, count)
  mesh = parallelism.make_mesh(config.mesh, devices)
  compiled, state = compile_step(config, mesh)
  compile_s = time.monotonic() - start

  out = {"devices": count, "mesh": dict(mesh.shape),
         "params": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
         "param_bytes": shard_bytes(state.params),
         "opt_state_bytes": shard_bytes(state.opt_state), **memory_figures(compiled)}
  out["total_bytes"] = out["peak_bytes"] + out["code_bytes"]
  out["fits"] = out["total_bytes"] <= device_memory_gib * GIB

  tokens = config.train.batch_size * config.data.seq_len
  out["tokens_per_step"] = tokens
  out["analytic_flops"] = flops.flops_per_token(model_config(config), config.data.seq_len) * tokens
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out["xla_flops_per_device"] = float((cost or {}).get("flops", float("nan")))
  peak = flops.PEAK_FLOPS[accelerator]
  out["step_time_s"] = out["analytic_flops"] / (count * peak * mfu)
  out["tokens_per_sec"] = tokens / out["step_time_s"]
  out["compile_s"] = compile_s
  _print(config, out, device_memory_gib, mfu, accelerator)
  return out


def _gib(n: float) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
    if n >= size:
      return f"{n / size:8.2f} {unit}"
  return f"{n:8.0f} B  "


def _seconds(s: float) -> str:
  return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms"


def _print(config, out: dict[str, Any], memory_gib: float, mfu: float, accelerator: str) -> None:
  m, t = config.model, config.train
  mesh = " x ".join(f"{axis}={size}" for axis, size in out["mesh"].items())
  analytic_dev = out["analytic_flops"] / out["devices"]
  xla_dev = out["xla_flops_per_device"]
  lines = [
      f"dry run: {out['params'] / 1e6:,.1f}M params, {m.num_layers} layers, attention "
      f"{m.attention} ({m.kernel} kernel), {t.batch_size} x {config.data.seq_len:,} tokens per "
      f"step in {t.micro_batches} micro-batch(es), remat {t.remat}",
      f"mesh: {mesh} = {out['devices']} devices (fake CPU; compiled in {out['compile_s']:.0f} s)",
      "per device (bytes of this device's shard):",
      f"  parameters             {_gib(out['param_bytes'])}   {m.param_dtype} master weights",
      f"  optimizer state        {_gib(out['opt_state_bytes'])}",
      "XLA memory analysis of the compiled step (per device):",
      f"  arguments              {_gib(out['argument_bytes'])}   state + batch shard",
      f"  outputs                {_gib(out['output_bytes'])}   new state + metrics",
      f"  aliased (donated)      {_gib(out['alias_bytes'])}   outputs reusing argument buffers",
      f"  temporaries            {_gib(out['temp_bytes'])}   activations, gradients, scratch",
      f"  generated code         {_gib(out['code_bytes'])}",
      f"  peak estimate          {_gib(out['peak_bytes'])}   args + temps + outputs - aliased",
      f"  total                  {_gib(out['total_bytes'])}   peak + code: the verdict's figure",
      f"FLOPs per step: analytic {out['analytic_flops']:.3e} ({analytic_dev:.3e} per device; "
      f"6 x matmul params + causal attention as half, no remat)",
      f"  XLA cost_analysis      {xla_dev:.3e} per device ({xla_dev / analytic_dev:.2f}x "
      f"analytic): XLA counts each loop body once (scanned layers, ring and tile loops) "
      f"and adds remat recompute, so this is not the step's total",
      f"step time at {mfu:.0%} MFU on {out['devices']} x {accelerator} "
      f"({flops.PEAK_FLOPS[accelerator] / 1e12:.0f} TFLOP/s each): "
      f"{_seconds(out['step_time_s'])}, {out['tokens_per_sec']:,.0f} tokens/s "
      f"({out['tokens_per_sec'] / out['devices']:,.0f} per device)",
  ]
  total, limit = out["total_bytes"], memory_gib * GIB
  verdict = "fits in" if out["fits"] else "does NOT fit in"
  lines.append(f"{verdict} {memory_gib:g} GiB per device ({total / GIB:.1f} GiB, "
               f"{total / limit:.0%})")
  print("\n".join(lines), flush=True)
