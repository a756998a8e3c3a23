"""The backend the attention kernels are traced for: JAX's own, or the GPU a plan compiles for.

A dry run may compile the train step for GPUs that are described to XLA's GPU compiler but
not attached (`trainer.plan.plan_target`). JAX's default backend is then still the CPU, yet the
kernels must be chosen and lowered as on the GPU (`auto` compiles `pallas`, since cuDNN's
attention compiles only on an attached GPU, and Pallas lowers to Triton instead of
interpreting).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

_DESCRIBED: str | None = None  # The backend of the described devices being compiled for.


def backend() -> str:
  """'gpu' while compiling for described GPUs, else JAX's default backend."""
  return _DESCRIBED or jax.default_backend()


def described() -> bool:
  """Whether the kernels are traced for devices that are described, not attached."""
  return _DESCRIBED is not None


@contextlib.contextmanager
def compiling_for(described_backend: str | None) -> Iterator[None]:
  """Within: kernels are traced for `described_backend` (None: JAX's own, a no-op)."""
  global _DESCRIBED
  previous = _DESCRIBED
  _DESCRIBED = described_backend or previous
  try:
    yield
  finally:
    _DESCRIBED = previous
