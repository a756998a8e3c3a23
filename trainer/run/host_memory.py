"""Host memory: what is free, what a piece of work peaked at, and whether a CPU run's state
can fit at all.

The OS kills a process that runs the host out of memory with SIGKILL: no traceback, no
message, often no line at all. So work that may do so is checked first: a run on CPU devices
(which live in host memory) whose parameters and optimizer state alone exceed what is free,
and `--find_max_seq_len`'s next, longer compile (`PeakMeter`). Linux only (`/proc`); elsewhere
the figures are None and nothing is checked.
"""

from __future__ import annotations

import jax

from trainer.core.state import shard_bytes

GB = 1e9


def _proc_kib(path: str, field: str) -> int | None:
  try:
    with open(path, encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except (OSError, ValueError, IndexError):
    pass
  return None


def available_bytes() -> int | None:
  """What the host can still give without swapping (`MemAvailable`); None if unknown."""
  kib = _proc_kib("/proc/meminfo", "MemAvailable")
  return None if kib is None else kib * 1024


def resident_bytes() -> int | None:
  """This process's resident memory now; None if unknown."""
  kib = _proc_kib("/proc/self/status", "VmRSS")
  return None if kib is None else kib * 1024


class PeakMeter:
  """`with PeakMeter() as meter:` ... then `meter.peak`: the most resident memory this process
  held during the block, in bytes (None where it cannot be measured)."""

  def __enter__(self) -> "PeakMeter":
    self.peak = None
    try:  # "5" resets the peak (VmHWM) to the current resident size (Linux >= 4.0).
      with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
      self._measured = True
    except OSError:
      self._measured = False
    return self

  def __exit__(self, *exc) -> None:
    peak = _proc_kib("/proc/self/status", "VmHWM") if self._measured else None
    self.peak = None if peak is None else peak * 1024


def bytes_on_this_host(abstract_state) -> int:
  """Bytes a tree of sharded ShapeDtypeStructs takes on this process's devices, every copy
  counted: a replicated leaf is held once per device."""
  return sum(shard_bytes(leaf) * len(leaf.sharding.addressable_devices)
             for leaf in jax.tree.leaves(abstract_state))


def cpu_state_problem(abstract_state, available: int | None = None) -> str | None:
  """Why this process's CPU devices cannot hold their part of the training state, or None.
  The state is a lower bound of what training needs (gradients and activations come on
  top), so a refusal is never wrong; a pass promises nothing."""
  available = available_bytes() if available is None else available
  needed = bytes_on_this_host(abstract_state)
  if available is None or needed <= available:
    return None
  return (f"the parameters and optimizer state alone take {needed / GB:.1f} GB of host memory "
          f"(CPU devices live in it), and {available / GB:.1f} GB are free: this run cannot "
          f"train on this machine. Plan it for accelerators with --dry_run, or train a "
          f"smaller model")
