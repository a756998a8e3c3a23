"""Host batches to global `jax.Array`s: each process contributes only the rows it holds.

`process_rows` says which global rows this process's devices hold under the batch sharding
(the data iterator builds exactly those), `to_global_batch` assembles the global arrays, and
`gather_state` merges the iterator states of all processes into one, so that any process
can save it and any process layout can resume from it.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from data.pipeline import merge_states


def process_rows(sharding: jax.sharding.Sharding, global_batch_size: int,
                 seq_len: int) -> list[int]:
  """Sorted global row indices held by this process's devices under `sharding`."""
  rows = set()
  for index in sharding.addressable_devices_indices_map((global_batch_size, seq_len)).values():
    rows.update(range(global_batch_size)[index[0]])
  return sorted(rows)


def to_global_batch(batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding,
                    global_batch_size: int | None = None) -> dict[str, jax.Array]:
  """Assembles `[global_batch, seq]` arrays from this process's `[len(rows), seq]` arrays.

  The local rows must be `process_rows(sharding, ...)` in order, each with the whole
  sequence; every array of the batch gets the same sharding. Without `global_batch_size`
  it is inferred from the sharding (each process holding distinct rows).
  """
  def one(value):
    value = np.asarray(value)
    shape = None if global_batch_size is None else (global_batch_size, *value.shape[1:])
    return jax.make_array_from_process_local_data(sharding, value, shape)

  return {name: one(value) for name, value in batch.items()}


def gather_state(state: dict[str, Any]) -> dict[str, Any]:
  """The iterator states of all processes merged (a collective: every process must call)."""
  if jax.process_count() == 1:
    return state
  encoded = np.frombuffer(json.dumps(state).encode(), np.uint8)
  # Pad to a common length so the all-gather has one shape; spaces are valid JSON padding.
  length = int(np.max(multihost_utils.process_allgather(np.int32(encoded.size))))
  padded = np.full(length, ord(" "), np.uint8)
  padded[:encoded.size] = encoded
  gathered = multihost_utils.process_allgather(padded)
  return merge_states([json.loads(bytes(row).decode()) for row in np.asarray(gathered)])
