"""Multi-host start-up: JAX's own multi-controller runtime, nothing home-made.

`initialize` calls `jax.distributed.initialize` when the command line names a coordinator,
or when the environment shows a multi-process cluster (SLURM with several tasks, Open MPI,
a TPU pod slice); JAX then detects the coordinator, process count and id itself. A plain
single-process run is left alone. It must run before anything touches a JAX backend. The
processes then watch each other (trainer/run/peers.py), so that one that dies is named at
once by the others, which JAX's runtime does only at its heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
from typing import Any

import jax
from jax._src import distributed as jax_distributed  # The coordination service's client.
from jax.experimental import multihost_utils
import numpy as np

from trainer.config.config_check import ConfigError
from trainer.run import peers
from trainer.track.tracking import scrub


def cluster_in_environment(environ: dict[str, str] | None = None) -> bool:
  """True when the launcher started several processes that must form one JAX runtime."""
  env = os.environ if environ is None else environ
  return (int(env.get("SLURM_NTASKS", "1") or 1) > 1
          or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
          or "," in env.get("TPU_WORKER_HOSTNAMES", ""))


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None) -> peers.PeerWatch | None:
  """Joins the run's processes; ConfigError for flags that cannot name one of them. Returns
  the watch on the others (see trainer/run/peers.py) when there are several."""
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise ConfigError("--coordinator_address needs --num_processes and --process_id")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ConfigError(f"--process_id={process_id} must be in 0..{num_processes - 1} "
                        f"(--num_processes={num_processes})")
    # JAX waits for every process in silence, and gives up after 5 minutes with an abort.
    print(f"process {process_id} of {num_processes}: joining the others at "
          f"{coordinator_address} (JAX waits up to 5 minutes for all of them)", flush=True)
    with _default_signal_handlers():
      jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif cluster_in_environment():
    print("joining the run's other processes (from the cluster's environment; JAX waits up "
          "to 5 minutes for all of them)", flush=True)
    with _default_signal_handlers():
      jax.distributed.initialize()
  else:
    return None
  return _watch_peers()


def _watch_peers() -> peers.PeerWatch | None:
  """Connects this process to every other through the coordination service's key-value
  store (no collective to compile); a network that refuses the connections leaves the run
  without the watch, as JAX alone would run it."""
  state = jax_distributed.global_state
  watch = None
  try:
    watch = peers.PeerWatch(jax.process_index(), jax.process_count(),
                            peers.local_ip(state.coordinator_address))
    state.client.key_value_set(f"trainer/peers/{jax.process_index()}", watch.address)
    timeout_ms = int(peers.CONNECT_TIMEOUT_S * 1000)
    watch.connect([state.client.blocking_key_value_get(f"trainer/peers/{k}", timeout_ms)
                   for k in range(jax.process_count())])
  except (OSError, jax.errors.JaxRuntimeError) as error:
    print(f"note: process {jax.process_index()} cannot watch the others ({error}); a process "
          f"that dies is noticed at JAX's heartbeat timeout, with its C++ abort", flush=True)
    if watch is not None:
      watch.close()
    return None
  return watch


@contextlib.contextmanager
def _default_signal_handlers():
  """SIGTERM and SIGINT end the process while JAX waits for the others: a Python handler
  would run only once that wait ended (up to 5 minutes), and there is nothing to save.

  Once joined, SIGTERM stays JAX's: its preemption service installs its own handler there,
  which agrees on one step to save for all processes (see stop_signals.StopSignals);
  putting the trainer's back would replace it. SIGINT gets the trainer's back."""
  previous = {number: signal.signal(number, signal.SIG_DFL)
              for number in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  except BaseException:
    for number, handler in previous.items():
      signal.signal(number, handler)
    raise
  signal.signal(signal.SIGINT, previous[signal.SIGINT])


def same_everywhere(value: str, what: str) -> None:
  """Raises ConfigError on every process unless all hold the same `value` (compared by
  hash). Checks that each process makes against its own copy (a checkpoint's corpus and
  tokenizer) must agree: a process that stopped alone would leave the others waiting at
  the next collective for ever."""
  if jax.process_count() > 1 and not _everywhere(_digest(value)):
    raise ConfigError(f"the processes do not hold the same {what} (process "
                      f"{jax.process_index()} has {value}): give every host the same copy")


def same_settings(settings: dict[str, Any]) -> None:
  """Raises ConfigError on every process unless all run with the same `settings` (name ->
  value: the config's fields, the workdir). A process with another length or schedule
  trained another model in step with the rest, without a word; one with another workdir
  hung at the first save."""
  if jax.process_count() == 1:
    return
  names = sorted(settings)
  values = [json.dumps(settings[name], sort_keys=True, default=str) for name in names]
  if _everywhere(_digest("\n".join(names + values))):
    return
  if not _everywhere(_digest("\n".join(names))):
    raise ConfigError("the processes' configs have different fields (different versions of "
                      "the trainer?): give every host the same checkout")
  digests = multihost_utils.process_allgather(np.array([_digest(v) for v in values]))
  differ = [name for i, name in enumerate(names) if (digests[:, i] != digests[0, i]).any()]
  mine = ", ".join(f"{name}={scrub(settings[name])}" for name in differ[:3])
  raise ConfigError(f"the processes do not run with the same {', '.join(differ)} (process "
                    f"{jax.process_index()} has {mine}): give every process the same command")


def _digest(text: str) -> np.int64:
  return np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.int64)[0]


def _everywhere(digest: np.int64) -> bool:
  """Whether every process holds this digest (a collective: every process must call it)."""
  digests = multihost_utils.process_allgather(digest)
  return bool((digests == digests[0]).all())


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
