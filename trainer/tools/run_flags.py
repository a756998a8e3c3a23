"""The command line of tools that read a run: its config, --workdir or --from_hf, --step and
`--config.*` overrides (`python -m trainer.sample`, `scripts/eval_needle.py`), and the
sampler's settings. Light: it imports no JAX, so a bad flag is said before seconds of
imports."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Callable

import ml_collections

from trainer.config import cli, span_plan
from trainer.config.stored import config_of, config_path


class SampleError(RuntimeError):
  """Sampling that cannot start; the message names the flag or file to fix."""


def check_settings(max_new_tokens: int, temperature: float, top_p: float) -> None:
  """Raises SampleError naming the first setting out of range (checked before a load)."""
  if max_new_tokens < 1:
    raise SampleError(f"--max_new_tokens={max_new_tokens} must be at least 1")
  if not 0 <= temperature < math.inf:  # Also refuses NaN.
    raise SampleError(f"--temperature={temperature} must be a finite number >= 0 (0: greedy)")
  if not 0 < top_p <= 1:
    raise SampleError(f"--top_p={top_p} must be in (0, 1]")


def run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run last started with, from its `config.json`."""
  path = config_path(workdir)
  if not os.path.isfile(path):
    raise SampleError(f"--workdir={workdir} holds no run (no config.json)")
  try:
    with open(path, encoding="utf-8") as f:
      stored = json.load(f)
  except (OSError, json.JSONDecodeError) as error:
    raise SampleError(f"cannot read {path} ({error})") from None
  if not isinstance(stored, dict) or "mesh" not in stored or "model" not in stored:
    raise SampleError(f"{path} is not the config.json of a run of `python -m trainer`")
  stored = config_of(stored)
  # Fields added since the run started take their defaults (e.g. mesh.ulysses).
  from configs import base  # pylint: disable=g-import-not-at-top
  config = base.get_config()
  config.update(stored)
  # JSON has no tuples; the rules table is pairs of (logical name, mesh axes).
  config.mesh.rules = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                            for name, axes in config.mesh.rules)
  span_plan.for_tools(config, workdir)  # The plan the run trained with, not its path's file.
  return config


def hf_config(directory: str) -> ml_collections.ConfigDict:
  """The config to sample a Hugging Face LLaMA directory with: `configs/base.py` (dense
  attention, every device on fsdp) starting from it, its trained length as `data.seq_len`.
  Call `hf_import.apply_to_config` after any overrides (it sets the model's shape)."""
  from configs import base  # pylint: disable=g-import-not-at-top
  config = base.get_config()
  config.init.from_hf = directory
  try:
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
      trained = json.load(f).get("max_position_embeddings")
  except (OSError, json.JSONDecodeError) as error:
    raise SampleError(f"--from_hf={directory}: cannot read config.json ({error})") from None
  if trained:
    config.data.seq_len = int(trained)
  return config


_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")  # absl's, with - or --.


def _argv_value(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f"{name}="):
      return arg.partition("=")[2]
    if arg == name and i + 1 < len(argv):
      return argv[i + 1]
  return None


def parse_run_flags(argv: list[str], define_flags: Callable[[], None], allow_hf: bool = False):
  """Parses a command line over a run: --workdir (read first, for the run's config; or, with
  `allow_hf`, --from_hf for a Hugging Face directory's), --step, `--config.*` overrides of
  that config, and what `define_flags` defines. Flags are defined here, not at import,
  because the config flag's fields are the run's own. Returns absl's FLAGS; a bad flag or
  run exits with one line."""
  from absl import app, flags, logging  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from trainer.track import console
  from trainer.config import stages  # pylint: disable=g-import-not-at-top

  workdir, hf_dir = _argv_value(argv, "--workdir"), _argv_value(argv, "--from_hf")
  # Help lists the flags, so it needs none of them: its config fields are base.py's.
  wants_help = any(arg.split("=")[0].lstrip("-") in _HELP_FLAGS for arg in argv[1:]
                   if arg.startswith("-"))
  if workdir and hf_dir and allow_hf:
    sys.exit("error: pass --workdir or --from_hf, not both")
  if bool(workdir) == bool(hf_dir and allow_hf) and not wants_help:
    sys.exit("error: pass --workdir=RUN (a run directory of `python -m trainer`)"
             + (" or --from_hf=DIR (a Hugging Face LLaMA directory)" if allow_hf else ""))
  try:
    if wants_help:
      from configs import base  # pylint: disable=g-import-not-at-top
      config = base.get_config()
    else:
      config = run_config(workdir) if workdir else hf_config(hf_dir)
  except SampleError as error:
    sys.exit(f"error: {error}")
  app.define_help_flags()  # What `app.run` defines, since these tools parse flags themselves.
  flags.DEFINE_string("workdir", None, "Run directory (holds config.json and checkpoints/).")
  flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.")
  if allow_hf:
    flags.DEFINE_string("from_hf", None, "Sample a Hugging Face LLaMA directory instead "
                        "(configs/base.py: dense attention, devices on fsdp; override with "
                        "--config.*).")
  config_flags.DEFINE_config_dict("config", config, "The run's config; override fields with "
                                  "--config.FIELD=VALUE as in training.")
  define_flags()
  try:
    flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError) as error:
    sys.exit(f"error: {cli.flag_error(error)}")
  except IndexError:
    cli.exit_on_index_error(argv)
  problem, notes = stages.replaced_overrides(
      flags.FLAGS.config, config_flags.get_override_values(flags.FLAGS["config"]))
  if problem:
    sys.exit(f"error: {problem}")
  for note in notes:
    print(note, file=sys.stderr, flush=True)
  # Errors only: a read-only checkpoint manager warns about its own read-only options.
  logging.set_verbosity(logging.ERROR)
  console.fold_orbax_logs(logging.get_absl_logger())
  console.install_reader_hooks()  # A failed checkpoint read's echoes, folded.
  return flags.FLAGS


def use_cpu_devices(config: ml_collections.ConfigDict) -> None:
  """The config's simulated CPU device count, set before JAX starts its backends: a tool
  calls it once its own light checks pass, as `python -m trainer` does."""
  if config.cpu_devices:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_num_cpu_devices", config.cpu_devices)
