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

import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Callable, Iterator

CLOSED_LOOP = "Event loop is closed"


class ClosedLoopEchoes:
  """Swallows 'Event loop is closed' errors after printing one line; passes others on. With
  `orbax_unraisable` (the tools that only read, which stop at the first failed read), also
  the unraisable errors of Orbax's abandoned reads."""

  def __init__(self, stream=None, orbax_unraisable: bool = False):
    self.count = 0
    self._stream, self._orbax_unraisable = stream, orbax_unraisable
    self._excepthook, self._unraisablehook = sys.excepthook, sys.unraisablehook

  def _is_echo(self, value: BaseException | None, unraisable: bool = False) -> bool:
    closed_loop = isinstance(value, RuntimeError) and str(value) == CLOSED_LOOP
    # An Orbax read that nobody awaits any more (a sibling failed first) can only echo the
    # failure the caller was given: nothing can catch an unraisable error.
    abandoned_read = (unraisable and self._orbax_unraisable and value is not None
                      and _through_orbax(traceback.extract_tb(value.__traceback__)))
    if not (closed_loop or abandoned_read):
      return False
    self.count += 1
    if self.count == 1:
      _write_line(self._stream or sys.stderr,
                  f"(Orbax I/O still in flight after a failed checkpoint read or write was "
                  f"dropped; its '{CLOSED_LOOP}' and other echoes are not shown)")
    return True

  def excepthook(self, kind, value, tb) -> None:
    if not self._is_echo(value):
      self._excepthook(kind, value, tb)

  def unraisablehook(self, unraisable) -> None:
    if not self._is_echo(unraisable.exc_value, unraisable=True):
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
  if _ORBAX in record.pathname:
    return True
  return _through_orbax(traceback.extract_tb(record.exc_info[2]) if record.exc_info[2] else [])


_ORBAX = f"{os.sep}orbax{os.sep}"


def _through_orbax(frames) -> bool:
  return any(_ORBAX in frame.filename for frame in frames)


def fold_orbax_logs(absl_logger: logging.Logger) -> None:
  """One `OrbaxTracebackOnce` on absl's logger and on asyncio's, which Orbax's writes log to."""
  once = OrbaxTracebackOnce()
  absl_logger.addFilter(once)
  logging.getLogger("asyncio").addFilter(once)


def _write_line(stream, line: str) -> None:
  """One write per line (`print` makes two, text then newline): the echo notice comes from
  whichever thread collects an abandoned read, and must not land inside another line."""
  stream.write(line + "\n")
  stream.flush()


def exit_with_error(message: str) -> None:
  """Exits 1 after writing `error: message` as one line (see `_write_line`)."""
  _write_line(sys.stderr, f"error: {message}")
  sys.exit(1)


def exit_interrupted() -> None:
  """Exits 130 (a shell's code for Ctrl-C) after one line: the tools that only read stop
  on Ctrl-C with nothing to save, and a KeyboardInterrupt traceback says nothing more.

  At once, without the interpreter's teardown (their own cleanup ran as the interrupt
  unwound): a Ctrl-C that lands inside Orbax's read leaves a half-made asyncio loop and
  coroutines never awaited, whose collection at exit printed a traceback ('Exception
  ignored in BaseEventLoop.__del__ ... no attribute _signal_handlers') and warnings."""
  _write_line(sys.stderr, "stopped by Ctrl-C")
  sys.stdout.flush()  # What was sampled or printed before the interrupt.
  os._exit(130)  # pylint: disable=protected-access


def exit_at_ctrl_c() -> None:
  """For the tools that read a checkpoint: Ctrl-C calls `exit_interrupted` wherever it lands
  (but in `ctrl_c_unwinds` blocks). As a KeyboardInterrupt it could land in a callback that
  Python's garbage collector runs (JAX's), which Python prints as ignored and the tool went
  on to exit 0, or in Orbax's read, which then failed as if the checkpoint were damaged.
  Where SIGINT is ignored (a background job), it stays so."""
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: exit_interrupted())


@contextlib.contextmanager
def signals_handled_by(handlers: dict[int, Callable]) -> Iterator[None]:
  """Within: each signal of `handlers` runs its handler (one that raises, so that the block's
  cleanup runs as it stops); the handlers before are put back after. Main thread only
  (Python runs signal handlers there; elsewhere the block runs as it is)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
  try:
    yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def ctrl_c_unwinds() -> contextlib.AbstractContextManager:
  """Within: Ctrl-C raises KeyboardInterrupt, as Python's default does, for work that must
  clean up as it stops (a partial export removed, a W&B run closed). Where SIGINT is ignored
  (a background job), it stays so."""
  if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    return contextlib.nullcontext()
  return signals_handled_by({signal.SIGINT: signal.default_int_handler})


def install_reader_hooks() -> None:
  """`install_hooks` for the tools that only read a checkpoint (export, sample, the needle
  eval), which report a failed read in one line and stop: asyncio's 'Task exception was
  never retrieved' records of the reads abandoned with it are echoes too (hundreds of lines
  of TensorStore spec each), and these tools run no asyncio code of their own."""
  install_hooks(ClosedLoopEchoes(orbax_unraisable=True))
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def install_hooks(echoes: ClosedLoopEchoes | None = None) -> None:
  """For the command line only (tests keep Python's and pytest's own reporting). Absl's
  logger gets `OrbaxTracebackOnce` once absl has made it."""
  echoes = echoes or ClosedLoopEchoes()
  sys.excepthook, sys.unraisablehook = echoes.excepthook, echoes.unraisablehook
