"""Sequence layouts: the once-per-batch permutation of the sequence axis.

With N shards on the `sequence` mesh axis (docs/architecture.md, "The sequence layout contract"):

- `ring`: identity; shard d holds tokens [d*S/N, (d+1)*S/N).
- `striped`: shard d holds original tokens d, d+N, d+2N, ... in order.
- `zigzag`: the row is cut into 2N chunks; shard d holds chunks d and 2N-1-d.

The data pipeline permutes every per-token array of a batch with `permute`; evals and
tests go back with `unpermute`. Both work on NumPy and JAX arrays alike.
"""

from __future__ import annotations

import functools

import numpy as np

LAYOUTS = ("ring", "striped", "zigzag")


def required_divisor(layout: str, num_shards: int) -> int:
  """The number the sequence length must be divisible by for this layout."""
  _check_layout(layout)
  return 2 * num_shards if layout == "zigzag" else num_shards


def check_seq_len(seq_len: int, layout: str, num_shards: int, name: str = "seq_len") -> None:
  """ValueError unless `seq_len` splits evenly over the shards of `layout`; `name` is how
  the caller's users know the length (e.g. 'data.seq_len')."""
  divisor = required_divisor(layout, num_shards)
  if num_shards < 1 or seq_len % divisor:
    raise ValueError(
        f"{name}={seq_len} must be divisible by {divisor} (sequence shards={num_shards}"
        f"{' x 2 for zigzag' if layout == 'zigzag' else ''})")


@functools.lru_cache(maxsize=64)
def permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
  """Original token index held at each permuted position: permuted[i] = x[perm[i]]."""
  check_seq_len(seq_len, layout, num_shards)
  index = np.arange(seq_len, dtype=np.int32)
  if layout == "ring":
    perm = index
  elif layout == "striped":
    perm = index.reshape(seq_len // num_shards, num_shards).T.reshape(seq_len)
  else:  # zigzag
    chunks = index.reshape(2 * num_shards, seq_len // (2 * num_shards))
    perm = np.concatenate(
        [np.concatenate([chunks[d], chunks[2 * num_shards - 1 - d]]) for d in range(num_shards)])
  perm.setflags(write=False)
  return perm


@functools.lru_cache(maxsize=64)
def inverse_permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
  inverse = np.argsort(permutation(layout, seq_len, num_shards)).astype(np.int32)
  inverse.setflags(write=False)
  return inverse


def permute(x, layout: str, num_shards: int, axis: int = 1):
  """Reorders the sequence axis of `x` from the original order into `layout`."""
  return x.take(permutation(layout, x.shape[axis], num_shards), axis=axis)


def unpermute(x, layout: str, num_shards: int, axis: int = 1):
  """Exact inverse of `permute`."""
  return x.take(inverse_permutation(layout, x.shape[axis], num_shards), axis=axis)


def _check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"unknown sequence layout '{layout}'; choose one of {LAYOUTS}")
