"""SIGTERM and SIGINT during a run: a clean stop, never a lost or half-written step."""

from __future__ import annotations

import signal

import jax


class StoppedBeforeTraining(BaseException):
  """SIGTERM or SIGINT arrived before the first step: nothing to save, nothing lost.

  A BaseException, like KeyboardInterrupt: raised from a signal handler at any line, it must
  pass through `except Exception` (a restore in progress must not read it as damage)."""


class StopSignals:
  """Turns SIGTERM/SIGINT into a clean stop: before the loop, `StoppedBeforeTraining` at once
  (nothing is trained yet, so nothing needs saving); in the loop, a request to save and stop
  after the current step.

  Single process only. With several processes each would see a signal at its own step and
  save alone, so SIGTERM is left to JAX's preemption service (installed by
  `jax.distributed.initialize`; a Python handler would replace it), which agrees on one
  step for all processes: `Checkpointer.reached_preemption`.
  """

  def __init__(self):
    self.received: str | None = None
    self.in_loop = False
    self._previous = {}

  def __enter__(self):
    if jax.process_count() == 1:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    if not self.in_loop:
      raise StoppedBeforeTraining(f"stopped by {self.received} before the first step; "
                                  f"nothing was trained, so nothing was saved or lost")

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
