"""Entry point: `python -m trainer --config configs/tiny_cpu.py [--config.train.steps=20]`."""

import os
import sys

from absl import app, flags, logging
import jax
from ml_collections import config_flags

import data
from trainer import distributed
from trainer.config_check import ConfigError, check_config
from trainer.checkpointing import CheckpointError
from trainer.loop import NonFiniteError, train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Plan only: compile the train step on fake CPU devices of the config's "
    "mesh from abstract shapes, print memory, FLOPs and step time, and whether it fits.")
_MEMORY_GIB = flags.DEFINE_float("device_memory_gib", 80.0,
                                 "Dry run: memory of one accelerator to check the plan against.")
_PLAN_MFU = flags.DEFINE_float("plan_mfu", 0.4, "Dry run: MFU the step-time estimate assumes.")
_PLAN_ACCELERATOR = flags.DEFINE_string(
    "plan_accelerator", "h100", "Dry run: accelerator (a key of trainer.flops.PEAK_FLOPS) whose "
    "peak FLOP/s the step-time estimate uses.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0 (else detected from "
    "SLURM / MPI / TPU pod environments, or single-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")


def _parse_flags(argv: list[str]) -> list[str]:
  # One line naming the bad flag or field, instead of absl's usage dump.
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    sys.exit(f"error: {error}")
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


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # JAX's INFO lines (absent TPU etc.) are noise here.
  config = _CONFIG.value
  try:
    if _DRY_RUN.value:
      # Imported here: the planner sets up fake CPU devices before JAX's backend starts.
      from trainer import dry_run  # pylint: disable=g-import-not-at-top
      dry_run.plan(config, device_memory_gib=_MEMORY_GIB.value, mfu=_PLAN_MFU.value,
                   accelerator=_PLAN_ACCELERATOR.value)
      return
    if config.cpu_devices:
      jax.config.update("jax_num_cpu_devices", config.cpu_devices)
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    check_config(config, jax.device_count())
    name = os.path.splitext(os.path.basename(config_flags.get_config_filename(
        flags.FLAGS["config"])))[0]
    train(config, _WORKDIR.value or os.path.join("runs", name))
  except (ConfigError, data.DataError, CheckpointError, NonFiniteError) as error:
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=_parse_flags)
