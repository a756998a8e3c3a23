"""The tile skip rule: which (query tile, key tile) pairs attention must compute.

One rule serves every layout (`parallelism.masks.visible`, docs/masks.md): query i sees
key j iff `0 <= token_index[i] - token_index[j] < window` (and their segment ids match: a
run-time mask left to the kernels). `window=None` is causal; a window of w keys includes the query
itself, as Hugging Face's `sliding_window` = w, flash-attn's `window_size=(w - 1, 0)` and
splash's `LocalMask((w - 1, 0))`. A tile pair, summarised by `d = q - k` in
`[q_min - k_max, q_max - k_min]`, is:

- SKIP when `d_hi < 0` (every key in every query's future) or `d_lo >= window`;
- UNMASKED when `d_lo >= 0` and `d_hi < window`: every query sees every key;
- MASKED otherwise (elementwise: `parallelism.masks.visible`). The schedule turns a MASKED tile whose mask is
  empty into SKIP (under striped a window can fall between the tokens a tile holds).

Per-head spans (MoA) make the window a band between `narrowest` and `window`: SKIP by the
widest, UNMASKED by the narrowest, and MASKED tiles narrowed per head (`q - k < span[h]`).

Token indices are fixed by (layout, seq_len, ring size), so the rule runs once on the host,
in NumPy, when `parallelism.schedule` builds the ring's schedule; kernels read the result.
"""

from __future__ import annotations

import numpy as np

SKIP, UNMASKED, MASKED = 0, 1, 2


def tile_ranges(index_T: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
  """(min, max) token index of each length-`tile` chunk of a block's index vector."""
  if index_T.shape[0] % tile:
    raise ValueError(f"block length {index_T.shape[0]} is not divisible by tile size {tile}")
  chunks = index_T.reshape(-1, tile)
  return chunks.min(axis=1), chunks.max(axis=1)


def classify_tile(q_min, q_max, k_min, k_max, window: int | None = None,
                  narrowest: int | None = None) -> np.ndarray:
  """SKIP, UNMASKED or MASKED (int8) for tile pairs; broadcasts like NumPy. With per-head
  spans, `window` is the widest and `narrowest` the narrowest (None: `window`)."""
  d_lo, d_hi = q_min - k_max, q_max - k_min
  narrowest = window if narrowest is None else narrowest
  skip, unmasked = d_hi < 0, d_lo >= 0
  if window is not None:
    skip, unmasked = skip | (d_lo >= window), unmasked & (d_hi < narrowest)
  return np.where(skip, SKIP, np.where(unmasked, UNMASKED, MASKED)).astype(np.int8)


def classify_all(q_index_T: np.ndarray, k_index_T: np.ndarray, tile_q: int, tile_k: int,
                 window: int | None = None, narrowest: int | None = None) -> np.ndarray:
  """Classes of all tile pairs of a query block and a key block, [num_q_tiles, num_k_tiles]."""
  q_min, q_max = tile_ranges(q_index_T, tile_q)
  k_min, k_max = tile_ranges(k_index_T, tile_k)
  return classify_tile(q_min[:, None], q_max[:, None], k_min[None, :], k_max[None, :], window,
                       narrowest)
