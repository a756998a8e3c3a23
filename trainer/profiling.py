"""`--profile_steps=FIRST:LAST`: a `jax.profiler` trace of those training steps.

The trace starts before step FIRST reads its batch and stops once step LAST's results are
on the host, so it holds whole steps: the host loop, the data, every compiled kernel and
collective. The first step a process trains compiles (step 1, the first after a resume,
and each stage's first), so start the window after it to see steady steps. Each process
traces its own devices into `<workdir>/profile/process_<i>/`; open a
`perfetto_trace.json.gz` there at https://ui.perfetto.dev, or run `tensorboard --logdir
<workdir>/profile` with the profile plugin. Writing the trace out is left out of the
logged step times.
"""

from __future__ import annotations

import glob
import os
from typing import Callable

import jax


def parse_steps(text: str) -> tuple[int, int] | None:
  """(FIRST, LAST) from 'FIRST:LAST' or 'STEP' ('' is None); a ValueError says what is
  wrong."""
  if not text:
    return None
  first, sep, last = text.partition(":")
  try:
    steps = int(first), int(last if sep else first)
  except ValueError:
    raise ValueError(f"--profile_steps={text} must be FIRST:LAST, two step numbers such as "
                     f"5:7") from None
  if not 1 <= steps[0] <= steps[1]:
    raise ValueError(f"--profile_steps={text} must have 1 <= FIRST <= LAST")
  return steps


class StepProfiler:
  """Starts and stops the trace around the chosen steps as the loop reaches them."""

  def __init__(self, steps: tuple[int, int] | None, workdir: str,
               log: Callable[[str], None]):
    self._steps, self._log = steps, log
    self._directory = os.path.join(workdir, "profile", f"process_{jax.process_index()}")
    self._tracing = False
    self._first = self._last = None  # Steps traced.

  def starts_at(self, step: int) -> bool:
    """Whether the trace starts before `step` (FIRST, or the first step a run resumed inside
    the window trains): the loop reads the steps before, then calls `start`."""
    return bool(self._steps) and not self._tracing and self._steps[0] <= step <= self._steps[1]

  def start(self, step: int) -> None:
    try:
      jax.profiler.start_trace(self._directory, create_perfetto_trace=True)
    except Exception as error:  # pylint: disable=broad-except  # Training goes on.
      self._log(f"warning: the profile could not start ({type(error).__name__}: {error}); "
                f"training goes on without it")
      self._steps = None
      return
    self._tracing, self._first = True, step

  def before(self, step: int) -> None:
    """Called before `step` reads its batch: counts the steps traced."""
    if self._tracing:
      self._last = step

  def ends_at(self, step: int) -> bool:
    """Whether the trace stops after `step` (LAST): the loop reads its results, then
    closes."""
    return self._tracing and step >= self._steps[1]

  def close(self) -> None:
    """Stops a trace still running (at LAST, or a run that ended or stopped inside the
    window); says so if the run trained none of the chosen steps. Never raises: a trace that
    cannot be written is a warning, not a lost run."""
    try:
      self._close()
    except Exception as error:  # pylint: disable=broad-except
      self._log(f"warning: the profile could not be written ({type(error).__name__}: "
                f"{error})")

  def _close(self) -> None:
    steps, self._steps = self._steps, None  # Said, or stopped, once.
    if steps and self._first is None:
      self._log(f"warning: --profile_steps={steps[0]}:{steps[1]}: this run trained none of "
                f"these steps; nothing was profiled")
    if not self._tracing:
      return
    self._tracing = False
    jax.profiler.stop_trace()
    traces = sorted(glob.glob(os.path.join(self._directory, "plugins", "profile", "*",
                                           "perfetto_trace.json.gz")), key=os.path.getmtime)
    where = traces[-1] if traces else self._directory
    self._log(f"profile of steps {self._first}-{self._last}: {where} (open at "
              f"https://ui.perfetto.dev, or tensorboard --logdir "
              f"{os.path.dirname(self._directory)})")
