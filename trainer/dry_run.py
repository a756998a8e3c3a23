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

The CPU compiler lacks bf16 arithmetic and keeps some bf16 buffers as float32 (e.g. the
per-layer residual stream saved for the backward pass), so its temporaries err high by an
amount it does not report. The planner bounds it: it compiles the step a second time with
float32 compute, where every such buffer is float32; half of those temporaries is what they
would be were every one of them bf16, a floor under what an accelerator's bf16 step needs
(buffers that are float32 there too are halved as well). The verdict says "fits" when the
CPU figure fits, "does NOT fit" when even the floor does not, else "may fit" with both.
Beyond that, XLA's CPU compiler fuses and schedules differently from a GPU/TPU compile, so
both figures are estimates. XLA's FLOP count is per device and counts each loop body once.

`train.remat='offload'` keeps each layer's input in pinned host memory on accelerators; the
CPU compile keeps it on the device (as 'full'), so the planner subtracts those inputs
(layers x local rows x local tokens x width, in the compute dtype) from both figures and
reports them as host memory.

`--find_max_seq_len` repeats the plan over sequence lengths (multiples of what the mesh and
tile need), doubling then bisecting, and reports the longest whose CPU figure fits.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections

import parallelism
from data import packing
from trainer import flops
from model.config import layout_of, named_strategy
from trainer.config_check import ConfigError, check_config
from trainer.training import build_training, model_config

GIB = 2.0 ** 30
MAX_SEARCHED_SEQ_LEN = 1 << 27  # --find_max_seq_len doubles up to 128M tokens at most.
# The per-token arrays of a batch and their dtypes, as the packer makes them; the batch is a
# ShapeDtypeStruct, so no data is read or prepared.
# What the loop sends to the train step (the rest of a row stays on the host).
BATCH_DTYPES = {name: row.dtype for name, row in packing.empty_row(1, 0).items()
                if name in packing.TRAIN_FIELDS}


def plan_device_count(config: ml_collections.ConfigDict) -> int:
  """Devices of the config's mesh; with a -1 axis, `config.cpu_devices` (else 8) in all."""
  sizes = [config.mesh.get(axis, 1) for axis in parallelism.MESH_AXES]
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
         accelerator: str = "h100", floor: bool = True) -> dict[str, Any]:
  """Compiles the config's train step on fake devices and prints (and returns) the plan.

  Byte figures are per device; FLOPs are per step, for the whole mesh unless named
  `per_device`. `floor` adds the float32 compile that bounds the CPU's promotion. Raises
  ConfigError for a config that cannot run or an unknown accelerator.
  """
  if accelerator not in flops.PEAK_FLOPS:
    raise ConfigError(f"--plan_accelerator={accelerator!r} is not one of "
                      f"{', '.join(flops.PEAK_FLOPS)}")
  start = time.monotonic()
  out, compiled = memory_plan(config, device_memory_gib, floor)
  compile_s = time.monotonic() - start

  count = out["devices"]
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


def memory_plan(config: ml_collections.ConfigDict, device_memory_gib: float,
                 floor: bool = True) -> tuple[dict[str, Any], Any]:
  """Compiles the step (with `floor`, twice: also in float32) and fills in its memory
  figures and verdict; the configured compile is returned for its cost analysis."""
  count = plan_device_count(config)
  devices = fake_devices(count)
  check_config(config, count)
  mesh = parallelism.make_mesh(config.mesh, devices)
  compiled, state = compile_step(config, mesh)
  out = {"devices": count, "mesh": dict(mesh.shape),
         "params": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
         "param_bytes": shard_bytes(state.params),
         "opt_state_bytes": shard_bytes(state.opt_state), **memory_figures(compiled)}
  out["total_bytes"] = out["peak_bytes"] + out["code_bytes"]
  floor_temps = out["temp_bytes"]
  if floor and jax.numpy.dtype(config.model.dtype) != jax.numpy.float32:
    as_float32 = copy.deepcopy(config)
    as_float32.model.dtype = "float32"
    float32_temps = compile_step(as_float32, mesh)[0].memory_analysis().temp_size_in_bytes
    out["float32_temp_bytes"] = float32_temps
    floor_temps = min(floor_temps, float32_temps // 2)
  out["floor_total_bytes"] = out["total_bytes"] - out["temp_bytes"] + floor_temps
  out["offloaded_bytes"] = offloaded_bytes(config, mesh) if config.train.remat == "offload" else 0
  out["total_bytes"] -= out["offloaded_bytes"]
  out["floor_total_bytes"] -= out["offloaded_bytes"]
  return with_verdict(out, device_memory_gib), compiled


def with_verdict(out: dict[str, Any], device_memory_gib: float) -> dict[str, Any]:
  """`out` with `fits` (the CPU figure fits) and `may_fit` (the floor does) for a memory."""
  limit = device_memory_gib * GIB
  return {**out, "fits": out["total_bytes"] <= limit,
          "may_fit": out["floor_total_bytes"] <= limit}


def offloaded_bytes(config: ml_collections.ConfigDict, mesh) -> int:
  """Bytes per device of the layer inputs remat 'offload' keeps in host memory."""
  rows = config.train.batch_size // parallelism.batch_shards(mesh) // config.train.micro_batches
  tokens = config.data.seq_len // (mesh.shape["sequence"] * mesh.shape["ulysses"])
  itemsize = jax.numpy.dtype(config.model.dtype).itemsize
  return config.model.num_layers * rows * tokens * config.model.d_model * itemsize


def seq_len_unit(config: ml_collections.ConfigDict) -> int:
  """What every sequence length of this layout, mesh and tile must be a multiple of (the
  rule `check_config` applies: the layout's divisor, sequence x ulysses shards, and ring
  shards x the full tile)."""
  shape = dict(zip(parallelism.MESH_AXES, parallelism.resolve_mesh_shape(
      config.mesh, plan_device_count(config))))
  shards = shape["sequence"]
  divisor = math.lcm(parallelism.layouts.required_divisor(layout_of(config.model.attention),
                                                          shards), shards * shape["ulysses"])
  if config.model.attention == "dense":
    return divisor
  return math.lcm(divisor, shards * config.model.attention_tile)


def find_max_seq_len(config: ml_collections.ConfigDict, device_memory_gib: float = 80.0,
                     log=print) -> int:
  """The longest sequence (a multiple of `seq_len_unit`) whose CPU figure fits, by doubling
  from the config's length and then bisecting to within 1/16; 0 if even one unit does not."""
  unit = seq_len_unit(config)

  def fits(seq_len: int) -> bool:
    probe = copy.deepcopy(config)
    probe.data.seq_len = seq_len
    started = time.monotonic()
    out, _ = memory_plan(probe, device_memory_gib, floor=False)
    log(f"  {seq_len:>12,} tokens: {out['total_bytes'] / GIB:7.1f} GiB  "
        f"{'fits' if out['fits'] else 'does not fit'}  [compiled in "
        f"{time.monotonic() - started:.0f} s]")
    return out["fits"]

  log(f"longest sequence for {device_memory_gib:g} GiB per device, in multiples of {unit:,}:")
  length = max(unit, config.data.seq_len // unit * unit)
  if fits(length):
    low, high = length, None
    while high is None:
      if 2 * low > MAX_SEARCHED_SEQ_LEN:
        log(f"{low:,} tokens fit; the search stops at {MAX_SEARCHED_SEQ_LEN:,}")
        return low
      if fits(2 * low):
        low *= 2
      else:
        high = 2 * low
  else:
    low, high = 0, length
    while low == 0 and high > unit:
      candidate = max(unit, high // 2 // unit * unit)
      if fits(candidate):
        low = candidate
      else:
        high = candidate
    if low == 0:
      log(f"even {unit:,} tokens do not fit")
      return 0
  while high - low > max(unit, low // 16):
    middle = (low + high) // 2 // unit * unit
    if middle in (low, high):
      break
    low, high = (middle, high) if fits(middle) else (low, middle)
  log(f"longest that fits: {low:,} tokens ({high:,} does not)")
  return low


def human_bytes(n: float) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10)):
    if n >= size:
      return f"{n / size:8.2f} {unit}"
  return f"{n:8.0f} B  "


def human_seconds(s: float) -> str:
  return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def _print(config, out: dict[str, Any], memory_gib: float, mfu: float, accelerator: str) -> None:
  m, t = config.model, config.train
  mesh = " x ".join(f"{axis}={size}" for axis, size in out["mesh"].items())
  analytic_dev = out["analytic_flops"] / out["devices"]
  xla_dev = out["xla_flops_per_device"]
  strategy = named_strategy(m.attention, m.sequence_parallel)
  strategy = f", {strategy} sequence-parallel" if strategy else ""
  lines = [
      f"dry run: {out['params'] / 1e6:,.1f}M params, {m.num_layers} layers, attention "
      f"{m.attention} ({_kernel_label(m.kernel)}{strategy}), {t.batch_size} x "
      f"{config.data.seq_len:,} tokens per step in {t.micro_batches} micro-batch(es), "
      f"remat {t.remat}",
      f"mesh: {mesh} = {out['devices']} devices (fake CPU; compiled in {out['compile_s']:.0f} s)",
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
         f"them in pinned host memory (the CPU compile does not)"]
        if out["offloaded_bytes"] else []),
      f"  total                  {human_bytes(out['total_bytes'])}   peak + code"
      f"{' - offloaded' if out['offloaded_bytes'] else ''}: the verdict's figure",
      f"FLOPs per step: analytic {out['analytic_flops']:.3e} ({analytic_dev:.3e} per device; "
      f"6 x matmul params + causal attention as half, no remat)",
      f"  XLA cost_analysis      {xla_dev:.3e} per device ({xla_dev / analytic_dev:.2f}x "
      f"analytic): XLA counts each loop body once (scanned layers, ring and tile loops) "
      f"and adds remat recompute, so this is not the step's total",
      f"step time at {mfu:.0%} MFU on {out['devices']} x {accelerator} "
      f"({flops.PEAK_FLOPS[accelerator] / 1e12:.0f} TFLOP/s each): "
      f"{human_seconds(out['step_time_s'])}, {out['tokens_per_sec']:,.0f} tokens/s "
      f"({out['tokens_per_sec'] / out['devices']:,.0f} per device)",
  ]
  after_total = [i for i, line in enumerate(lines) if line.startswith("  total ")][0] + 1
  if "float32_temp_bytes" in out:
    lines.insert(after_total, f"  float32 compile temps  "
                 f"{human_bytes(out['float32_temp_bytes'])}   "
                 f"halved, a floor under bf16 temps (CPU promotion bounded): total "
                 f"{human_bytes(out['floor_total_bytes']).strip()}")
  lines.append(verdict_line(out, memory_gib))
  print("\n".join(lines), flush=True)


def _kernel_label(kernel: str) -> str:
  """The kernel this CPU plan compiles, and on GPUs (`auto` picks another there)."""
  here = parallelism.describe_kernel(kernel)
  return f"{here} kernel" + ("" if here == kernel else
                             f", {parallelism.describe_kernel(kernel, 'gpu')}")


def verdict_line(out: dict[str, Any], memory_gib: float) -> str:
  """The plan's last line: fits, may fit (between floor and CPU figure), or does NOT fit."""
  total, floor, limit = out["total_bytes"], out["floor_total_bytes"], memory_gib * GIB
  if out["fits"]:
    return f"fits in {memory_gib:g} GiB per device ({total / GIB:.1f} GiB, {total / limit:.0%})"
  if out["may_fit"]:
    return (f"may fit in {memory_gib:g} GiB per device: between {floor / GIB:.1f} GiB "
            f"(floor) and {total / GIB:.1f} GiB (CPU figure), depending on how many "
            f"buffers the accelerator keeps in bf16")
  return (f"does NOT fit in {memory_gib:g} GiB per device ({total / GIB:.1f} GiB, "
          f"{total / limit:.0%}; floor {floor / GIB:.1f} GiB)")
