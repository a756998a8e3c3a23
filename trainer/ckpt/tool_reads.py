"""Reading a step of a workdir from tools beside a run (export, sampling, the needle eval).

A run training in the same workdir may remove a step while a tool reads it; that is no
damage (`read_step` takes the newest again, once).
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

from trainer.ckpt.checkpointing import Checkpointer, StepRemoved

T = TypeVar("T")


def open_step(workdir: str, step: int | None,
              error: type[Exception]) -> tuple[Checkpointer, int]:
  """A read-only checkpointer on `workdir` and the step to read from it (default the newest),
  for tools beside a run (export, sampling): a run training in the workdir is not disturbed.
  A workdir without checkpoints, without a committed step, or without `step` raises `error`
  (the tool's own) with one line naming the flag. The caller closes the checkpointer."""
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise error(f"--workdir={workdir} has no checkpoints/ directory")
  try:
    checkpointer = Checkpointer(workdir, 1, 1, use_async=False, read_only=True)
  except FileNotFoundError:  # Orbax lists the steps, then reads each: a run deleted one between.
    checkpointer = Checkpointer(workdir, 1, 1, use_async=False, read_only=True)
  steps = checkpointer.steps()
  chosen = steps[-1] if step is None and steps else step
  if not steps or chosen not in steps:
    checkpointer.close()
    raise error(f"--workdir={workdir} holds no committed checkpoint" if not steps else
                f"--step={step} is not a checkpoint of {workdir}; it holds steps "
                f"{', '.join(map(str, steps))}")
  return checkpointer, chosen


def read_step(workdir: str, step: int | None, read: Callable[[Checkpointer, int], T],
              error: type[Exception]) -> tuple[T, int]:
  """(read(checkpointer, chosen), chosen): `open_step`, then the tool's `read` of the step.

  A step that the run training in `workdir` removes while it is read is no damage: without
  `step` the newest is chosen again, once; a second removal, or a removed `--step`, raises
  `error` in one line saying so."""
  try:
    return _read_once(workdir, step, read, error)
  except StepRemoved as removed:
    if step is not None:
      raise error(f"{removed}; pick a newer --step (it keeps the newest checkpoint.keep)"
                  ) from removed
  try:
    return _read_once(workdir, None, read, error)  # The newest again, once.
  except StepRemoved as removed:
    raise error(f"{removed}, twice: it saves faster than this reads; try again, or read "
                f"after the run stops (SIGTERM saves)") from removed


def _read_once(workdir: str, step: int | None, read: Callable[[Checkpointer, int], T],
               error: type[Exception]) -> tuple[T, int]:
  checkpointer, chosen = open_step(workdir, step, error)
  try:
    return read(checkpointer, chosen), chosen
  finally:
    checkpointer.close()
