"""Multi-host start-up: JAX's own multi-controller runtime, nothing home-made.

`initialize` calls `jax.distributed.initialize` when the command line names a coordinator,
or when the environment shows a multi-process cluster (SLURM with several tasks, Open MPI,
a TPU pod slice); JAX then detects the coordinator, process count and id itself. A plain
single-process run is left alone. It must run before anything touches a JAX backend.
"""

from __future__ import annotations

import hashlib
import os

import jax
from jax.experimental import multihost_utils
import numpy as np

from trainer.config_check import ConfigError


def cluster_in_environment(environ: dict[str, str] | None = None) -> bool:
  """True when the launcher started several processes that must form one JAX runtime."""
  env = os.environ if environ is None else environ
  return (int(env.get("SLURM_NTASKS", "1") or 1) > 1
          or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
          or "," in env.get("TPU_WORKER_HOSTNAMES", ""))


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None) -> None:
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise ValueError("--coordinator_address needs --num_processes and --process_id")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif cluster_in_environment():
    jax.distributed.initialize()


def same_everywhere(value: str, what: str) -> None:
  """Raises ConfigError on every process unless all hold the same `value` (compared by
  hash). Checks that each process makes against its own copy (a checkpoint's corpus and
  tokenizer) must agree: a process that stopped alone would leave the others waiting at
  the next collective for ever."""
  if jax.process_count() == 1:
    return
  digest = np.frombuffer(hashlib.sha256(value.encode()).digest()[:8], np.int64)[0]
  digests = multihost_utils.process_allgather(digest)
  if (digests != digests[0]).any():
    raise ConfigError(f"the processes do not hold the same {what} (process "
                      f"{jax.process_index()} has {value}): give every host the same copy")


def stop_together(problem: str | None, what: str) -> None:
  """Raises ConfigError on every process if any has a `problem` (a check each makes against
  its own host, such as its free memory): one that went on alone would wait for ever at the
  next collective for those that stopped. The others say which process stopped, and `what`
  it checked."""
  if jax.process_count() > 1:
    stopped = multihost_utils.process_allgather(np.int32(problem is not None))
    if stopped.any() and not problem:
      problem = (f"process {int(np.argmax(stopped))} cannot go on: {what} (its own line "
                 f"says why)")
  if problem:
    raise ConfigError(problem)
