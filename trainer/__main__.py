"""Entry point: `python -m trainer --config configs/tiny_cpu.py [--config.train.steps=20]`."""

import json
import os
import signal
import sys
from typing import Any

from trainer.track import console  # Light: no JAX, so installed before the slow imports below.


def _stopped_before_training(signum, frame):
  del frame
  print(f"stopped by {signal.Signals(signum).name} before the first step; nothing was "
        f"trained, so nothing was saved or lost", flush=True)
  # Not SystemExit: raised inside a callback (JAX's gc hook, say) it is printed as ignored
  # and the run goes on. Until `train` starts, and after it returns, nothing is being written.
  os._exit(0)  # pylint: disable=protected-access


console.install_hooks()
# Before the imports below (seconds of JAX): a signal while they run exits cleanly too.
# `train` installs its own handlers (stop after the current step) while it runs.
for _signal in (signal.SIGTERM, signal.SIGINT):
  signal.signal(_signal, _stopped_before_training)

from absl import app, flags, logging
import jax
import ml_collections
from ml_collections import config_flags

import data
import parallelism
from model.hf_format import HFFormatError
from trainer.ckpt import hf_import
from trainer.ckpt.checkpointing import CheckpointError
from trainer.config import fields, flops, stages
from trainer.config.config_check import ConfigError, check_config
from trainer.config.workdir import WorkdirError
from trainer.plan import plan_target
from trainer.run import distributed
from trainer.run.loop import NonFiniteError, train
from trainer.run.stop_signals import StoppedBeforeTraining
from trainer.tools import needle, run_flags
from trainer.track import profiling, wandb_tracker
from trainer.track.tracking import TrackingError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
_DRY_RUN = flags.DEFINE_bool(
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
_PLAN_COMPILER = flags.DEFINE_enum(
    "plan_compiler", "auto", list(plan_target.COMPILERS), "Dry run: compile for described GPUs of "
    "--plan_accelerator's kind (gpu: XLA's GPU compiler, installed by `make plan_gpu`), or for "
    "fake CPU devices (cpu: bf16 buffers may be float32, bounded by a second compile); auto: "
    "gpu when installed and the accelerator is a GPU.")
_PLAN_MFU = flags.DEFINE_float("plan_mfu", 0.4, "Dry run: MFU the step-time estimate assumes.")
_PLAN_ACCELERATOR = flags.DEFINE_enum(
    "plan_accelerator", "h100", list(flops.PEAK_FLOPS), "Dry run: the accelerator whose peak "
    "FLOP/s the step-time estimate uses, and whose memory a plan is checked against.")
_COMPARE = flags.DEFINE_bool(
    "compare_strategies", False, "Dry run: plan every sequence-parallel strategy and ring x "
    "Ulysses split of the config's sequence devices (trainer/plan/strategy_plan.py): memory from "
    "each compiled step, bytes sent, attention balance and an estimated step time.")
_INTRA_GBPS = flags.DEFINE_float("intra_node_gbps", 450.0, "--compare_strategies: GB/s per "
                                 "device inside a node (H100 NVLink: 450).")
_INTER_GBPS = flags.DEFINE_float("inter_node_gbps", 50.0, "--compare_strategies: GB/s per "
                                 "device across nodes (400 Gb/s InfiniBand: 50).")
_NODE_SIZE = flags.DEFINE_integer("node_size", 8, "--compare_strategies: devices per node.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0 (else detected from "
    "SLURM / MPI / TPU pod environments, or single-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")
_PROFILE_STEPS = flags.DEFINE_string(
    "profile_steps", "", "FIRST:LAST: write a jax.profiler trace of these training steps "
    "under <workdir>/profile (Perfetto or TensorBoard); start after the first step a process "
    "trains, which compiles.")
_START_OVER = flags.DEFINE_bool(
    "start_over_from_step_0", False, "Train from step 0 although the workdir's "
    "checkpoints_unusable/ holds damaged checkpoints set aside by an earlier run (they are "
    "kept, and no longer resumed from).")


def _config_file(argv: list[str]) -> str:
  """The file named by --config ('' if none); `file.py:arg` names an argument after it."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.partition("=")[2].partition(":")[0]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1].partition(":")[0]
  return ""


def _moved(path: str) -> str:
  """Where a config of one layout went: each model has one file, its layout the argument."""
  stem, _, layout = os.path.basename(path)[:-3].rpartition("_")
  model = os.path.join(os.path.dirname(path), f"{stem}_striped.py")
  if layout in parallelism.LAYOUTS and os.path.isfile(model):
    return f"; the layout is the model config's argument now: --config {model}:{layout}"
  return ""


def _parse_flags(argv: list[str]) -> list[str]:
  # One line naming the bad flag or field, instead of absl's usage dump.
  # Checked before parsing: ml_collections defers a missing file's error to its first use.
  path = _config_file(argv)
  if path and not os.path.isfile(path):
    sys.exit(f"error: config file {path} does not exist (--config){_moved(path)}")
  try:
    remaining = flags.FLAGS(argv)
  except flags.Error as error:
    sys.exit(f"error: {run_flags.flag_error(error)}")
  except SyntaxError as error:  # Raised while the config file is imported.
    sys.exit(f"error: syntax error in config file {error.filename}, line {error.lineno}: "
             f"{error.msg}")
  except OSError as error:  # The config file failed to load and an override touched it.
    _exit_config_unloadable(error)
  except IndexError:
    run_flags.exit_on_index_error(argv)
  except (AttributeError, KeyError) as error:
    # config_flags raises these for an override of a field the config does not have; the
    # innermost message is "'name'" plus, sometimes, a did-you-mean line.
    message = error
    while isinstance(message, BaseException) and message.args:
      message = message.args[0]
    key, _, hint = str(message).partition("\n")
    key = key.strip("'")
    culprits = [arg.split("=")[0] for arg in argv if arg.startswith("--config.")
                and f".{key}." in arg.split("=")[0] + "."]
    where = culprits[0] if culprits else key
    sys.exit(f"error: unknown config field '{key}' in {where}" + (f" ({hint})" if hint else ""))
  return remaining


def _exit_config_unloadable(error: OSError) -> None:
  """ml_collections' error chain ends in the OS's reason ('[Errno 2] No such file...')."""
  while error.__cause__ is not None:
    error = error.__cause__
  sys.exit(f"error: cannot load --config: {str(error).strip().splitlines()[-1].strip()}")


def _config() -> ml_collections.ConfigDict:
  """The parsed config; a config file that failed to load becomes one line, not a traceback."""
  try:
    return _CONFIG.value
  except OSError as error:
    _exit_config_unloadable(error)


_PLAN_FLAGS = ("find_max_seq_len", "compare_strategies", "device_memory_gib", "plan_compiler",
               "plan_mfu", "plan_accelerator", "intra_node_gbps", "inter_node_gbps", "node_size")
# The plan flags that only some --dry_run modes read ("plan": a plain --dry_run).
_READ_ONLY_BY = {"plan_mfu": ("plan", "compare_strategies"),
                 **dict.fromkeys(("intra_node_gbps", "inter_node_gbps", "node_size"),
                                 ("compare_strategies",))}


def _plan_flags_problem() -> str | None:
  """A plan flag without --dry_run (training would ignore it), or that this --dry_run mode
  does not read, or out of range."""
  # `--nofind_max_seq_len` asks for nothing: a boolean counts when true.
  given = [name for name in _PLAN_FLAGS
           if flags.FLAGS[name].present and flags.FLAGS[name].value is not False]
  if given and not _DRY_RUN.value:
    return f"--{given[0]} plans: pass it with --dry_run"
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
  if not 0 < _PLAN_MFU.value <= 1:
    return f"--plan_mfu={_PLAN_MFU.value:g} must be in (0, 1]"
  for flag in (_INTRA_GBPS, _INTER_GBPS, _NODE_SIZE):
    if not flag.value > 0:
      return f"--{flag.name}={flag.value:g} must be positive"
  return None


# Fields each host may set for itself: where its corpus, prepared data and tokenizer lie
# (their contents are compared once read).
_PER_HOST = ("data.path", "data.data_dir", "data.tokenizer")


def _shared_fields(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config's fields every process must agree on (see `_PER_HOST`), unscrubbed: each
  host's secrets differ, and a scrubbed value would differ with them."""
  return {name: value
          for name, value in fields.flatten(json.loads(config.to_json_best_effort())).items()
          if not fields.matches(name, _PER_HOST)}


def _wandb_mode_problem(config: ml_collections.ConfigDict) -> str | None:
  try:
    wandb_tracker.resolve_mode(config.wandb.mode)
  except ValueError as error:
    return str(error)
  return None


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # JAX's INFO lines (absent TPU etc.) are noise here.
  console.fold_orbax_logs(logging.get_absl_logger())
  config = _config()
  problem = _plan_flags_problem()
  if problem:
    sys.exit(f"error: {problem}")
  if _FIND_MAX.value and _COMPARE.value:
    sys.exit("error: pass one of --find_max_seq_len and --compare_strategies")
  if _PROFILE_STEPS.value and _DRY_RUN.value:
    sys.exit("error: --profile_steps traces training steps; a --dry_run trains none")
  try:
    profile_steps = profiling.parse_steps(_PROFILE_STEPS.value)
  except ValueError as error:
    sys.exit(f"error: {error}")
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  try:
    if config.init.from_hf:  # Sets the model's shape and tokenizer: before any check or plan.
      print(hf_import.apply_to_config(config, overrides), flush=True)
    problem = stages.problem(config)
    if problem:
      raise ConfigError(problem)
    problem, notes = stages.replaced_overrides(config, overrides)
    if problem:
      raise ConfigError(problem)
    for note in notes:
      print(note, flush=True)
    if _DRY_RUN.value:
      # Imported here: the planner sets up JAX's (CPU) backend before it starts.
      from trainer.plan import dry_run  # pylint: disable=g-import-not-at-top
      # find/compare plan by the GPU they compile for; `plan` resolves the same from its flags.
      gpu = (plan_target.gpu_target(_PLAN_COMPILER.value, _PLAN_ACCELERATOR.value)
             if _FIND_MAX.value or _COMPARE.value else None)
      for stage in stages.plan(config):  # A staged run: each stage's step, in order.
        if stage.name:
          print(f"{stage.label}:", flush=True)
        if _FIND_MAX.value:
          dry_run.find_max_seq_len(stage.config, _MEMORY_GIB.value, gpu=gpu,
                                   accelerator=_PLAN_ACCELERATOR.value)
        elif _COMPARE.value:
          from trainer.plan import strategy_plan  # pylint: disable=g-import-not-at-top
          strategy_plan.compare(stage.config, _MEMORY_GIB.value, _PLAN_MFU.value,
                                _PLAN_ACCELERATOR.value, _INTRA_GBPS.value, _INTER_GBPS.value,
                                _NODE_SIZE.value, gpu=gpu)
        else:
          dry_run.plan(stage.config, device_memory_gib=_MEMORY_GIB.value, mfu=_PLAN_MFU.value,
                       accelerator=_PLAN_ACCELERATOR.value, compiler=_PLAN_COMPILER.value)
      return
    if config.cpu_devices:
      jax.config.update("jax_num_cpu_devices", config.cpu_devices)
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if jax.process_count() > 1:  # `train` installs no handler then (see stop_signals.StopSignals):
      signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is an error exit.
    name = os.path.splitext(os.path.basename(config_flags.get_config_filename(
        flags.FLAGS["config"])))[0]
    workdir = _WORKDIR.value or os.path.join("runs", name)
    distributed.same_settings({**_shared_fields(config), "--workdir": os.path.abspath(workdir)})
    check_config(config, jax.device_count())
    # WANDB_MODE too, which the config check does not read: before the workdir exists. Each
    # host has its own environment, and a process that stopped alone would leave the others
    # waiting.
    distributed.stop_together(_wandb_mode_problem(config), "its WANDB_MODE is not valid")
    last_step = stages.plan(config)[-1].last_step
    if profile_steps and profile_steps[0] > last_step:
      raise ConfigError(f"--profile_steps={_PROFILE_STEPS.value} starts after the run's last "
                        f"step, {last_step}")
    train(config, workdir, start_over=_START_OVER.value, profile_steps=profile_steps,
          periodic_evals=(needle.periodic_eval,))
  except StoppedBeforeTraining as stopped:
    print(stopped, flush=True)
  except (ConfigError, data.DataError, CheckpointError, NonFiniteError, WorkdirError,
          TrackingError, HFFormatError) as error:
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=_parse_flags)
