"""Packing and layouts on hand-made token streams: no dataset, no tokenizer."""

import numpy as np
import pytest

from data import packing
from data.pipeline import _BatchProducer, _Stream
from parallelism import layouts

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


def _reader(docs, part_length=None):
  """`read(doc, part)` over whole documents, or over parts of at most `part_length` tokens."""
  def read(doc, part):
    if doc >= len(docs):
      return None
    ids, dist = docs[doc]
    step = part_length or max(len(ids), 1)
    start = part * step
    return packing.Part(ids[start:start + step], dist[start:start + step],
                        start + step >= len(ids))
  return read


def _pack_all(docs, seq_len, cross=False, part_length=None):
  read = _reader(docs, part_length)
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


def test_a_document_in_parts_packs_as_if_whole():
  docs = _documents([30, 200, 45, 80, 12, 150, 7], seed=3)
  whole = _pack_all(docs, 64)
  for part_length in (1, 13, 64, 100):
    parts = _pack_all(docs, 64, part_length=part_length)
    assert len(parts) == len(whole)
    for got, want in zip(parts, whole):
      for name in packing.FIELDS:
        assert np.array_equal(got[name], want[name]), (part_length, name)


def _producer(docs, seq_len, batch_rows=1, layout="ring", shards=1, rows=None):
  """A batch producer whose rows all come from one stream of hand-made documents."""
  rows = range(batch_rows) if rows is None else rows
  stream = _Stream(_reader(docs), seq_len, PAD, False)
  return _BatchProducer({0: stream}, 1, batch_rows, rows, seq_len, layout, shards, PAD)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_targets_stay_aligned_after_permutation(layout):
  docs = _documents([37, 90, 11, 64, 120, 5, 70])
  seq_len, shards = 64, 4
  producer = _producer(docs, seq_len, layout=layout, shards=shards)
  plain = _producer(docs, seq_len)
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
  # 40 tokens fill rows 0 and 1 and part of row 2; row 3 of the second batch is padding.
  batches = list(_producer(_documents([20, 20]), seq_len=16, batch_rows=2))
  assert len(batches) == 2 and all(b["tokens"].shape == (2, 16) for b in batches)
  assert batches[1]["segment_ids"][0].any() and not batches[1]["segment_ids"][0].all()
  assert batches[1]["loss_mask"][1].sum() == 0 and batches[1]["segment_ids"][1].sum() == 0
  # Padding counts its positions up, so only its first few could be sink tokens.
  padding = batches[1]["segment_ids"][0] == 0
  assert np.array_equal(batches[1]["positions"][0][padding], np.arange(padding.sum()))
  assert np.array_equal(batches[1]["positions"][1], np.arange(16))


def test_a_process_keeps_its_rows_of_the_one_stream():
  docs = _documents([37, 90, 11, 64, 120, 5, 70])
  whole = next(_producer(docs, 16, batch_rows=4))
  for rows in ([0, 1], [2, 3], [1, 3]):
    part = next(_producer(docs, 16, batch_rows=4, rows=rows))
    for name in packing.FIELDS:
      assert np.array_equal(part[name], whole[name][rows]), name
