"""The command line's config: `--config FILE[:ARG]` and `--config.FIELD=VALUE` overrides, their
errors said in one line naming the flag or field (absl and ml_collections raise tracebacks
or usage dumps). Shared by the train command and the tools that read a run."""

from __future__ import annotations

import os
import sys

from absl import flags

import parallelism


def config_file(argv: list[str]) -> str:
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


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parse of the train command's flags (`app.run`'s flags_parser); a bad flag or
  field is one line naming it, instead of absl's usage dump."""
  # Checked before parsing: ml_collections defers a missing file's error to its first use.
  path = config_file(argv)
  if path and not os.path.isfile(path):
    sys.exit(f"error: config file {path} does not exist (--config){_moved(path)}")
  try:
    remaining = flags.FLAGS(argv)
  except flags.Error as error:
    sys.exit(f"error: {flag_error(error)}")
  except SyntaxError as error:  # Raised while the config file is imported.
    sys.exit(f"error: syntax error in config file {error.filename}, line {error.lineno}: "
             f"{error.msg}")
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
  stages exits in one line naming the flag; one from a config file's own code (no override
  indexes) goes on, its traceback naming the line."""
  indexed = [arg.split("=")[0] for arg in argv if arg.startswith("--config.") and "[" in arg]
  if not indexed:
    raise  # pylint: disable=misplaced-bare-raise  # The IndexError being handled.
  sys.exit(f"error: {' or '.join(indexed)}: an index past the end of its list (a stage, say, "
           f"that the config does not have; they count from 0)")
