"""The run directory: one run at a time, and files that are whole or absent.

`claim(workdir)` creates the directory and takes an exclusive `flock` on `<workdir>/.lock`
for the life of the process. The OS drops the lock when the process dies, `kill -9`
included, so a stale lock cannot exist; a second run on the same workdir stops with one line
naming the holder. (`flock` is per host on most network filesystems: two hosts sharing a
workdir over NFS are not excluded.)

`write_atomically` writes a file beside its destination and renames it over, so a crash or a
full disk leaves the old file or the new one, never a truncated one.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket


class WorkdirError(RuntimeError):
  """The workdir cannot be used; the message says why and what to do."""


_LOCK_FILE = ".lock"
_held: dict[str, int] = {}  # Absolute workdir -> the descriptor holding its lock.


def os_reason(error: OSError) -> str:
  """'No space left on device' and the like, without the errno number and path."""
  return error.strerror or type(error).__name__


def _mkdir(workdir: str) -> None:
  try:
    os.makedirs(workdir, exist_ok=True)
  except FileExistsError as error:  # A file sits where the directory would go.
    raise WorkdirError(f"--workdir {workdir} is not a directory (a file of that name "
                       f"exists); pass another --workdir") from error
  except NotADirectoryError as error:
    raise WorkdirError(f"--workdir {workdir}: a parent of it is a file; pass another "
                       f"--workdir") from error
  except OSError as error:
    raise WorkdirError(f"cannot create --workdir {workdir}: {os_reason(error)}") from error
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise WorkdirError(f"cannot write to --workdir {workdir} (permission denied); pass a "
                       f"writable --workdir")


def claim(workdir: str) -> None:
  """Creates `workdir` and holds its lock until the process exits (idempotent per process)."""
  workdir = os.path.abspath(workdir)
  if workdir in _held:
    return
  _mkdir(workdir)
  path = os.path.join(workdir, _LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as error:
    raise WorkdirError(f"cannot create {path}: {os_reason(error)}") from error
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as error:
    holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
    os.close(fd)
    if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
      raise WorkdirError(f"--workdir {workdir} is in use by {holder}; wait for that run to "
                         f"end or pass another --workdir") from error
    raise WorkdirError(f"cannot lock {path}: {os_reason(error)}") from error
  started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  holder = f"PID {os.getpid()} on host {socket.gethostname()} (started {started})\n"
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
  except OSError as error:
    os.close(fd)
    raise WorkdirError(f"cannot write to --workdir {workdir}: {os_reason(error)}") from error
  _held[workdir] = fd


def release(workdir: str) -> None:
  """Drops this process's lock on `workdir` (tests train several runs in one process)."""
  fd = _held.pop(os.path.abspath(workdir), None)
  if fd is not None:
    os.close(fd)


def write_atomically(path: str, text: str | bytes) -> None:
  """Writes `text` (or bytes, as they are) to `path` whole or not at all (temporary file,
  fsync, rename)."""
  temporary = f"{path}.tmp-{os.getpid()}"
  binary = isinstance(text, bytes)
  try:
    with open(temporary, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except OSError as error:
    try:
      os.remove(temporary)
    except OSError:
      pass
    raise WorkdirError(f"cannot write {path}: {os_reason(error)}") from error
