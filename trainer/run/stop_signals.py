"""SIGTERM and SIGINT during a run: a clean stop, never a lost or half-written step."""

from __future__ import annotations

import signal
import sys

import jax


class StoppedBeforeTraining(BaseException):
  """SIGTERM or SIGINT arrived before the first step: nothing to save, nothing lost.

  A BaseException, like KeyboardInterrupt: raised from a signal handler at any line, it must
  pass through `except Exception` (a restore in progress must not read it as damage)."""


class StopSignals:
  """Turns SIGTERM/SIGINT into a clean stop: before the loop, `StoppedBeforeTraining` at once
  (nothing is trained yet, so nothing needs saving); in the loop, a request to save and stop
  after the current step. `enter_loop` hands over from the one to the other.

  Single process only. With several processes each would see a signal at its own step and
  save alone, so SIGTERM is left to JAX's preemption service (installed by
  `jax.distributed.initialize`; a Python handler would replace it), which agrees on one
  step for all processes: `Checkpointer.reached_preemption`.
  """

  def __init__(self):
    self.received: str | None = None
    self._in_loop = False
    self._previous = {}
    self._unraisablehook = None

  def __enter__(self):
    if jax.process_count() == 1:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
      self._unraisablehook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    return self

  def enter_loop(self) -> None:
    """From here on a signal asks for a save and a stop after the current step. Raises
    `StoppedBeforeTraining` if one came before and its exception was lost on the way: a
    handler runs wherever the main thread is, a garbage-collector callback included, where
    Python prints what is raised and carries on."""
    if self._in_loop:
      return  # A later stage's loop: the hand-over was made once.
    self._in_loop = True
    # A signal between the line above and this check finds the flag set and raises nothing:
    # checking after setting leaves no moment where a signal is neither raised nor seen.
    if self.received:
      raise self._stopped()

  def _stopped(self) -> StoppedBeforeTraining:
    return StoppedBeforeTraining(f"stopped by {self.received} before the first step; nothing "
                                 f"was trained, so nothing was saved or lost")

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    if not self._in_loop:
      raise self._stopped()

  def _unraisable(self, unraisable) -> None:
    """Python's report of an exception it could not raise, less ours: `enter_loop` raises it
    again where it can stop the run."""
    if not isinstance(unraisable.exc_value, StoppedBeforeTraining):
      self._unraisablehook(unraisable)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    if self._unraisablehook is not None:
      sys.unraisablehook = self._unraisablehook
