"""Where metrics go: `<workdir>/metrics.jsonl` and the console. Only process 0 writes.

The JSONL file is appended and flushed per line, never rewritten, so a crash loses at most
the line being written and a resumed run continues the same file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any


class JsonlTracker:
  def __init__(self, path: str):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    self._file = open(path, "a", encoding="utf-8")

  def log(self, record: dict[str, Any]) -> None:
    self._file.write(json.dumps(record, allow_nan=True) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class ConsoleTracker:
  """One plain progress line per logged step: step, loss, tokens/sec and ETA."""

  def __init__(self, total_steps: int, stream=sys.stdout):
    self._total = total_steps
    self._stream = stream
    self._start = time.monotonic()

  def log(self, record: dict[str, Any]) -> None:
    if "loss" in record:
      eta = _eta(record.get("step_time_s"), self._total - record["step"])
      tps = record.get("tokens_per_sec")
      tps_text = "warm-up" if record.get("warmup") else f"{tps:,.0f} tok/s"
      line = (f"step {record['step']:>6}/{self._total}  loss {record['loss']:.4f}  "
              f"grad_norm {record['grad_norm']:.3f}  {tps_text}  ETA {eta}")
    else:
      parts = [f"{key} {value:.4f}" for key, value in record.items()
               if key.startswith("eval_") and isinstance(value, float)]
      line = f"eval at step {record['step']}: " + "  ".join(parts)
    print(line, file=self._stream, flush=True)

  def close(self) -> None:
    pass


def _eta(step_time: float | None, steps_left: int) -> str:
  if not step_time or math.isnan(step_time):
    return "?"
  seconds = int(step_time * steps_left)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
