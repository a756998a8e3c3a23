"""`python -m trainer --config ... --dry_run`: the planner's flags and their dispatch, over
each stage of the config (the train command parses them; only a dry run reads them)."""

from __future__ import annotations

import ml_collections
from absl import flags

from trainer.config import flops, stages
from trainer.plan import COMPILERS

DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Plan only: compile the train step for the config's mesh of "
    "--plan_accelerator GPUs (described to XLA's GPU compiler, `make plan_gpu`; no GPU needed) "
    "or of fake CPU devices, from abstract shapes; print memory, FLOPs and step time, and "
    "whether it fits.")
_FIND_MAX = flags.DEFINE_bool(
    "find_max_seq_len", False, "Dry run: find the longest data.seq_len whose plan fits "
    "--device_memory_gib, by compiles at doubling then bisected lengths.")
_MEMORY_GIB = flags.DEFINE_float(
    "device_memory_gib", None, "Dry run: memory of one accelerator to check the plan against "
    "(default: --plan_accelerator's).")
_COMPILER = flags.DEFINE_enum(
    "plan_compiler", "auto", list(COMPILERS), "Dry run: compile for described GPUs of "
    "--plan_accelerator's kind (gpu: XLA's GPU compiler, installed by `make plan_gpu`), a "
    "described TPU slice (tpu: XLA's TPU compiler, `make plan_tpu`), or fake CPU devices "
    "(cpu: bf16 buffers may be float32, bounded by a second compile); auto: the "
    "accelerator's compiler when installed, else cpu.")
_MFU = flags.DEFINE_float("plan_mfu", 0.4, "Dry run: MFU the step-time estimate assumes.")
_ACCELERATOR = flags.DEFINE_string(
    "plan_accelerator", "h100", f"Dry run: the accelerator whose peak FLOP/s the step-time "
    f"estimate uses and whose memory a plan is checked against: one of "
    f"{', '.join(k for k in flops.PEAK_FLOPS if not k.startswith('tpu_'))}, or a TPU kind "
    f"(v4, v5e, v5p, v6e: as many chips as the mesh has devices) or slice (v5p-16).")
_COMPARE = flags.DEFINE_bool(
    "compare_strategies", False, "Dry run: plan every sequence-parallel strategy and ring x "
    "Ulysses split of the config's sequence devices (trainer/plan/strategy_plan.py): memory from "
    "each compiled step, bytes sent, attention balance and an estimated step time.")
_INTRA_GBPS = flags.DEFINE_float(
    "intra_node_gbps", flops.LINK_BYTES_PER_S["nvlink"] / 1e9, "--compare_strategies: GB/s "
    "per device inside a node (H100 NVLink).")
_INTER_GBPS = flags.DEFINE_float(
    "inter_node_gbps", flops.LINK_BYTES_PER_S["ib_400g"] / 1e9, "--compare_strategies: GB/s "
    "per device across nodes (400 Gb/s InfiniBand).")
_NODE_SIZE = flags.DEFINE_integer("node_size", flops.GPUS_PER_NODE,
                                  "--compare_strategies: devices per node.")

_PLAN_FLAGS = ("find_max_seq_len", "compare_strategies", "device_memory_gib", "plan_compiler",
               "plan_mfu", "plan_accelerator", "intra_node_gbps", "inter_node_gbps", "node_size")
# The plan flags that only some --dry_run modes read ("plan": a plain --dry_run).
_READ_ONLY_BY = {"plan_mfu": ("plan", "compare_strategies"),
                 **dict.fromkeys(("intra_node_gbps", "inter_node_gbps", "node_size"),
                                 ("compare_strategies",))}


def flags_problem() -> str | None:
  """A plan flag without --dry_run (training would ignore it), or that this --dry_run mode
  does not read, or out of range; two modes at once."""
  # `--nofind_max_seq_len` asks for nothing: a boolean counts when true.
  given = [name for name in _PLAN_FLAGS
           if flags.FLAGS[name].present and flags.FLAGS[name].value is not False]
  if given and not DRY_RUN.value:
    return f"--{given[0]} plans: pass it with --dry_run"
  if _FIND_MAX.value and _COMPARE.value:
    return "pass one of --find_max_seq_len and --compare_strategies"
  mode = ("compare_strategies" if _COMPARE.value else
          "find_max_seq_len" if _FIND_MAX.value else "plan")
  for name in given:
    readers = _READ_ONLY_BY.get(name, (mode,))
    if mode not in readers:
      return (f"--{name} is read by " + " and ".join(
          "a plain --dry_run" if reader == "plan" else f"--{reader}" for reader in readers)
              + " only")
  # Written as `not x > 0`, so that nan is out of range too.
  if _MEMORY_GIB.value is not None and not _MEMORY_GIB.value > 0:
    return f"--device_memory_gib={_MEMORY_GIB.value:g} must be positive"
  if flops.accelerator_problem(_ACCELERATOR.value):
    return flops.accelerator_problem(_ACCELERATOR.value)
  if not 0 < _MFU.value <= 1:
    return f"--plan_mfu={_MFU.value:g} must be in (0, 1]"
  for flag in (_INTRA_GBPS, _INTER_GBPS, _NODE_SIZE):
    if not flag.value > 0:
      return f"--{flag.name}={flag.value:g} must be positive"
  return None


def run(config: ml_collections.ConfigDict) -> None:
  """The dry run the flags ask for, for each stage of `config` in order."""
  # Imported here: the planner sets up JAX's (CPU) backend before it starts, and the flags
  # above are parsed and checked without JAX.
  from trainer.plan import dry_run, plan_target  # pylint: disable=g-import-not-at-top
  # find/compare plan by what they compile for; `plan` resolves the same from its flags.
  target = (plan_target.described_target(_COMPILER.value, _ACCELERATOR.value)
            if _FIND_MAX.value or _COMPARE.value else None)
  for stage in stages.resolve(config):
    if stage.name:
      print(f"{stage.label}:", flush=True)
    if _FIND_MAX.value:
      dry_run.find_max_seq_len(stage.config, _MEMORY_GIB.value, target=target,
                               accelerator=_ACCELERATOR.value)
    elif _COMPARE.value:
      from trainer.plan import strategy_plan  # pylint: disable=g-import-not-at-top
      strategy_plan.compare(stage.config, _MEMORY_GIB.value, _MFU.value, _ACCELERATOR.value,
                            _INTRA_GBPS.value, _INTER_GBPS.value, _NODE_SIZE.value,
                            target=target)
    else:
      dry_run.plan(stage.config, device_memory_gib=_MEMORY_GIB.value, mfu=_MFU.value,
                   accelerator=_ACCELERATOR.value, compiler=_COMPILER.value)
