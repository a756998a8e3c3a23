"""The command line's config: `--config FILE[:ARG]` and `--config.FIELD=VALUE` overrides, their
errors said in one line naming the flag or field (absl and ml_collections raise tracebacks
or usage dumps). Shared by the train command and the tools that read a run."""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback

import ml_collections
from absl import flags


def config_argument(argv: list[str]) -> str:
  """The --config value ('' if none): `file.py`, or `file.py:arg` for get_config(arg)."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.partition("=")[2]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def config_file(argv: list[str]) -> str:
  """The file named by --config ('' if none)."""
  return config_argument(argv).partition(":")[0]


def config_file_problem(argument: str) -> str | None:
  """Why `file.py[:arg]` gives no config, in one line naming the file, the line and the
  exception; None if its get_config(arg) returns one.

  Run before absl parses the flags: ml_collections reports a get_config that raises as a
  flag error holding a traceback, lets an import error through whole, defers an OSError to
  the config's first use, and calls a missing get_config an unknown field. Configs are data,
  so loading one twice costs nothing."""
  path, _, arg = argument.partition(":")
  try:
    spec = importlib.util.spec_from_file_location("config_file_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
      return f"config file {path} defines no get_config(arg=None)"
    config = module.get_config(*([arg] if arg else []))
  except SyntaxError as error:
    return f"syntax error in config file {error.filename}, line {error.lineno}: {error.msg}"
  except Exception as error:  # noqa: BLE001  (a config file's code may raise anything)
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if os.path.abspath(frame.filename) == os.path.abspath(path)]
    where = f", line {lines[-1]}" if lines else ""
    reason = (str(error).strip().splitlines() or [""])[0]
    return f"config file {path}{where}: {type(error).__name__}" + (f": {reason}" if reason else "")
  if not isinstance(config, ml_collections.ConfigDict):
    return (f"config file {path}: get_config returned {type(config).__name__}, not an "
            f"ml_collections.ConfigDict" + (" (a missing return?)" if config is None else ""))
  return None


def _moved(path: str) -> str:
  """Where a config of one layout went: each model has one file, its layout the argument."""
  import parallelism  # pylint: disable=g-import-not-at-top  # JAX: only on this error's path.
  stem, _, layout = os.path.basename(path)[:-3].rpartition("_")
  model = os.path.join(os.path.dirname(path), f"{stem}_striped.py")
  if layout in parallelism.LAYOUTS and os.path.isfile(model):
    return f"; the layout is the model config's argument now: --config {model}:{layout}"
  return ""


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parse of the train command's flags (`app.run`'s flags_parser); a bad flag or
  field is one line naming it, instead of absl's usage dump."""
  # Checked before parsing: ml_collections defers a missing file's error to its first use.
  path = config_file(argv)
  if path and not os.path.isfile(path):
    sys.exit(f"error: config file {path} does not exist (--config){_moved(path)}")
  problem = config_file_problem(config_argument(argv)) if path else None
  if problem:
    sys.exit(f"error: {problem}")
  try:
    remaining = flags.FLAGS(argv)
  except flags.Error as error:
    sys.exit(f"error: {flag_error(error)}")
  except OSError as error:  # The config file failed to load and an override touched it.
    exit_config_unloadable(error)
  except IndexError:
    exit_on_index_error(argv)
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


def exit_config_unloadable(error: OSError) -> None:
  """ml_collections' error chain ends in the OS's reason ('[Errno 2] No such file...')."""
  while error.__cause__ is not None:
    error = error.__cause__
  sys.exit(f"error: cannot load --config: {str(error).strip().splitlines()[-1].strip()}")


def flag_error(error: Exception) -> str:
  """absl's message for a bad flag value, with a parser's tuple-shaped reason ("('Non-boolean
  argument to boolean flag', 'yes')") said in words."""
  message, reason = str(error), error.__context__
  if isinstance(reason, (TypeError, ValueError)) and len(reason.args) > 1:
    words = ("must be true or false" if "boolean" in str(reason.args[0])
             else ": ".join(map(str, reason.args)))
    message = message.replace(str(reason), words)
  return message


def exit_on_index_error(argv: list[str]) -> None:
  """Called while handling an IndexError from flag parsing: ml_collections' ("tuple index out
  of range") for an override such as `--config.stages[2].train.lr` of a config with two
  stages exits in one line naming the flag; any other goes on (a config file's own are
  said before, by `config_file_problem`)."""
  indexed = [arg.split("=")[0] for arg in argv if arg.startswith("--config.") and "[" in arg]
  if not indexed:
    raise  # pylint: disable=misplaced-bare-raise  # The IndexError being handled.
  sys.exit(f"error: {' or '.join(indexed)}: an index past the end of its list (a stage, say, "
           f"that the config does not have; they count from 0)")
