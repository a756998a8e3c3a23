"""Multi-host start-up: JAX's own multi-controller runtime, nothing home-made.

`initialize` calls `jax.distributed.initialize` when the command line names a coordinator,
or when the environment shows a multi-process cluster (SLURM with several tasks, Open MPI,
a TPU pod slice); JAX then detects the coordinator, process count and id itself. A plain
single-process run is left alone. It must run before anything touches a JAX backend.
"""

from __future__ import annotations

import os

import jax


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
