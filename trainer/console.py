"""What the command line shows when Orbax fails: the failure once, not a hundred echoes.

When a checkpoint read or write fails, Orbax closes its event loop while TensorStore still
completes the other reads or writes; each completion's callback then raises 'Event loop is
closed', which Python prints as a traceback (through `sys.unraisablehook` for reads,
`sys.excepthook` for writes): 36 on a damaged OCDBT index, over a hundred on a full disk.
And several Orbax threads log the same failed save, each with a traceback. The trainer has
already reported the failure in one line; `install_hooks()` and `OrbaxTracebackOnce` fold
these echoes.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

CLOSED_LOOP = "Event loop is closed"


class ClosedLoopEchoes:
  """Swallows 'Event loop is closed' errors after printing one line; passes others on."""

  def __init__(self, stream=None):
    self.count = 0
    self._stream = stream
    self._excepthook, self._unraisablehook = sys.excepthook, sys.unraisablehook

  def _is_echo(self, value: BaseException | None) -> bool:
    if not (isinstance(value, RuntimeError) and str(value) == CLOSED_LOOP):
      return False
    self.count += 1
    if self.count == 1:
      print(f"(Orbax I/O still in flight after a failed checkpoint read or write was dropped; "
            f"its '{CLOSED_LOOP}' errors are not shown)", file=self._stream or sys.stderr)
    return True

  def excepthook(self, kind, value, traceback) -> None:
    if not self._is_echo(value):
      self._excepthook(kind, value, traceback)

  def unraisablehook(self, unraisable) -> None:
    if not self._is_echo(unraisable.exc_value):
      self._unraisablehook(unraisable)


class OrbaxTracebackOnce(logging.Filter):
  """The first Orbax log record with a traceback keeps it; later ones keep one line.

  Orbax's records come from its own modules, and also from asyncio: each of a failed save's
  gathered writes that nobody awaited any more is logged as '... exception was never
  retrieved' with its traceback (through Orbax's code), one per write, when the machine is
  busy enough that several fail before the save is abandoned."""

  def __init__(self):
    super().__init__()
    self.seen = False

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and _from_orbax(record):
      if self.seen:
        record.exc_info, record.exc_text = None, None
      self.seen = True
    return True


def _from_orbax(record: logging.LogRecord) -> bool:
  orbax = f"{os.sep}orbax{os.sep}"
  if orbax in record.pathname:
    return True
  frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info[2] else []
  return any(orbax in frame.filename for frame in frames)


def fold_orbax_logs(absl_logger: logging.Logger) -> None:
  """One `OrbaxTracebackOnce` on absl's logger and on asyncio's, which Orbax's writes log to."""
  once = OrbaxTracebackOnce()
  absl_logger.addFilter(once)
  logging.getLogger("asyncio").addFilter(once)


def install_hooks() -> None:
  """For the command line only (tests keep Python's and pytest's own reporting). Absl's
  logger gets `OrbaxTracebackOnce` once absl has made it."""
  echoes = ClosedLoopEchoes()
  sys.excepthook, sys.unraisablehook = echoes.excepthook, echoes.unraisablehook
