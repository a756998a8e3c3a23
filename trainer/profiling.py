"""`--profile_steps=A:B`: a `jax.profiler` trace of training steps A to B, under the workdir.

The trace starts before step A is dispatched and stops once step B's results are on the
host, so it holds whole steps: the host loop, the data, every compiled kernel and
collective. Step 1's compile lands in it if A is 1, so A >= 2 shows steady steps. Each
process writes its own trace (its own devices) to `<workdir>/profile/`; open
`perfetto_trace.json.gz` at https://ui.perfetto.dev, or `tensorboard --logdir
<workdir>/profile` with the profile plugin.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Callable

import jax


def parse_steps(text: str) -> tuple[int, int] | None:
  """(A, B) from 'A:B' ('' is None); a ValueError names what is wrong."""
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
    self._directory = os.path.join(workdir, "profile")
    self._tracing = False
    self._first = self._last = None  # Steps traced.

  def before(self, step: int) -> None:
    """Called before `step` is dispatched: starts at A, or at the first step a run resumed
    inside the window trains."""
    if self._steps and not self._tracing and self._steps[0] <= step <= self._steps[1]:
      jax.profiler.start_trace(self._directory, create_perfetto_trace=True)
      self._tracing = True
      self._first = step

  def after(self, step: int, outputs: Any) -> None:
    """Called after `step` is dispatched: stops at B, once its outputs are computed."""
    if not self._tracing:
      return
    self._last = step
    if step >= self._steps[1]:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    """Stops a trace still running (the run ended or stopped inside the window); says so
    if the run trained none of the chosen steps."""
    if self._steps and self._first is None:
      self._log(f"warning: --profile_steps={self._steps[0]}:{self._steps[1]}: the run "
                f"trained none of these steps; nothing was profiled")
      self._steps = None  # Said once.
    if not self._tracing:
      return
    jax.profiler.stop_trace()
    self._tracing = False
    traces = sorted(glob.glob(os.path.join(self._directory, "plugins", "profile", "*",
                                           "perfetto_trace.json.gz")), key=os.path.getmtime)
    where = traces[-1] if traces else self._directory
    self._log(f"profile of steps {self._first}-{self._last}: {where} (open at "
              f"https://ui.perfetto.dev, or tensorboard --logdir {self._directory})")
