"""Two JAX processes, each alone on a core of its own: 2 ring devices that run side by side.

Simulated devices in one process (`--xla_force_host_platform_device_count`) take turns on
the process's cores, so a step's time is the sum of every device's work. Here two processes
join by `jax.distributed` on loopback, each pinned (`taskset`) to one core with
single-threaded XLA, so each holds one CPU device and a ring step waits for the slower one,
as on a node. Used by `scripts/compare_demo.py` (the trainer) and `scripts/bench_sparse.py`
(part `ring2`, the attention alone).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Callable

# One thread per process: XLA:CPU otherwise spreads a process's work over every core.
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def cores() -> list[int]:
  """The first 2 cores this process may use; exits in words when there are fewer, or no
  `taskset` to pin to them."""
  allowed = sorted(os.sched_getaffinity(0))[:2]
  if len(allowed) < 2 or not shutil.which("taskset"):
    sys.exit("error: this needs 2 cores and `taskset` (util-linux) to pin one process to each")
  return allowed


def run(argv_of: Callable[[int, str], list[str]], pinned: list[int], what: str,
        cwd: str | None = None) -> None:
  """Runs `argv_of(process_id, coordinator_address)` once per core in `pinned`, each pinned to
  its core; only process 0's output is shown. When one fails the others are stopped (they
  would otherwise wait at their next collective until JAX's heartbeat gives up) and the
  script exits naming `what`."""
  address = f"127.0.0.1:{free_port()}"
  env = {**os.environ, **ENV}
  processes = [subprocess.Popen(
      ["taskset", "-c", str(core), *argv_of(index, address)], cwd=cwd, env=env,
      stdout=None if index == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT)
      for index, core in enumerate(pinned)]
  while any(p.poll() is None for p in processes):
    if any(p.returncode for p in processes):
      for p in processes:
        if p.poll() is None:
          p.terminate()
    time.sleep(0.2)
  codes = [p.returncode for p in processes]
  if any(codes):
    sys.exit(f"error: {what} failed (exit codes {codes}); process 0's output is above")
