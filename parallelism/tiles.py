"""The tile skip rule: which (query tile, key tile) pairs attention must compute.

One rule serves every layout (see DESIGN.md, "The attention contract"). Query i sees
key j iff `token_index[j] <= token_index[i]` and their segment ids match. For a tile
pair, summarised by the min/max token index of each side and whether all its query and
key segment ids are one value:

- SKIP when `max(q_index) < min(k_index)`: every key is in every query's future;
- UNMASKED when `min(q_index) >= max(k_index)` and one segment: every query sees every key;
- MASKED otherwise: compute with the elementwise mask.

Under `ring` this skips whole future blocks; under `striped` and `zigzag` it skips the
upper triangle of tiles inside each block. The xla kernel, the benchmark's tile counter
and the Pallas kernel all call `classify_tile`, so they cannot disagree.

The functions work on NumPy arrays (host-side counting) and on traced jnp values (inside
the kernels) alike; summaries are taken over the whole local batch, which is
conservative (a tile is skipped only if it is skippable for every row) and so exact.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

SKIP, UNMASKED, MASKED = 0, 1, 2  # also the branch order of the kernels' lax.switch


class TileSummary(NamedTuple):
  """Per-tile summary over batch and tokens; every field has shape [num_tiles]."""
  index_min: ArrayLike
  index_max: ArrayLike
  segment_min: ArrayLike
  segment_max: ArrayLike


def _xp(*values):
  """jnp when any value is a JAX array or tracer, else NumPy (keeps host counting fast)."""
  return jnp if any(isinstance(v, jax.Array) for v in values) else np


def summarize_tiles(token_index_BT: ArrayLike, segment_ids_BT: ArrayLike,
                    tile: int) -> TileSummary:
  """Min/max token index and segment id of each length-`tile` chunk of the T axis."""
  xp = _xp(token_index_BT, segment_ids_BT)
  batch, length = token_index_BT.shape
  if length % tile:
    raise ValueError(f"block length {length} is not divisible by tile size {tile}")
  index_BNt = token_index_BT.reshape(batch, length // tile, tile)
  segment_BNt = segment_ids_BT.reshape(batch, length // tile, tile)
  return TileSummary(
      index_min=xp.min(index_BNt, axis=(0, 2)), index_max=xp.max(index_BNt, axis=(0, 2)),
      segment_min=xp.min(segment_BNt, axis=(0, 2)), segment_max=xp.max(segment_BNt, axis=(0, 2)))


def one_segment(segment_min_q: ArrayLike, segment_max_q: ArrayLike, segment_min_k: ArrayLike,
                segment_max_k: ArrayLike) -> ArrayLike:
  """True where a tile pair's query and key segment ids are all one value."""
  return ((segment_min_q == segment_max_q) & (segment_min_k == segment_max_k)
          & (segment_min_q == segment_min_k))


def visible(q_index: ArrayLike, q_seg: ArrayLike, k_index: ArrayLike,
            k_seg: ArrayLike) -> ArrayLike:
  """The elementwise rule the classes summarise: query sees key (broadcasts like NumPy)."""
  return (k_index <= q_index) & (k_seg == q_seg)


def classify_tile(q_index_min: ArrayLike, q_index_max: ArrayLike, k_index_min: ArrayLike,
                  k_index_max: ArrayLike, single_segment: ArrayLike) -> ArrayLike:
  """SKIP, UNMASKED or MASKED (int32) for tile pairs; broadcasts like NumPy."""
  xp = _xp(q_index_min, q_index_max, k_index_min, k_index_max, single_segment)
  unmasked = (q_index_min >= k_index_max) & single_segment
  # Typed constants: Pallas' Triton lowering gives a weak-typed Python int the predicate's
  # type (i1) in a select, which then fails to build.
  tile_class = xp.where(q_index_max < k_index_min, np.int32(SKIP),
                        xp.where(unmasked, np.int32(UNMASKED), np.int32(MASKED)))
  return tile_class.astype(xp.int32)


def classify_pair(q: TileSummary, k: TileSummary) -> ArrayLike:
  """Class of query tiles `q` against key tiles `k` (fields broadcast like NumPy)."""
  single = one_segment(q.segment_min, q.segment_max, k.segment_min, k.segment_max)
  return classify_tile(q.index_min, q.index_max, k.index_min, k.index_max, single)


def classify_all(q: TileSummary, k: TileSummary) -> ArrayLike:
  """Classes of all pairs as a [num_q_tiles, num_k_tiles] array."""
  return classify_pair(TileSummary(*(field[:, None] for field in q)),
                       TileSummary(*(field[None, :] for field in k)))
