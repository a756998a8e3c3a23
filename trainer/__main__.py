"""Entry point: `python -m trainer --config configs/tiny_cpu.py [--config.train.steps=20]`."""

import os
import sys

from absl import app, flags, logging
import jax
from ml_collections import config_flags

import data
from trainer.config_check import ConfigError, check_config
from trainer.loop import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")


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
  if config.cpu_devices:
    jax.config.update("jax_num_cpu_devices", config.cpu_devices)
  try:
    check_config(config, jax.device_count())
    name = os.path.splitext(os.path.basename(config_flags.get_config_filename(
        flags.FLAGS["config"])))[0]
    train(config, _WORKDIR.value or os.path.join("runs", name))
  except (ConfigError, data.DataError) as error:
    sys.exit(f"error: {error}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=_parse_flags)
