"""QK-dropping (SCFA, Pagliardini et al. 2023): per layer and head, some queries and keys
are dropped; a kept query sees the kept keys that are causal and in its document, a dropped
query sees nothing (its output is 0) and a dropped key is seen by no query.

The rule, per layer, head, and q or k apart: a row is cut into chunks of `CHUNK` consecutive
original positions (the last one may be shorter, of length n); each chunk keeps exactly
`kept_count(rate, n)` = floor((1 - rate) * n + 1/2) of its tokens, those whose hash
`mix(seed, layer, head, q or k, position)` is smallest (ties: the earlier position). So a
block of whole chunks (dense rows; ring and zigzag blocks of a multiple of 64 tokens) keeps a
fixed count per head; a striped block takes every N-th token of each chunk and keeps that
count on average. Shapes never depend on it: the kernels see codes, not compacted arrays.

Why a fixed pseudo-random pattern (SCFA drops at random): drawn once from `DROP_SEED`, it is
part of the model, so training, `--dry_run`, evaluation and a resumed run drop the same
tokens; it depends on the original position (and the row length, in a short last chunk), not
the layout or device count, so every layout drops the same tokens, each device computing its
own with no collective. A content-based rule would need each chunk's tokens in one place,
which striped scatters over all devices. Decoding codes position p as the row of the cache's
`capacity` does (the row the prefill coded), not re-coding a sequence as it grows, which
would change flags of keys already in the cache.

It is expressed through the run-time code contract of hash attention (`parallelism.kernels`:
a query sees a key iff causal, same document and equal codes): a kept query has code 0, a
dropped one 1; a kept key 0, a dropped one 2. Codes carry no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import parallelism

DROP_SEED = 38  # Issue #38; any fixed value: the pattern is part of the model's definition.
CHUNK = 64  # Consecutive original positions that keep a fixed count per head.
KEPT, DROPPED_QUERY, DROPPED_KEY = 0, 1, 2  # The codes: dropped ones match nothing.
_QUERY, _KEY = 1, 2  # Salts: queries and keys are dropped independently.


def kept_count(rate: float, length: int = CHUNK) -> int:
  """Tokens a chunk of `length` keeps per head at drop rate `rate` (round half up)."""
  return int(np.floor((1.0 - rate) * length + 0.5))


def _mix(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash (lowbias32, C. Wellons): every input bit moves every output bit."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _scores(layer: jax.Array, salt: int, heads: int, index: jax.Array) -> jax.Array:
  """[..., H] uint32 hash of (seed, layer, q or k, head, original position)."""
  base = _mix(jnp.uint32(DROP_SEED * 4 + salt) + _mix(jnp.asarray(layer).astype(jnp.uint32)))
  per_head = _mix(base + jnp.arange(heads, dtype=jnp.uint32))
  return _mix(per_head + index.astype(jnp.uint32)[..., None])


def keep_flags(index_S: jax.Array, seq_len: int, heads: int, rate: float, layer: jax.Array,
               salt: int) -> jax.Array:
  """[S, H] bool: whether the token at original position `index_S[s]` (any order) is kept in
  head h of `layer`. A token's rank in its chunk is counted against the chunk's CHUNK
  positions, computed from the index alone (no other token's data)."""
  index_S = jnp.asarray(index_S, jnp.int32)
  start_S = index_S // CHUNK * CHUNK
  length_S = jnp.minimum(seq_len - start_S, CHUNK)
  member_SC = start_S[:, None] + jnp.arange(CHUNK, dtype=jnp.int32)
  mine_SH = _scores(layer, salt, heads, index_S)
  theirs_SCH = _scores(layer, salt, heads, member_SC)
  before_SCH = (theirs_SCH < mine_SH[:, None]) | (
      (theirs_SCH == mine_SH[:, None]) & (member_SC < index_S[:, None])[..., None])
  before_SCH &= (member_SC < seq_len)[..., None]  # A short last chunk ranks its own only.
  rank_SH = jnp.sum(before_SCH, axis=1, dtype=jnp.int32)
  kept_S = jnp.floor((1.0 - rate) * length_S.astype(jnp.float32) + 0.5).astype(jnp.int32)
  return rank_SH < kept_S[:, None]


def layout_shards() -> int:
  """The shards the data pipeline permuted the row over: the mesh's `sequence` axis (1
  without a mesh, where a row arrives in its original order)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else mesh.shape.get("sequence", 1)


def codes_at(index_S: jax.Array, seq_len: int, num_heads: int, num_kv_heads: int, rate: float,
             layer: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(query codes [S, Hq], key codes [S, Hkv]) int32 of one layer for the tokens at original
  positions `index_S` of a row of `seq_len`: what training and decoding both read."""
  q_SH = jnp.where(keep_flags(index_S, seq_len, num_heads, rate, layer, _QUERY),
                   KEPT, DROPPED_QUERY)
  k_SK = jnp.where(keep_flags(index_S, seq_len, num_kv_heads, rate, layer, _KEY),
                   KEPT, DROPPED_KEY)
  return q_SH.astype(jnp.int32), k_SK.astype(jnp.int32)


def drop_codes(batch: int, seq_len: int, num_heads: int, num_kv_heads: int, rate: float,
               layer: jax.Array, layout: str) -> tuple[jax.Array, jax.Array]:
  """(query codes [B, S, Hq], key codes [B, S, Hkv]) int32 of one layer, in the order of
  `layout` over `layout_shards()`, the same for every row."""
  index_S = parallelism.permute(np.arange(seq_len, dtype=np.int32), layout, layout_shards(),
                                axis=0)
  q_SH, k_SK = codes_at(index_S, seq_len, num_heads, num_kv_heads, rate, layer)
  return (jnp.broadcast_to(q_SH[None], (batch, seq_len, num_heads)),
          jnp.broadcast_to(k_SK[None], (batch, seq_len, num_kv_heads)))
