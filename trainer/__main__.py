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
# Before the imports (seconds of JAX, in `main`): a signal while they run exits cleanly too.
# `train` installs its own handlers (stop after the current step) while it runs.
for _signal in (signal.SIGTERM, signal.SIGINT):
  signal.signal(_signal, _stopped_before_training)

# Only what parses and checks the flags: a mistyped flag or field, a config file that does
# not load and a misplaced plan flag are said before JAX is imported, at once.
from absl import app, flags, logging
import ml_collections
from ml_collections import config_flags

from trainer.config import cli, fields
from trainer.plan import command as planner

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
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


def _config() -> ml_collections.ConfigDict:
  """The parsed config; a config file that failed to load becomes one line, not a traceback."""
  try:
    return _CONFIG.value
  except OSError as error:
    cli.exit_config_unloadable(error)


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
  from trainer.track import wandb_tracker  # pylint: disable=g-import-not-at-top
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
  problem = planner.flags_problem()
  if problem:
    sys.exit(f"error: {problem}")
  if _PROFILE_STEPS.value and planner.DRY_RUN.value:
    sys.exit("error: --profile_steps traces training steps; a --dry_run trains none")
  # pylint: disable=g-import-not-at-top  # The flags are fine: now the seconds of imports.
  import jax

  import data
  from model.hf_format import HFFormatError
  from trainer.ckpt import hf_import
  from trainer.ckpt.checkpointing import CheckpointError
  from trainer.config import span_plan, stages
  from trainer.config.config_check import ConfigError, check_config
  from trainer.config.workdir import WorkdirError
  from trainer.run import distributed
  from trainer.run.loop import NonFiniteError, train
  from trainer.run.stop_signals import StoppedBeforeTraining
  from trainer.tools import needle
  from trainer.track import profiling
  from trainer.track.tracking import TrackingError
  # pylint: enable=g-import-not-at-top
  try:
    profile_steps = profiling.parse_steps(_PROFILE_STEPS.value)
  except ValueError as error:
    sys.exit(f"error: {error}")
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  watch = None
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
    if planner.DRY_RUN.value:
      planner.run(config)
      return
    if config.cpu_devices:
      jax.config.update("jax_num_cpu_devices", config.cpu_devices)
    watch = distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if jax.process_count() > 1:  # `train` installs no handler then (see stop_signals.StopSignals):
      signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is an error exit.
    name = os.path.splitext(os.path.basename(config_flags.get_config_filename(
        flags.FLAGS["config"])))[0]
    workdir = _WORKDIR.value or os.path.join("runs", name)
    if watch:  # Named in the line said when another process dies.
      watch.checkpoints = os.path.join(os.path.abspath(workdir), "checkpoints")
    distributed.same_settings({**_shared_fields(config), "--workdir": os.path.abspath(workdir)})
    note = span_plan.prefer_copy(config, workdir)  # A deleted plan file: the run's copy.
    if note:
      print(note, flush=True)
    check_config(config, jax.device_count())
    # WANDB_MODE too, which the config check does not read: before the workdir exists. Each
    # host has its own environment, and a process that stopped alone would leave the others
    # waiting.
    distributed.stop_together(_wandb_mode_problem(config), "its WANDB_MODE is not valid")
    last_step = stages.resolve(config)[-1].last_step
    if profile_steps and profile_steps[0] > last_step:
      raise ConfigError(f"--profile_steps={_PROFILE_STEPS.value} starts after the run's last "
                        f"step, {last_step}")
    train(config, workdir, start_over=_START_OVER.value, profile_steps=profile_steps,
          periodic_evals=(needle.periodic_eval,))
  except StoppedBeforeTraining as stopped:
    print(stopped, flush=True)
  except jax.errors.JaxRuntimeError:
    if watch:  # Gloo's "Connection reset by peer": the watch's one line, not this traceback.
      watch.wait_for_loss(seconds=5)
    raise
  except (ConfigError, data.DataError, CheckpointError, NonFiniteError, WorkdirError,
          TrackingError, HFFormatError) as error:
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=cli.parse_flags)
