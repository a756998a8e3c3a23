"""Where metrics go: `<workdir>/metrics.jsonl`, the console and Weights & Biases.

Every tracker has `log(record)` and `close()`; the run builds them (`run.setup.make_trackers`,
with `wandb_tracker`, which imports this module) on process 0 only, so other processes
write nothing. The JSONL file is appended and flushed per
line, never rewritten, so a crash loses at most the line being written and a resumed run
continues the same file. Secrets never reach a tracker: `scrub` redacts config fields named
like one and any string holding the value of a secret environment variable.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
from typing import Any, Protocol

import jax

# Environment variables whose names contain these hold secrets; their values are redacted
# wherever they appear. Config fields are matched by whole words instead, so that
# `data.tokenizer` or `max_document_tokens` stay visible.
SECRET_ENV_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
SECRET_FIELD_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"})
REDACTED = "<redacted>"


class TrackingError(RuntimeError):
  """A metrics file cannot be written; the message names it and why."""


class Tracker(Protocol):
  def log(self, record: dict[str, Any]) -> None: ...

  def close(self) -> None: ...


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
  """Values of the environment variables named like secrets (long enough to be one)."""
  environ = os.environ if environ is None else environ
  return sorted({value for name, value in environ.items()
                 if SECRET_ENV_NAME.search(name) and len(value) >= 8}, key=len, reverse=True)


def is_secret_field(name: Any) -> bool:
  return bool(SECRET_FIELD_WORDS.intersection(re.split(r"[^a-z0-9]+", str(name).lower())))


def scrub(value: Any, secrets: list[str] | None = None) -> Any:
  """A copy of `value` (nested dicts/lists) with secret-named keys and secret values redacted."""
  secrets = secret_values() if secrets is None else secrets
  if isinstance(value, dict):
    return {key: REDACTED if is_secret_field(key) and isinstance(item, str) and item
            else scrub(item, secrets) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return type(value)(scrub(item, secrets) for item in value)
  if isinstance(value, str):
    for secret in secrets:
      value = value.replace(secret, REDACTED)
  return value


def device_memory_bytes() -> int | None:
  """Bytes in use on this process's first device, where the backend reports it (not on CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None


class NoopTracker:
  def log(self, record: dict[str, Any]) -> None:
    del record

  def close(self) -> None:
    pass


def json_safe(value: Any) -> Any:
  """`value` with NaN and +-Inf floats as None, so the JSONL file stays strict JSON."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {key: json_safe(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(item) for item in value]
  return value


class JsonlTracker:
  """Appends one strict-JSON line per record (a non-finite number is written as null).

  Each line goes out in one `write` on an O_APPEND descriptor. A write that fails (a full
  disk) is cut back off, so the file holds whole lines only; a line torn by a crash is
  repaired when the file is opened again.
  """

  def __init__(self, path: str):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    self._path = path
    self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    self._secrets = secret_values()
    self._repair_torn_line()

  def _repair_torn_line(self) -> None:
    """A crash mid-write can leave a last line without its newline: end it if it is a whole
    record, else cut it off; either way say so."""
    size = os.fstat(self._fd).st_size
    if not size:
      return
    with open(self._path, "rb") as f:
      f.seek(max(0, size - (1 << 20)))
      tail = f.read()
    if tail.endswith(b"\n"):
      return
    last = tail.rsplit(b"\n", 1)[-1]
    try:
      json.loads(last)
    except ValueError:
      os.truncate(self._path, size - len(last))
      print(f"warning: {self._path} ended in a line torn by a crash ({len(last)} bytes); "
            f"removed it", flush=True)
      return
    os.write(self._fd, b"\n")
    print(f"warning: {self._path} ended without a newline (a crash mid-write); ended its "
          f"last line", flush=True)

  def log(self, record: dict[str, Any]) -> None:
    line = json.dumps(json_safe(scrub(record, self._secrets)), allow_nan=False) + "\n"
    size = os.fstat(self._fd).st_size
    try:
      written = os.write(self._fd, line.encode())
      if written != len(line.encode()):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (short write)")
    except OSError as error:
      os.ftruncate(self._fd, size)  # Whole lines only.
      raise TrackingError(f"cannot append to {self._path}: {error.strerror or error}; the "
                          f"file keeps every earlier line") from error

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def last_logged_step(path: str) -> int | None:
  """The step of the last whole record in a metrics file (its last MiB), or None."""
  try:
    with open(path, "rb") as f:
      f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 20)))
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in reversed(lines):
    try:
      return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      continue
  return None


class ConsoleTracker:
  """Progress: a tqdm bar on a terminal, else one plain line per logged step.

  Both show step, loss, tokens/sec and an ETA from the latest step time (the first interval
  of a process includes compilation, so it shows "warm-up" and no ETA instead).
  """

  def __init__(self, total_steps: int, stream=None, bar: bool | None = None):
    self._total = total_steps
    self._stream = stream or sys.stdout
    self._bar = None
    if bar is None:
      bar = hasattr(self._stream, "isatty") and self._stream.isatty()
    if bar:
      try:
        import tqdm  # pylint: disable=g-import-not-at-top  # Only on a terminal.
      except ImportError:
        return
      self._bar = tqdm.tqdm(total=total_steps, file=self._stream, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| step {n_fmt}/{total_fmt}{postfix}")

  def log(self, record: dict[str, Any]) -> None:
    if "loss" not in record:
      parts = [f"{key} {value:.4f}" for key, value in record.items()
               if key.startswith("eval_") and isinstance(value, float)]
      self._write(f"eval at step {record['step']}: " + "  ".join(parts))
      return
    # A warm-up interval's time is mostly compilation: an ETA from it would be far too long.
    eta = "?" if record.get("warmup") else _eta(record.get("step_time_s"),
                                                 self._total - record["step"])
    speed = "warm-up" if record.get("warmup") else f"{record['tokens_per_sec']:,.0f} tok/s"
    if self._bar is not None:
      self._bar.set_postfix_str(f"loss {record['loss']:.4f}  {speed}  ETA {eta}", refresh=False)
      self._bar.update(record["step"] - self._bar.n)
      if record["step"] >= self._total:
        self.close()  # Leave the line finished before the loop prints its summary.
      return
    self._write(f"step {record['step']:>6}/{self._total}  loss {record['loss']:.4f}  "
                f"grad_norm {record['grad_norm']:.3f}  {speed}  ETA {eta}")

  def _write(self, line: str) -> None:
    if self._bar is not None:
      self._bar.write(line, file=self._stream)
    else:
      print(line, file=self._stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def _eta(step_time: float | None, steps_left: int) -> str:
  if not step_time or math.isnan(step_time):
    return "?"
  seconds = int(step_time * steps_left)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
