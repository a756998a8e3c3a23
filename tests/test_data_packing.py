"""Packing and layouts on hand-made token streams: no dataset, no tokenizer."""

import numpy as np
import pytest

from data import packing
from data.pipeline import _BatchProducer, _RowStream
from parallelism import layouts
import grain

PAD = 0


def _documents(lengths, seed=0):
  """Documents whose tokens are unique ids (doc * 1000 + i + 1), one answer in the long ones."""
  rng = np.random.default_rng(seed)
  docs = []
  for d, n in enumerate(lengths):
    ids = (d * 1000 + np.arange(n) + 1).astype(np.int32)
    dist = np.zeros(n, np.int32)
    if n > 10:
      answer = int(rng.integers(5, n))
      dist[answer] = int(rng.integers(1, answer + 1))
    docs.append((ids, dist))
  return docs


def _pack_all(docs, seq_len, cross=False):
  read = lambda i: docs[i] if i < len(docs) else None
  rows, start = [], packing.StreamPosition()
  while (packed := packing.pack_row(read, start, seq_len, PAD, cross)) is not None:
    row, start = packed
    rows.append(row)
  return rows


def test_every_document_token_once_positions_restart():
  docs = _documents([5, 40, 3, 100, 17, 64, 1, 9])
  seq_len = 32
  rows = _pack_all(docs, seq_len)
  real = np.concatenate([r["tokens"][r["tokens"] != PAD] for r in rows])
  assert np.array_equal(real, np.concatenate([ids for ids, _ in docs]))
  for row in rows:
    assert row["tokens"].shape == (seq_len,)
    assert np.array_equal(row["token_index"], np.arange(seq_len))
    for segment in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
      where = row["segment_ids"] == segment
      assert np.array_equal(row["positions"][where], np.arange(where.sum()))
      assert len(np.unique(row["tokens"][where] // 1000)) == 1  # One document per segment.
    # Targets are the next stream token; a target from another document or padding is masked.
    same_doc = (row["tokens"] // 1000 == row["targets"] // 1000) & (row["targets"] != PAD)
    assert np.array_equal(row["loss_mask"] > 0, same_doc)
    assert np.all(row["segment_ids"][row["tokens"] == PAD] == 0)


def test_targets_follow_tokens_across_rows():
  docs = _documents([50, 70])
  rows = _pack_all(docs, 16)
  stream = np.concatenate([ids for ids, _ in docs])
  for k, row in enumerate(rows[:-1]):
    assert np.array_equal(row["tokens"], stream[16 * k:16 * k + 16])
    assert np.array_equal(row["targets"], stream[16 * k + 1:16 * k + 17])


def test_answer_distance_points_at_the_fact_within_the_row():
  docs = _documents([30, 200, 45, 80, 12, 150], seed=3)
  rows = _pack_all(docs, 64)
  found = 0
  for row in rows:
    for i in np.nonzero(row["answer_distance"])[0]:
      d = row["answer_distance"][i]
      target = row["targets"][i]
      doc, pos = divmod(int(target) - 1, 1000)
      assert docs[doc][1][pos] == d  # The marked target is the document's answer token.
      fact = i + 1 - d  # The fact token is d tokens before the target, in the same segment.
      assert fact >= 0 and row["segment_ids"][fact] == row["segment_ids"][i]
      found += 1
  assert found > 0


def test_cross_document_attention_one_segment_positions_still_restart():
  docs = _documents([10, 20, 30])
  row = _pack_all(docs, 64, cross=True)[0]
  assert set(np.unique(row["segment_ids"])) == {0, 1}
  assert row["positions"][10] == 0 and row["positions"][30] == 0
  assert row["loss_mask"][9] == 0  # Still no loss across documents.


def _producer(streams_docs, seq_len, layout="ring", shards=1):
  """A batch producer with one row per document list (row r packs streams_docs[r])."""
  streams = {r: _RowStream(grain.MapDataset.source(docs), seq_len, PAD, False)
             for r, docs in enumerate(streams_docs)}
  return _BatchProducer(streams, seq_len, layout, shards, PAD)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_targets_stay_aligned_after_permutation(layout):
  docs = _documents([37, 90, 11, 64, 120, 5, 70])
  seq_len, shards = 64, 4
  producer = _producer([docs], seq_len, layout, shards)
  plain = _producer([docs], seq_len)
  batches = [next(producer) for _ in range(2)]
  references = [next(plain) for _ in range(2)]
  perm = layouts.permutation(layout, seq_len, shards)
  # token_index names each token's original place; the target is the next original token.
  stream_tokens = np.concatenate([ids for ids, _ in docs])
  for r, (batch, reference) in enumerate(zip(batches, references)):
    for name in packing.FIELDS:
      assert np.array_equal(batch[name], reference[name][:, perm]), name
      assert np.array_equal(layouts.unpermute(batch[name], layout, shards), reference[name])
    original = batch["token_index"][0] + r * seq_len
    assert np.array_equal(batch["tokens"][0], stream_tokens[original])
    assert np.array_equal(batch["targets"][0], stream_tokens[original + 1])


def test_finite_stream_last_batch_is_padded():
  # Row 0's stream fills three rows; row 1's one. Rows that ran out are padding.
  producer = _producer([_documents([20, 20]), _documents([10])], seq_len=16)
  batches = list(producer)
  assert len(batches) == 3 and all(b["tokens"].shape == (2, 16) for b in batches)
  assert batches[0]["segment_ids"][1].any()
  for batch in batches[1:]:
    assert batch["loss_mask"][1].sum() == 0 and batch["segment_ids"][1].sum() == 0
