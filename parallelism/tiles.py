"""The tile skip rule: which (query tile, key tile) pairs attention must compute.

One rule serves every layout (see DESIGN.md, "The attention contract"). Query i sees key j
iff `token_index[j] <= token_index[i]` (and, for packed documents, their segment ids match:
a run-time mask the schedule leaves to the kernels). For a tile pair, summarised by the
min/max token index of each side:

- SKIP when `max(q_index) < min(k_index)`: every key is in every query's future;
- UNMASKED when `min(q_index) >= max(k_index)`: every query sees every key;
- MASKED otherwise: compute with the elementwise mask (`visible`).

Under `ring` this skips whole future blocks; under `striped` and `zigzag` it skips the
upper triangle of tiles inside each block. Token indices are fixed by (layout, seq_len,
ring size), so the rule runs once on the host, in NumPy, when `parallelism.schedule`
builds the ring's schedule; the kernels only read the result.
"""

from __future__ import annotations

import numpy as np

SKIP, UNMASKED, MASKED = 0, 1, 2


def visible(q_index: np.ndarray, k_index: np.ndarray) -> np.ndarray:
  """The elementwise rule the classes summarise: query sees key (broadcasts like NumPy)."""
  return k_index <= q_index


def tile_ranges(index_T: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
  """(min, max) token index of each length-`tile` chunk of a block's index vector."""
  if index_T.shape[0] % tile:
    raise ValueError(f"block length {index_T.shape[0]} is not divisible by tile size {tile}")
  chunks = index_T.reshape(-1, tile)
  return chunks.min(axis=1), chunks.max(axis=1)


def classify_tile(q_min, q_max, k_min, k_max) -> np.ndarray:
  """SKIP, UNMASKED or MASKED (int8) for tile pairs; broadcasts like NumPy."""
  return np.where(q_max < k_min, SKIP, np.where(q_min >= k_max, UNMASKED, MASKED)).astype(np.int8)


def classify_all(q_index_T: np.ndarray, k_index_T: np.ndarray, tile_q: int,
                 tile_k: int) -> np.ndarray:
  """Classes of all tile pairs of a query block and a key block, [num_q_tiles, num_k_tiles]."""
  q_min, q_max = tile_ranges(q_index_T, tile_q)
  k_min, k_max = tile_ranges(k_index_T, tile_k)
  return classify_tile(q_min[:, None], q_max[:, None], k_min[None, :], k_max[None, :])
