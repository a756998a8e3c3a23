"""`--dry_run`: will a config fit, and how long will a step take, before renting hardware?

    python -m trainer --config configs/7b_256k_striped.py --dry_run [--device_memory_gib=80]

The planner makes as many devices as the config's mesh has and ahead-of-time compiles the
real train step (`trainer.core.step.jit_train_step`, the loop's own jit) from
`jax.ShapeDtypeStruct`s: no parameter, optimizer moment or batch is ever allocated. The
devices are GPUs of `--plan_accelerator`'s kind described to XLA's GPU compiler, or a TPU
slice's chips described to XLA's TPU compiler, when it is installed
(`trainer.plan.plan_target`, `make plan_gpu`, `make plan_tpu`; no GPU or TPU needed), else
fake CPU devices (`--plan_compiler`). It reads back per device: parameters and optimizer
state (one shard of each leaf); XLA's memory analysis (peak = args + temps + outputs -
aliased, judged against `device_memory_gib`); FLOPs per step (`trainer.config.flops`)
beside XLA's `cost_analysis()`, with the step time and tokens/sec at `mfu`; and from a GPU
compile's schedule, whether each ring transfer overlaps a kernel (`parallelism.overlap`).

A GPU compile's figure is the GPU's own buffer assignment: "fits" or "does NOT fit". A CPU
compile may keep some bf16 buffers as float32, so its temporaries may err high; the planner
bounds them by compiling again in float32 and halving those temporaries (the "floor", a
bound on the CPU's schedule, not on a GPU's) and says "may fit" between the two. Remat
'offload' keeps layer inputs in host memory on accelerators but not on the CPU, so the CPU
figures subtract them and report them as host memory. `--find_max_seq_len` plans doubling
then bisected lengths and reports the longest that fits.
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
from parallelism import overlap
from trainer.config import flops
from trainer.plan import plan_target, ring_links
from trainer.run import host_memory
from model.config import layout_of
from trainer.config.config_check import (ConfigError, attention_split, block_kernels,
                                         check_config)
from trainer.core.state import shard_bytes
from trainer.core.training import build_training, model_config
from trainer.plan.plan_report import GIB, print_plan

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


def _cpu_backend(count: int | None = None) -> None:
  """JAX's own backend is the CPU (with `count` devices) if it has not started yet."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
    if count and jax.config.jax_num_cpu_devices < 0:  # A test harness may have set its own.
      jax.config.update("jax_num_cpu_devices", count)


def fake_devices(count: int) -> list[jax.Device]:
  """`count` CPU devices: configured here if JAX's backend has not started, else reused."""
  _cpu_backend(count)
  devices = jax.devices("cpu")
  if len(devices) != count:
    raise ConfigError(f"the dry run needs {count} CPU devices for this mesh, but JAX already "
                      f"started with {len(devices)}; run it in a fresh process")
  return devices


def tree_shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shards)."""
  return sum(shard_bytes(leaf) for leaf in jax.tree.leaves(tree))


def compile_step(config: ml_collections.ConfigDict, mesh) -> tuple[Any, Any]:
  """AOT-compiles the loop's train step from abstract shapes: (compiled, abstract state).
  For a mesh of described GPUs (`plan_target`) the kernels are chosen and lowered for them."""
  # An abstract mesh: the devices may be described, not attached, so nothing may run on them.
  with plan_target.compiling_for(mesh.devices.flat), \
      jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
      nn.logical_axis_rules(config.mesh.rules):
    parts = build_training(config, mesh)
    batch = {name: jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len), dtype,
                                        sharding=parts.batch_sharding)
             for name, dtype in BATCH_DTYPES.items()}
    compiled = _compile(parts.step_fn.lower(parts.abstract_state, batch), mesh.devices.flat)
  return compiled, parts.abstract_state


def _compile(lowered, devices):
  """`lowered` compiled with the planner's options for `devices`. Without autotuning, a GEMM
  fusion whose default config no backend supports stops the compile ('No supported config
  found': the 1B at 32k for described H100s, since 7854d81); XLA's autotuner, which
  without a GPU times nothing either, finds one that compiles, so the compile is tried
  again with it (slower: only where the fast one fails)."""
  options = plan_target.compiler_options(devices)
  try:
    return lowered.compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as error:
    if "xla_gpu_autotune_level" not in options or "No supported config found" not in str(error):
      raise
    return lowered.compile(compiler_options={
        key: value for key, value in options.items() if key != "xla_gpu_autotune_level"})


def memory_figures(compiled) -> dict[str, int]:
  """XLA's per-device memory analysis; peak = args + temps + outputs - aliased (donated).
  `host_temp_bytes`: what the program keeps in host memory (remat 'offload' on a GPU)."""
  memory = compiled.memory_analysis()
  out = {"argument_bytes": memory.argument_size_in_bytes,
         "output_bytes": memory.output_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
         "alias_bytes": memory.alias_size_in_bytes,
         "code_bytes": memory.generated_code_size_in_bytes,
         "host_temp_bytes": memory.host_temp_size_in_bytes}
  out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                       - out["alias_bytes"])
  return out


def plan(config: ml_collections.ConfigDict, device_memory_gib: float | None = None,
         mfu: float = 0.4, accelerator: str = "h100", floor: bool = True,
         compiler: str = "auto") -> dict[str, Any]:
  """Compiles the config's train step for described GPUs or TPU chips or fake CPU devices
  (`compiler`, see `plan_target.described_target`) and prints (and returns) the plan.

  Byte figures are per device; FLOPs are per step, for the whole mesh unless named
  `per_device`. `device_memory_gib` defaults to the accelerator's (`plan_target.memory_gib`).
  `floor` adds the float32 compile that bounds the CPU's promotion. Raises ConfigError for a
  config that cannot run or an unknown accelerator.
  """
  peak_key = plan_target.peak_key(accelerator)
  target = plan_target.described_target(compiler, accelerator)
  budget = (plan_target.budget_label(target or accelerator) if not device_memory_gib
            else None)
  device_memory_gib = device_memory_gib or default_memory_gib(target, accelerator)
  start = time.monotonic()
  out, compiled = memory_plan(config, device_memory_gib, floor, target)
  compile_s = time.monotonic() - start

  count = out["devices"]
  tokens = config.train.batch_size * config.data.seq_len
  out["tokens_per_step"] = tokens
  out["analytic_flops"] = flops.flops_per_token(model_config(config), config.data.seq_len) * tokens
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out["xla_flops_per_device"] = float((cost or {}).get("flops", float("nan")))
  peak = flops.PEAK_FLOPS[peak_key]
  out["step_time_s"] = out["analytic_flops"] / (count * peak * mfu)
  out["tokens_per_sec"] = tokens / out["step_time_s"]
  out["compile_s"] = compile_s
  if not peak_key.startswith("tpu_"):  # NVLink and InfiniBand: GPU nodes' links
    out["ring_links"] = ring_links.lines(config, out["mesh"], peak, mfu)
  out.update(layout_choice(config, count))
  print_plan(config, out, device_memory_gib, mfu, peak_key, budget)
  return out


def layout_choice(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, Any]:
  """Each layout's attention critical path for the config's layers (their windows summed
  over the layers; with per-head spans, every local layer's schedule is the one the model
  runs, SKIP by the widest span of any local head) on its ring, and the shortest: {} for
  dense attention."""
  if config.model.attention == "dense":
    return {}
  split = attention_split(config, num_devices)
  cfg = model_config(config)
  table, best = parallelism.compare_layouts(
      config.data.seq_len, split.schedule.num_shards, split.tile,
      tuple((cfg.window_of(kind), cfg.narrowest_span if kind == "L" else None)
            for kind in cfg.layer_kinds))
  return {"layout_table": table, "best_layout": best}


def default_memory_gib(target: str | None, accelerator: str) -> float:
  """What a plan is checked against unless told: what JAX may use of one device of the
  accelerator (`plan_target.memory_gib`: a GPU's share, a TPU chip's HBM), whether the plan
  compiled for it (`target`) or for fake CPU devices."""
  return plan_target.memory_gib(target or accelerator)


def memory_plan(config: ml_collections.ConfigDict, device_memory_gib: float,
                floor: bool = True, target: str | None = None) -> tuple[dict[str, Any], Any]:
  """Compiles the step for `target` (described GPUs or a TPU slice: `plan_target`) or fake
  CPU devices (with
  `floor`, twice: also in float32) and fills in its memory figures and verdict; the
  configured compile is returned for its cost analysis."""
  count = plan_device_count(config)
  if target:
    _cpu_backend()  # JAX itself stays on the CPU; only the compile is for the target.
    devices = plan_target.described_devices(target, count)
  else:
    devices = fake_devices(count)
  with plan_target.compiling_for(devices):  # The kernel checks, for the GPU.
    check_config(config, count)
    kernel, kernel_why = (None, None) if config.model.attention == "dense" else (
        block_kernels(config, count))
  mesh = parallelism.make_mesh(config.mesh, devices)
  compiled, state = compile_step(config, mesh)
  out = {"devices": count, "mesh": dict(mesh.shape),
         "compiled_for": devices[0].device_kind if target else "cpu",
         "kernel": kernel, "kernel_why": kernel_why,
         "params": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
         "param_bytes": tree_shard_bytes(state.params),
         "opt_state_bytes": tree_shard_bytes(state.opt_state), **memory_figures(compiled)}
  if target:
    if config.model.attention != "dense" and devices[0].platform == "gpu":
      out["ring_overlap"] = overlap.summary(overlap.transfers(compiled.as_text()))
    return with_verdict(accelerator_figures(out), device_memory_gib), compiled
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


def accelerator_figures(out: dict[str, Any]) -> dict[str, Any]:
  """`out` (memory figures of a compile for the accelerator itself, described or attached)
  with its totals: no CPU promotion to bound, so the floor is the total, and what 'offload'
  keeps in host memory is the compiler's own placement, outside the device's figures."""
  total = out["peak_bytes"] + out["code_bytes"]
  return {**out, "total_bytes": total, "floor_total_bytes": total,
          "offloaded_bytes": out["host_temp_bytes"]}


def with_verdict(out: dict[str, Any], device_memory_gib: float) -> dict[str, Any]:
  """`out` with `fits` (its total fits) and `may_fit` (its floor does) for a memory."""
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
  dense = config.model.attention == "dense"  # no ring, no tiles: seq_len=0 leaves them out
  return parallelism.length_unit(layout_of(config.model.attention), shape["sequence"],
                                 config.model.attention_tile, shape["ulysses"],
                                 seq_len=0 if dense else None)


def find_max_seq_len(config: ml_collections.ConfigDict, device_memory_gib: float | None = None,
                     log=print, target: str | None = None, accelerator: str = "h100") -> int:
  """The longest sequence (a multiple of `seq_len_unit`) whose figure (for `target`, else the
  CPU's) fits, by doubling from the config's length and then bisecting to within 1/16; 0 if
  even one unit does not."""
  unit = seq_len_unit(config)
  device_memory_gib = device_memory_gib or default_memory_gib(target, accelerator)
  # A probed length -> its compile's peak host memory above what the search started with
  # (not above what the probe started with: memory an earlier compile kept is reused).
  host_peaks: dict[int, int] = {}
  start_rss = host_memory.resident_bytes()

  def fits(seq_len: int) -> bool:
    probe = copy.deepcopy(config)
    probe.data.seq_len = seq_len
    started = time.monotonic()
    with host_memory.PeakMeter() as meter:
      out, _ = memory_plan(probe, device_memory_gib, floor=False, target=target)
    if meter.peak is not None and start_rss is not None:
      host_peaks[seq_len] = max(0, meter.peak - start_rss)
    log(f"  {seq_len:>12,} tokens: {out['total_bytes'] / GIB:7.1f} GiB  "
        f"{'fits' if out['fits'] else 'does not fit'}  [compiled in "
        f"{time.monotonic() - started:.0f} s]")
    return out["fits"]

  log(f"longest sequence for {device_memory_gib:.4g} GiB per device "
      f"({target + ' compile' if target else 'CPU compile'}), in multiples of {unit:,}:")
  length = max(unit, config.data.seq_len // unit * unit)
  if fits(length):
    low, high = length, None
    while high is None:
      if 2 * low > MAX_SEARCHED_SEQ_LEN:
        log(f"{low:,} tokens fit; the search stops at {MAX_SEARCHED_SEQ_LEN:,}")
        return low
      beyond_host = _beyond_host_memory(host_peaks, 2 * low, _room(start_rss))
      if beyond_host:
        log(f"{low:,} tokens fit; {2 * low:,} were not tried: {beyond_host}")
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


def _room(start_rss: int | None) -> int | None:
  """How far this process may grow above `start_rss` before the host runs out."""
  available, rss = host_memory.available_bytes(), host_memory.resident_bytes()
  return None if None in (available, rss, start_rss) else available + rss - start_rss


def _beyond_host_memory(host_peaks: dict[int, int], seq_len: int,
                        room: int | None) -> str | None:
  """Why compiling `seq_len` would likely take more host memory than `room` (which the OS
  answers with a silent kill), or None. Extrapolates the last doubling's growth, between
  1x and 4x per doubling: the schedule's tile tables grow with the square of the tiles per
  block (the tiny config's 32-token tiles took 2 GB at 1M tokens, 7 GB at 2M)."""
  probed = sorted(length for length in host_peaks if length < seq_len)
  if room is None or len(probed) < 2:
    return None
  last, before = probed[-1], probed[-2]
  ratio = host_peaks[last] / max(host_peaks[before], 1)
  per_doubling = min(4.0, max(1.0, ratio ** (1 / math.log2(last / before))))
  need = host_peaks[last] * per_doubling ** math.log2(seq_len / last)
  if need <= room:
    return None
  return (f"its compile would take about {need / host_memory.GB:.0f} GB more host memory "
          f"({last:,} tokens took {host_peaks[last] / host_memory.GB:.1f} GB, "
          f"{host_peaks[before] / host_memory.GB:.1f} GB at {before:,}), and "
          f"{room / host_memory.GB:.0f} GB are free; search on a machine with more to go "
          f"further")
