"""A run's span plan travels with the run, as its tokenizer's hash does.

The config holds the plan's path (`model.head_spans`), not the plan: the file could be
edited or deleted between a run and its resumption, its sampling or its export. So a run
reads the file's bytes once at its start, records their SHA-256 in every checkpoint
(`head_spans_sha256`, "" without a plan), and keeps the bytes in its workdir as
`head_spans.json`, which is what it then builds from. A resumed run whose plan has other
bytes stops in one line naming `model.head_spans`; one whose named plan is gone reads the
workdir's copy instead. Sampling, export and the needle eval read the copy, never the path.
"""

from __future__ import annotations

import hashlib
import os

import ml_collections

from trainer.config import workdir as workdir_files

COPY = "head_spans.json"  # The run's copy, in its workdir.


def run_copy(workdir: str) -> str:
  return os.path.join(workdir, COPY)


def read(config: ml_collections.ConfigDict) -> bytes:
  """The bytes of the config's plan (b"" without one), read once: what is hashed is what is
  copied. (The config check read the file too; it may have gone since.)"""
  if not config.model.head_spans:
    return b""
  try:
    return _bytes_of(config.model.head_spans)
  except OSError as error:
    # Here, not at the top: the tools' flag parsing imports this module, and no JAX.
    from trainer.config.config_check import ConfigError  # pylint: disable=g-import-not-at-top
    raise ConfigError(f"model.head_spans={config.model.head_spans!r}: cannot read the plan "
                      f"({workdir_files.os_reason(error)})") from None


def sha256(plan: bytes) -> str:
  """What a checkpoint records of the plan: "" without one."""
  return hashlib.sha256(plan).hexdigest() if plan else ""


def prefer_copy(config: ml_collections.ConfigDict, workdir: str) -> str | None:
  """Points `model.head_spans` at the workdir's copy when the file it names is gone, before
  the config check reads it (a resume must not need the original); the note to say, or None.
  A copy of other bytes than the checkpoint's is refused on restore, as any other plan."""
  named, copy = config.model.head_spans, run_copy(workdir)
  if not named or os.path.isfile(named) or not os.path.isfile(copy):
    return None
  config.model.head_spans = copy
  return f"note: model.head_spans={named!r} is not there; reading the run's copy, {copy}"


def keep(plan: bytes, configs: list[ml_collections.ConfigDict], workdir: str) -> None:
  """Writes the plan into the workdir (once its checkpoint accepted it) and points `configs`
  (the run's and its stages') at that copy, so that what the run builds later (a stage, the
  needle eval) reads the bytes it checked, however the named file changes meanwhile."""
  if not plan:
    return
  copy = run_copy(workdir)
  if not os.path.isfile(copy) or _bytes_of(copy) != plan:
    workdir_files.write_atomically(copy, plan)
  for config in configs:
    config.model.head_spans = copy


def for_tools(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Points a run's stored config at the workdir's copy of its plan (sampling, export, the
  needle eval): the plan the run trained with, whatever became of the file it named. Runs
  from before plans were copied have none: their path is read as before."""
  if config.model.head_spans and os.path.isfile(run_copy(workdir)):
    config.model.head_spans = run_copy(workdir)


def resume_problem(config: ml_collections.ConfigDict, plan_sha256: str,
                   recorded: str | None, stored_path: str | None, workdir: str,
                   where: str) -> str | None:
  """Why the run's plan (of `plan_sha256`) is not the one `where` recorded; None if it is.
  A checkpoint from before plans were hashed (`recorded` None) knows only their path."""
  named, copy = config.model.head_spans, run_copy(workdir)
  if recorded is None:
    if stored_path is None or stored_path == named:
      return None
    trained, fix = repr(stored_path), f"model.head_spans={stored_path!r}"
  elif recorded == plan_sha256:
    return None
  elif recorded:
    trained, fix = f"another plan (other bytes), kept in {copy}", f"model.head_spans={copy}"
  else:
    trained, fix = "no span plan", "model.head_spans=''"
  return (f"cannot resume with model.head_spans={named!r}: {where} was trained with "
          f"{trained}; resume with {fix}, or use a new --workdir")


def _bytes_of(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()
