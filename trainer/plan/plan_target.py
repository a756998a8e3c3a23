"""GPUs described to XLA's GPU compiler, so a dry run compiles for them on a machine without.

The CUDA PJRT plugin (`jax-cuda13-plugin`, pinned in constraints.txt) holds XLA's GPU
compiler. Given a description of the GPU (a `GpuTargetConfigProto`: SM count, shared
memory, compute capability, memory size) it compiles for devices that are not attached, with
no GPU and no CUDA driver (ahead of time, "deviceless"). Its memory analysis is the GPU's own
buffer assignment: bf16 stays bf16, remat 'offload' puts the layer inputs in host memory, and
the attention is the fused Triton kernel instead of the CPU's reference one. What it cannot
see: autotuning (GEMM and fusion configs are XLA's defaults), and memory outside the XLA
program (the CUDA context, cuBLAS/cuDNN workspaces, NCCL's buffers), which a real GPU
holds beside it.

A plan is judged against the GPU's memory times `XLA_PYTHON_CLIENT_MEM_FRACTION`, the share
JAX may allocate: 0.95 unless the environment says otherwise, as the Dockerfile sets it (JAX's
own default is 0.75); the rest is left to the CUDA context and libraries.

The plugin lives in `.plan_gpu/` (`make plan_gpu`), not in the virtual environment: JAX
loads every plugin it finds there in every process, and on a machine without CUDA each run
would print that no driver was found. The planner registers it with JAX only to compile a
GPU plan (`compiler_installed` merely looks for it). TPU slices are described the same way
by XLA's TPU compiler (`trainer.plan.tpu_target`); `described_target` and
`described_devices` are the planner's entry for both.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import subprocess
import sys
import warnings
from typing import Iterator

import jax

import parallelism
from trainer.config.config_check import ConfigError
from trainer.config import flops
from trainer.core import xla_options
from trainer.plan import COMPILERS, tpu_target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN_DIR = os.environ.get("PLAN_GPU_DIR") or os.path.join(ROOT, ".plan_gpu")
DEVICES_PER_HOST = flops.GPUS_PER_NODE  # a topology of more devices is hosts of this many

# The fields XLA's GPU compiler reads, from XLA's own target specs
# (xla/backends/gpu/target_config/specs/{h100_sxm,h200,h100_pcie,a100_sxm_80}.txtpb).
_HOPPER = dict(core_count=132, fpus_per_core=128, shared_memory_per_core=233472,
               shared_memory_per_block_optin=232448, l2_cache_size=52428800,
               clock_rate_ghz=1.98, compute_capability=(9, 0))
GPUS = {
    "h100": dict(_HOPPER, name="NVIDIA H100 80GB HBM3", device_memory_size=84942979072,
                 memory_bandwidth=3352320000000),
    "h200": dict(_HOPPER, name="NVIDIA H200 141GB HBM3e", device_memory_size=151397597184,
                 memory_bandwidth=4800000000000),
    "h100_pcie": dict(_HOPPER, name="NVIDIA H100 PCIe", core_count=114, clock_rate_ghz=1.755,
                      device_memory_size=84942979072, memory_bandwidth=2039040000000),
    "a100": dict(name="NVIDIA A100-SXM4-80GB", core_count=108, fpus_per_core=64,
                 shared_memory_per_core=167936, shared_memory_per_block_optin=166912,
                 l2_cache_size=41943040, clock_rate_ghz=1.41, compute_capability=(8, 0),
                 device_memory_size=85100068864, memory_bandwidth=2039040000000),
}


def target_config(gpu: str) -> str:
  """The GpuTargetConfigProto text of a GPU in `GPUS`."""
  spec = GPUS[gpu]
  major, minor = spec["compute_capability"]
  fields = {key: spec[key] for key in (
      "core_count", "fpus_per_core", "shared_memory_per_core", "shared_memory_per_block_optin",
      "l2_cache_size", "clock_rate_ghz", "device_memory_size", "memory_bandwidth")}
  fields.update(threads_per_block_limit=1024, threads_per_warp=32,
                shared_memory_per_block=49152, threads_per_core_limit=2048,
                block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
                registers_per_core_limit=65536, registers_per_block_limit=65536)
  info = "\n".join(f"  {key}: {value}" for key, value in fields.items())
  return (f"gpu_device_info {{\n{info}\n  cuda_compute_capability {{ major: {major} minor: "
          f"{minor} }}\n}}\nruntime_version {{ major: 13 minor: 0 }}\n"
          f"platform_name: \"CUDA\"\ndnn_version_info {{ major: 9 minor: 12 }}\n"
          f"device_description_str: \"{spec['name']}\"\n")


DEFAULT_MEMORY_FRACTION = 0.95  # The Dockerfile's XLA_PYTHON_CLIENT_MEM_FRACTION.


def peak_key(accelerator: str) -> str:
  """The key of `flops.PEAK_FLOPS` for `--plan_accelerator` (a GPU, a TPU kind, or a TPU
  slice such as `v5p-16`); one line naming the kinds known for any other name."""
  key = flops.accelerator_key(accelerator)
  if key is None:
    raise ConfigError(flops.accelerator_problem(accelerator))
  return key


def described_target(compiler: str, accelerator: str) -> str | None:
  """What a plan compiles for: the accelerator (a key of `GPUS`, or a TPU kind or slice)
  described to its compiler, or None for fake CPU devices. `auto`: the accelerator when its
  compiler is installed, else the CPU."""
  if compiler not in COMPILERS:
    raise ConfigError(f"--plan_compiler={compiler!r} is not one of {', '.join(COMPILERS)}")
  peak_key(accelerator)  # an unknown accelerator stops here, whatever compiles
  if compiler == "cpu":
    return None
  platform = "tpu" if tpu_target.parse(accelerator) else "gpu"
  if compiler not in ("auto", platform):
    kinds = ", ".join(GPUS) if compiler == "gpu" else ", ".join(tpu_target.CHIPS)
    raise ConfigError(f"--plan_compiler={compiler} compiles for {kinds}; "
                      f"--plan_accelerator={accelerator!r} is none of them")
  installed = tpu_target.compiler_installed() if platform == "tpu" else compiler_installed()
  if compiler == "auto" and not installed:
    return None
  return accelerator


def memory_gib(target: str) -> float:
  """What JAX may allocate on one device of `target`: a GPU's memory times
  `memory_fraction()`; a TPU chip's HBM."""
  tpu = tpu_target.parse(target)
  if tpu:
    return tpu_target.CHIPS[tpu[0]].hbm_gib
  return GPUS[target]["device_memory_size"] * memory_fraction() / 2.0 ** 30


def budget_label(target: str) -> str:
  tpu = tpu_target.parse(target)
  if tpu:
    return f"the {tpu_target.CHIPS[tpu[0]].hbm_gib:g} GiB HBM of a TPU {tpu[0]} chip"
  return (f"{memory_fraction():g} of the {GPUS[target]['device_memory_size'] / 2.0 ** 30:.2f} "
          f"GiB of an {target}: XLA_PYTHON_CLIENT_MEM_FRACTION")


def memory_fraction() -> float:
  return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or DEFAULT_MEMORY_FRACTION)


def described_devices(target: str, count: int) -> tuple[jax.Device, ...]:
  """`count` described devices of `target`: GPUs (`devices`) or a TPU slice's chips, whose
  size, where `target` names it (`v5p-16`), must be `count`."""
  tpu = tpu_target.parse(target)
  if not tpu:
    return devices(target, count)
  kind, chips = tpu
  if chips is not None and chips != count:
    raise ConfigError(f"--plan_accelerator={target} is {chips} chips; this config's mesh has "
                      f"{count} devices")
  return tpu_target.devices(kind, count)


def compiler_installed() -> bool:
  """Whether XLA's GPU compiler (the CUDA plugin) can be loaded, here or from PLUGIN_DIR."""
  return _find_plugin() is not None


@functools.lru_cache(maxsize=None)
def devices(gpu: str, count: int) -> tuple[jax.Device, ...]:
  """`count` described (not attached) GPUs of kind `gpu`, in hosts of 8 beyond 8. Made once
  per kind and count: `--find_max_seq_len` and `--compare_strategies` plan many times."""
  if gpu not in GPUS:
    raise ConfigError(f"no GPU description for {gpu!r}; the planner compiles for "
                      f"{', '.join(GPUS)}")
  if count > DEVICES_PER_HOST and count % DEVICES_PER_HOST:
    raise ConfigError(f"{count} GPUs are not whole hosts of {DEVICES_PER_HOST}")
  per_host = min(count, DEVICES_PER_HOST)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  def describe():
    return topologies.get_topology_desc("plan", "cuda", target_config=target_config(gpu),
                                        topology=f"1x{count // per_host}x{per_host}").devices

  # JAX may load the plugin itself here (it finds plugins on sys.path, PLUGIN_DIR included
  # once `_find_plugin` has looked there), so loading is quieted here, not only in ours.
  with _without_missing_driver_lines():
    try:
      return tuple(describe())
    except NotImplementedError:  # JAX has no CUDA plugin registered: load ours.
      _register_plugin()
      return tuple(describe())


@contextlib.contextmanager
def compiling_for(devices) -> Iterator[None]:
  """Within: checks and compiles are for `devices`. For described GPUs or TPUs that means the
  kernels are chosen and lowered for them (`parallelism.compiling_for`), and no warning that
  an executable could not be read from JAX's persistent compilation cache (when one is
  configured): one for described devices never can be (there is no client to load it on),
  and the compile then simply runs. For attached devices, nothing changes."""
  platform = devices[0].platform
  if platform == "cpu" or jax.default_backend() == platform:
    yield
    return
  with parallelism.compiling_for(platform), warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Error reading persistent compilation cache")
    yield


def compiler_options(devices) -> dict[str, object]:
  """XLA options of a compile for `devices`: on GPUs the train step's own
  (`trainer.core.xla_options`), and for described GPUs no autotuning: with no GPU to time
  candidates on, the GEMM and fusion configs are XLA's defaults either way (the module
  docstring), and the autotuner only spends compile time on them (about half of the tiny
  config's GPU plan; its memory analysis is the same to the byte)."""
  options = xla_options.for_platform(devices[0].platform)
  if devices[0].platform != "gpu" or jax.default_backend() == "gpu":
    return options
  return {**options, "xla_gpu_autotune_level": 0}


# The CUDA 13 plugin, which our GPU machines run; its CUDA runtime and cuDNN (>= 9.12, the
# plugin's own lower bound) are what `target_config` describes.
_PLUGIN = "jax_plugins.xla_cuda13"


def _find_plugin():
  """The CUDA plugin's module: from the environment (a GPU install), else PLUGIN_DIR."""
  try:
    return importlib.import_module(_PLUGIN)
  except ImportError:
    pass
  if not os.path.isdir(PLUGIN_DIR):
    return None
  if PLUGIN_DIR not in sys.path:
    sys.path.append(PLUGIN_DIR)
  try:
    return importlib.import_module(_PLUGIN)
  except ImportError:
    return None


def _register_plugin() -> None:
  plugin = _find_plugin()
  if plugin is None:
    raise ConfigError(
        f"compiling the plan for GPUs needs XLA's GPU compiler (the CUDA plugin, no GPU "
        f"needed): run `make plan_gpu` to install it into {PLUGIN_DIR}, or plan on the CPU "
        f"with --plan_compiler=cpu")
  # The plugin checks the CUDA libraries' versions unless JAX runs on the CPU only; none is
  # installed (nor needed) for compiling.
  skip = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  try:
    plugin.initialize()
  except RuntimeError as error:
    raise ConfigError(f"XLA's GPU compiler in {PLUGIN_DIR} did not load: {error}") from error
  finally:
    if skip is None:
      del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]


# What loading the plugin prints from C++ on a machine without CUDA, which is every machine a
# described-GPU plan is for: true, expected, and alarming to read ("GPU will not be used").
_MISSING_DRIVER_LINES = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|cudart_stub\.cc:\d+\] Could not find cuda drivers")


# Passes its stdin to its stderr, less the lines that match argv[1].
_FILTER = ("import re, sys\n"
           "drop = re.compile(sys.argv[1].encode())\n"
           "for line in sys.stdin.buffer:\n"
           "  if not drop.search(line):\n"
           "    sys.stderr.buffer.write(line)\n"
           "    sys.stderr.buffer.flush()\n")


@contextlib.contextmanager
def _without_missing_driver_lines() -> Iterator[None]:
  """Within: file descriptor 2 (where C++ writes, below Python's sys.stderr) is a pipe to a
  small filter process that passes every line on to the real stderr but the two above. A
  process, not a thread: should the plugin abort while loading, the filter still drains the
  pipe, and the abort's message shows."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    line_filter = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _FILTER, _MISSING_DRIVER_LINES.pattern],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=saved)
  except OSError:  # No filter: the lines show, as they would anyway.
    os.close(saved)
    yield
    return
  try:
    with line_filter.stdin:
      os.dup2(line_filter.stdin.fileno(), 2)
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)  # closes the pipe's last write end: the filter reads to its end, exits
    os.close(saved)
    line_filter.wait()
