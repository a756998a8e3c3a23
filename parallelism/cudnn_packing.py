"""Packed documents in cuDNN's packed (ragged) layout, for the `cudnn` kernel and dense
attention on GPUs.

cuDNN's flash attention takes a row as up to M sequences, each an offset and a length in
the query and in the key array (JAX's `q_offsets`/`q_seqlen`, `kv_offsets`/`kv_seqlen`;
Transformer Engine's THD); a query sees only its own sequence's keys, under the call's mask.
Here a sequence is one document's piece of a block pair, found at run time:

- A *run* is a stretch of equal segment ids. Every layout keeps a block's tokens in their
  original order, so each packed document (and the trailing padding) is one run per block.
- A `full` pair pairs each query run with the key run of the same id, without a mask.
- A `causal` pair (j visible to i iff j <= i; a `strictly_causal` pair shifted by a row)
  has pos_k(j) <= pos_q(j) for every j, so a document starts among the keys at the same
  index or later (c >= a) and ends there at the same index or later (e >= b): queries
  [a, c) see none of its keys, keys [b, e) no query, and queries and keys [c, b) pair with
  equal lengths, where cuDNN's causal mask is the rule whatever its diagonal alignment.
- Queries and keys outside every pair see nothing: output 0, lse -inf, zero gradients.

A call with more runs than the static M, or an id in two runs of a block, is not `exact`:
the caller runs Pallas instead, and nothing for a call without `any_pair` (both decided at
run time). cuDNN's statistics are per sequence, [B * M, H, T]: sequence s (the s-th valid
pair, row-major; JAX moves the -1 entries to the end) holds its queries' log-sum-exps at
[s, h, 0:length]; `lse_of_tokens` and `stats_of_tokens` map them to and from [B, T, H].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

DOCUMENTS_PER_CALL = 16  # M. cuDNN's statistics take M x the per-token lse's memory.


class Packing(NamedTuple):
  """One call's sequences in cuDNN's packed layout, and how its tokens map to them."""
  q_offsets: jax.Array  # [B, M + 1] int32, -1 past the row's last sequence
  kv_offsets: jax.Array  # [B, M + 1]
  q_lengths: jax.Array  # [B, M], -1 likewise
  kv_lengths: jax.Array  # [B, M]
  q_covered: jax.Array  # [B, Tq] bool: the query is in a sequence
  k_covered: jax.Array  # [B, Tk] bool: the key is in a sequence
  q_sequence: jax.Array  # [B, Tq] int32: its sequence's index s in the statistics
  q_local: jax.Array  # [B, Tq] int32: its index within the sequence
  exact: jax.Array  # bool scalar: the packing is the mask
  any_pair: jax.Array  # bool scalar: some query sees some key (else there is nothing to call)


def whole_rows(segment_ids_BS: jax.Array, max_runs: int) -> Packing:
  """Dense causal attention of whole rows: every run (at most `max_runs`) is a sequence of
  its own queries and keys."""
  start_BM, end_BM, id_BM, valid_BM, fits = _runs(segment_ids_BS, max_runs)
  length_BM, length = end_BM - start_BM, segment_ids_BS.shape[1]
  fits = fits & _single_runs(segment_ids_BS, id_BM, length_BM, valid_BM)
  return _packing(start_BM, length_BM, start_BM, length_BM, valid_BM, length, length, fits)


def block_pair(q_seg_BT: jax.Array, k_seg_BT: jax.Array, causal: bool,
               max_runs: int) -> Packing:
  """A `full` (causal=False) or `causal` block pair of at most `max_runs` query runs
  (module docstring)."""
  start_BM, end_BM, id_BM, valid_BM, fits = _runs(q_seg_BT, max_runs)
  match_BMT = k_seg_BT[:, None, :] == id_BM[:, :, None]
  k_count_BM = match_BMT.sum(-1)
  k_first_BM = jnp.argmax(match_BMT, axis=-1)
  k_end_BM = k_seg_BT.shape[1] - jnp.argmax(match_BMT[..., ::-1], axis=-1)
  k_single = jnp.all((k_end_BM - k_first_BM == k_count_BM) | (k_count_BM == 0) | ~valid_BM)
  fits = fits & k_single & _single_runs(q_seg_BT, id_BM, end_BM - start_BM, valid_BM)
  if causal:
    # Queries and keys [c, b); the shape's order guarantees c >= a and e >= b (checked).
    q_start_BM = k_start_BM = k_first_BM
    q_length_BM = kv_length_BM = end_BM - k_first_BM
    paired_BM = valid_BM & (k_count_BM > 0) & (q_length_BM > 0)
    ordered = (k_first_BM >= start_BM) & (k_end_BM >= end_BM)
    fits = fits & jnp.all(ordered | ~paired_BM)
  else:
    q_start_BM, q_length_BM = start_BM, end_BM - start_BM
    k_start_BM, kv_length_BM = k_first_BM, k_count_BM
    paired_BM = valid_BM & (k_count_BM > 0)
  return _packing(q_start_BM, q_length_BM, k_start_BM, kv_length_BM, paired_BM,
                  q_seg_BT.shape[1], k_seg_BT.shape[1], fits)


def lse_of_tokens(stats_SHT: jax.Array, packing: Packing) -> jax.Array:
  """Per-token lse [B, T, H] float32 from cuDNN's per-sequence statistics; -inf for queries
  outside every sequence."""
  heads = stats_SHT.shape[1]
  lse_BTH = stats_SHT[packing.q_sequence[..., None], jnp.arange(heads),
                      packing.q_local[..., None]].astype(jnp.float32)
  return jnp.where(packing.q_covered[..., None], lse_BTH, -jnp.inf)


def stats_of_tokens(lse_BTH: jax.Array, packing: Packing) -> jax.Array:
  """cuDNN's per-sequence statistics [B * M, H, T] holding per-token `lse_BTH` (what its
  backward reads; entries past a sequence's length are never read)."""
  batch, length, _ = lse_BTH.shape
  max_runs = packing.q_lengths.shape[1]
  valid_F = (packing.q_lengths >= 0).reshape(-1)
  source_S = jnp.nonzero(valid_F, size=valid_F.size, fill_value=0)[0]  # flat (row, run)
  row_S, run_S = source_S // max_runs, source_S % max_runs
  start_S = jnp.maximum(packing.q_offsets[row_S, run_S], 0)
  token_ST = jnp.minimum(start_S[:, None] + jnp.arange(length), length - 1)
  return jnp.swapaxes(lse_BTH[row_S[:, None], token_ST], 1, 2).astype(jnp.float32)


def _runs(seg_BT: jax.Array, max_runs: int):
  """Each row's runs of equal ids, in order, at most `max_runs`: (start, end, id, valid)
  [B, M] each, and whether every row has at most `max_runs`."""
  batch, length = seg_BT.shape
  first_BT = jnp.concatenate([jnp.ones((batch, 1), bool), seg_BT[:, 1:] != seg_BT[:, :-1]],
                             axis=1)
  run_BT = jnp.cumsum(first_BT, axis=1) - 1
  rows_B1 = jnp.arange(batch)[:, None]
  index_BT = jnp.broadcast_to(jnp.arange(length), (batch, length))
  start_BM = jnp.full((batch, max_runs), length).at[rows_B1, run_BT].min(index_BT, mode="drop")
  end_BM = jnp.zeros((batch, max_runs), jnp.int32).at[rows_B1, run_BT].max(index_BT + 1,
                                                                             mode="drop")
  id_BM = jnp.zeros((batch, max_runs), seg_BT.dtype).at[rows_B1, run_BT].set(seg_BT,
                                                                              mode="drop")
  count_B = run_BT[:, -1] + 1
  valid_BM = jnp.arange(max_runs) < count_B[:, None]
  return start_BM, end_BM, id_BM, valid_BM, jnp.all(count_B <= max_runs)


def _single_runs(seg_BT, id_BM, length_BM, valid_BM) -> jax.Array:
  """Whether each valid run's id occurs in its block in that run only."""
  count_BM = (seg_BT[:, None, :] == id_BM[:, :, None]).sum(-1)
  return jnp.all((count_BM == length_BM) | ~valid_BM)


def _packing(q_start_BM, q_length_BM, k_start_BM, kv_length_BM, paired_BM, q_len: int,
             k_len: int, exact) -> Packing:
  def offsets(start_BM):
    padded = jnp.where(paired_BM, start_BM, -1).astype(jnp.int32)
    return jnp.pad(padded, ((0, 0), (0, 1)), constant_values=-1)

  def inside(start_BM, length_BM, positions):  # [B, T]: in the range of a paired run
    at = jnp.arange(positions)[None, None, :]
    ranges = (at >= start_BM[..., None]) & (at < (start_BM + length_BM)[..., None])
    return ranges & paired_BM[..., None]

  in_q_BMT = inside(q_start_BM, q_length_BM, q_len)
  # Sequence s of a pair: pairs counted in row-major order, as JAX hands them to cuDNN.
  sequence_BM = (jnp.cumsum(paired_BM.reshape(-1)) - 1).reshape(paired_BM.shape)
  run_BT = jnp.argmax(in_q_BMT, axis=1)  # the pair holding each query (0 where none)
  q_sequence = jnp.take_along_axis(sequence_BM, run_BT, axis=1)
  q_local = jnp.arange(q_len) - jnp.take_along_axis(q_start_BM, run_BT, axis=1)
  covered = in_q_BMT.any(axis=1)
  return Packing(
      q_offsets=offsets(q_start_BM), kv_offsets=offsets(k_start_BM),
      q_lengths=jnp.where(paired_BM, q_length_BM, -1).astype(jnp.int32),
      kv_lengths=jnp.where(paired_BM, kv_length_BM, -1).astype(jnp.int32),
      q_covered=covered, k_covered=inside(k_start_BM, kv_length_BM, k_len).any(axis=1),
      q_sequence=jnp.where(covered, q_sequence, 0).astype(jnp.int32),
      q_local=jnp.where(covered, q_local, 0).astype(jnp.int32), exact=exact,
      any_pair=jnp.any(paired_BM))
