"""The synthetic corpus through TFDS, SentencePiece and the checkpointable iterator."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import data
from data import synthetic
from parallelism import layouts


@pytest.fixture(scope="session")
def small_cfg(tmp_path_factory):
  """A prepared 96-document synthetic corpus and its tokenizer, shared by this file."""
  cfg = data.DataConfig(data_dir=str(tmp_path_factory.mktemp("synthetic")), seq_len=64,
                        num_documents=96, num_eval_documents=16, max_document_tokens=300,
                        prefetch=2)
  data.prepare(cfg)
  return cfg


def test_config_fields_match_the_config_block():
  from configs import base
  keys = set(base.get_config().data.to_dict())
  assert keys == {f.name for f in dataclasses.fields(data.DataConfig)}
  data.DataConfig(**base.get_config().data.to_dict())


def test_corpus_is_deterministic_for_a_seed():
  a = [synthetic.make_document(7, 0, i, 500) for i in range(20)]
  b = [synthetic.make_document(7, 0, i, 500) for i in range(20)]
  c = [synthetic.make_document(8, 0, i, 500) for i in range(20)]
  assert [d.text for d in a] == [d.text for d in b]
  assert all(np.array_equal(x.answer_spans, y.answer_spans) for x, y in zip(a, b))
  assert [d.text for d in a] != [d.text for d in c]
  words = set(synthetic.vocabulary())
  assert 200 <= len(words) <= 400
  for doc in a:
    assert set(doc.text.split()) <= words
    for (a0, a1), (f0, f1) in zip(doc.answer_spans, doc.fact_spans):
      assert doc.text[a0:a1] == doc.text[f0:f1] and f0 < a0  # The answer repeats its fact.


def test_prepared_records_match_the_generator_and_prepare_is_idempotent(small_cfg, capsys):
  from data import sources
  data.prepare(small_cfg)  # Already prepared: nothing rebuilt, nothing printed.
  assert "preparing" not in capsys.readouterr().out
  source = sources.split_source(small_cfg, "train")
  assert len(source) == 96
  texts = {sources.text_of(small_cfg, source[i]) for i in range(len(source))}
  expected = {synthetic.make_document(0, 0, i, 300).text for i in range(96)}
  assert texts == expected


def test_tokenizer_ids_and_vocab_check(small_cfg):
  tok = data.load_tokenizer(small_cfg)
  assert tok.vocab_size <= 512 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  text = synthetic.make_document(0, 0, 0, 300).text
  assert tok.decode(tok.encode(text)) == text
  data.check_vocab(small_cfg, 512)
  with pytest.raises(data.DataError, match="model.vocab_size"):
    data.check_vocab(small_cfg, 100)


def test_batch_fields_and_answers(small_cfg):
  it = data.make_iterator(small_cfg, split="train", global_batch_size=4, layout="ring",
                          num_shards=1, seed=0)
  tok = data.load_tokenizer(small_cfg)
  answers = 0
  for _ in range(10):  # Answers retrievable inside 64 tokens are rare: read enough.
    batch = next(it)
    assert set(batch) == set(data.FIELDS)
    for name, value in batch.items():
      assert value.shape == (4, 64)
      assert value.dtype == (np.float32 if name == "loss_mask" else np.int32), name
    assert np.all(batch["segment_ids"] >= 1)  # An endless stream has no padding.
    for r, i in zip(*np.nonzero(batch["answer_distance"])):
      d = batch["answer_distance"][r, i]
      # The target is an answer token and the same token stands d tokens earlier (the fact).
      assert batch["tokens"][r, i + 1 - d] == batch["targets"][r, i]
      assert tok.decode(batch["tokens"][r, max(i - 3, 0):i + 1]).endswith("it is")
      answers += 1
  assert answers > 0


@pytest.mark.parametrize("layout,skip", [("striped", 5), ("zigzag", 70)])
def test_save_restore_gives_identical_next_batches(small_cfg, layout, skip):
  make = lambda: data.make_iterator(small_cfg, split="train", global_batch_size=4,
                                    layout=layout, num_shards=4, seed=3)
  it = make()
  for _ in range(skip):  # 70 batches is past the first epoch (~55 batches).
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(3)]
  fresh = make()
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    for name in data.FIELDS:
      assert np.array_equal(got[name], want[name]), name
  it.set_state(state)  # The same iterator rewinds too (prefetched batches are dropped).
  assert np.array_equal(next(it)["tokens"], expected[0]["tokens"])


def test_finite_read_yields_every_token_once_and_epochs_reshuffle(small_cfg):
  tok = data.load_tokenizer(small_cfg)
  it = data.make_iterator(small_cfg, split="validation", global_batch_size=2, repeat=False)
  tokens = sum(int((b["segment_ids"] > 0).sum()) for b in it)
  expected = sum(len(tok.encode(synthetic.make_document(0, 1, i, 300).text)) + 2
                 for i in range(16))
  assert tokens == expected  # Every validation token exactly once.

  # Repeating, the second epoch has the same documents in another order. A batch of one row
  # reads one stream, cut end to end into rows, so concatenated rows give the stream back.
  it = data.make_iterator(small_cfg, split="validation", global_batch_size=1)
  stream = []
  while stream.count(tok.bos_id) <= 32:
    stream += [int(t) for t in next(it)["tokens"].reshape(-1)]
  starts = [i for i, t in enumerate(stream) if t == tok.bos_id]
  docs = [tuple(stream[a:b]) for a, b in zip(starts, starts[1:])]
  assert sorted(docs[:16]) == sorted(docs[16:32]) and docs[:16] != docs[16:32]


def test_processes_hold_disjoint_rows(small_cfg):
  seen = []
  for index in range(2):
    it = data.make_iterator(small_cfg, split="train", global_batch_size=4, seed=0,
                            process_index=index, process_count=2, repeat=False)
    batch = next(it)
    assert batch["tokens"].shape == (2, 64)
    # Padding rows (a stream that ran out) are alike everywhere; real rows never are.
    seen.append({tuple(r) for b in [batch, *it]
                 for r, segments in zip(b["tokens"], b["segment_ids"]) if segments.any()})
  assert not seen[0] & seen[1]


def test_global_batch_does_not_depend_on_the_process_count(small_cfg):
  make = lambda **kw: data.make_iterator(small_cfg, split="train", global_batch_size=4,
                                         layout="striped", num_shards=2, seed=5, **kw)
  whole, halves = make(), [make(process_index=p, process_count=2) for p in range(2)]
  for _ in range(3):
    expected = next(whole)
    parts = [next(half) for half in halves]
    for name in data.FIELDS:
      assert np.array_equal(np.concatenate([p[name] for p in parts]), expected[name]), name
  # Both halves' states merge into the one-process state and resume it exactly.
  merged = data.pipeline.merge_states([half.get_state() for half in halves])
  assert merged == whole.get_state()
  resumed = make(rows=[2, 3])
  resumed.set_state(merged)
  assert np.array_equal(next(resumed)["tokens"], next(whole)["tokens"][2:])


def test_process_rows_follow_the_sharding():
  mesh = jax.make_mesh((2, 4), ("fsdp", "sequence"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "sequence"))
  assert data.process_rows(sharding, 8, 64) == list(range(8))  # One process holds every row.


def test_to_global_batch_shards_over_the_mesh(small_cfg):
  mesh = jax.make_mesh((2, 4), ("fsdp", "sequence"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "sequence"))
  batch = next(data.make_iterator(small_cfg, split="train", global_batch_size=4,
                                  layout="striped", num_shards=4))
  global_batch = data.to_global_batch(batch, sharding)
  for name, value in global_batch.items():
    assert value.shape == (4, 64) and value.sharding == sharding
    assert np.array_equal(np.asarray(value), batch[name])
  assert np.array_equal(layouts.unpermute(np.asarray(global_batch["token_index"]), "striped", 4),
                        np.broadcast_to(np.arange(64), (4, 64)))


def test_seq_len_must_divide_over_sequence_shards(small_cfg):
  with pytest.raises(data.DataError, match="data.seq_len=64 must be divisible by 12"):
    data.make_iterator(small_cfg, split="train", global_batch_size=4, layout="zigzag",
                       num_shards=6)
  with pytest.raises(data.DataError, match="divisible by 3"):
    data.make_iterator(small_cfg, split="train", global_batch_size=4, layout="ring",
                       num_shards=3)


@pytest.mark.parametrize("fallback", [False, True])
def test_answer_token_positions_match_sentencepiece_offsets(small_cfg, fallback):
  tok = data.load_tokenizer(small_cfg)
  if fallback:  # Wrong cached word lengths: the counts do not add up, offsets are used.
    tok._word_tokens.update({word: 9 for word in synthetic.vocabulary()})
  for i in range(20):
    doc = synthetic.make_document(0, 0, i, 300)
    ids, distance = tok.encode_document(doc.text, doc.answer_spans, doc.fact_spans)
    proto = tok._sp.encode(doc.text, return_type="proto")
    first_piece = lambda char: 1 + next(k for k, p in enumerate(proto.pieces) if p.end > char)
    expected = np.zeros_like(distance)
    for (answer, _), (fact, _) in zip(doc.answer_spans, doc.fact_spans):
      expected[first_piece(answer)] = first_piece(answer) - first_piece(fact)
    assert np.array_equal(distance, expected)
    assert (distance > 0).sum() == len(doc.answer_spans)
