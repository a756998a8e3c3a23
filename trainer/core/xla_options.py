"""XLA options the train step compiles with on GPUs, each for a reason the schedule shows.

- `xla_gpu_experimental_parallel_collective_overlap_limit=2`: XLA's GPU scheduler keeps at
  most one asynchronous collective in flight unless told more. Each step of the ring's
  backward has two: the next K/V block and the dK/dV accumulator, which travels one step
  behind its block (`parallelism.ring.backward_pass`). With a limit of one the scheduler
  waits for the accumulator before it issues the K/V transfer, and the accumulator overlaps
  nothing. Two lets both run under the step's kernels (`parallelism/overlap.py` reads the
  compiled schedule; `--dry_run` prints its verdict, tests/test_plan_gpu.py keeps it true).

A user's `XLA_FLAGS` wins: an option named there is not passed (options passed to a compile
override the environment's).
"""

from __future__ import annotations

import os

GPU_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}


def for_platform(platform: str) -> dict[str, object]:
  """The options of a compile for `platform` ('gpu', 'cpu', 'tpu'), less those the user's
  `XLA_FLAGS` set."""
  if platform != "gpu":
    return {}
  user = os.environ.get("XLA_FLAGS", "")
  return {name: value for name, value in GPU_OPTIONS.items() if f"--{name}=" not in user}
