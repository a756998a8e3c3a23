"""The checkpointable batch iterator: shuffle, tokenize, pack, permute, prefetch.

The split's documents are shuffled together (afresh each epoch when repeating) and dealt in
turn to K document streams, K = min(rows of the global batch G, documents in the split).
Each stream is cut end to end into rows of `seq_len` tokens, and row r of every batch is the
next row of stream r mod K. So a corpus of any size trains (two books fill a batch of 8 rows),
a long document runs on across rows and batches of its stream, and with a large corpus each
row has a stream of its own. A process walks only the streams its devices' rows (`rows`)
come from: with K = G it reads and tokenizes only its own rows. K depends on G and the
corpus alone, so the global batch is the same whatever the number of processes: a run on 2
hosts sees the batches a run on 1 sees. Long documents are tokenized a part at a time as the
rows reach them (`data/parts.py`). Every per-token array is permuted into the sequence layout
once, here on the host, and a Grain thread prefetches `cfg.prefetch` batches in the background.

The state is, per stream, where its next row starts, `{"doc": j, "part": p, "offset": o}`:
plain JSON; restoring it replays exactly the batches that would have come next. States of
several processes merge (`merge_states`) into one that any process layout can resume from.

Grain's own packing (`ConcatThenSplitIterDataset`) was considered and not used: it passes
whole-length documents ahead of partly filled rows and pads the rows it closes, it has no
one-token overlap between rows (a token that ends a row would never be a target), and it
restores by replaying from its last checkpointed buffer; the packer here is 60 lines.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from data import packing, sources
from data.config import DataConfig, DataError
from data.parts import DocumentParts
from data.prepare import load_tokenizer
from data.tokenizer import Tokenizer
from parallelism import layouts

STATE_VERSION = 3  # 2 had a document stream per row, each over its own slice of the split.


class _Stream:
  """Packs consecutive rows from one (possibly infinite) stream of documents."""

  def __init__(self, read: Callable[[int, int], packing.Part | None], seq_len: int,
               pad_id: int, cross_document_attention: bool):
    self._read, self._seq_len = read, seq_len
    self._pad_id, self._cross = pad_id, cross_document_attention
    self.position = packing.StreamPosition()
    self.done = False

  def next_row(self) -> dict[str, np.ndarray] | None:
    if not self.done:
      packed = packing.pack_row(self._read, self.position, self._seq_len, self._pad_id,
                                self._cross)
      if packed is not None:
        row, self.position = packed
        return row
      self.done = True
    return None


class _BatchProducer:
  """Row r of each batch from stream r mod K; keeps this process's rows, in order."""

  def __init__(self, streams: dict[int, _Stream], stream_count: int, batch_rows: int,
               rows: Sequence[int], seq_len: int, layout: str, num_shards: int, pad_id: int):
    self._streams = streams  # Only the streams this process's rows come from.
    self._stream_count, self._batch_rows, self._rows = stream_count, batch_rows, set(rows)
    self._layout, self._num_shards = layout, num_shards
    # Stands in for the rows of a finite stream that ran out: shapes stay static.
    self._empty = packing.empty_row(seq_len, pad_id)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rows = []
    for row in range(self._batch_rows):
      stream = self._streams.get(row % self._stream_count)
      if stream is not None:  # Its rows that other processes hold still move it on.
        packed = stream.next_row()
        if row in self._rows:
          rows.append(packed)
    if all(row is None for row in rows):
      raise StopIteration
    rows = [self._empty if row is None else row for row in rows]
    return {name: layouts.permute(np.stack([r[name] for r in rows]), self._layout,
                                  self._num_shards)
            for name in packing.FIELDS}

  def get_state(self) -> dict[str, Any]:
    return {"version": STATE_VERSION, "stream_count": self._stream_count, "streams": {
        str(k): {"doc": int(s.position.doc), "part": int(s.position.part),
                 "offset": int(s.position.offset), "done": s.done}
        for k, s in self._streams.items()}}

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("version") != STATE_VERSION:
      raise DataError(f"data iterator state version {state.get('version')} is not "
                      f"{STATE_VERSION}: it was saved by another version of the data pipeline; "
                      f"resume with the code that started the run, or start a new run")
    if state["stream_count"] != self._stream_count:
      raise DataError(f"data iterator state has {state['stream_count']} document streams, this "
                      f"run {self._stream_count}: train.batch_size or the split's documents "
                      f"changed since it was saved")
    missing = [k for k in self._streams if str(k) not in state["streams"]]
    if missing:
      raise DataError(f"data iterator state has no position for streams {missing}; it holds "
                      f"only some processes' streams")
    for k, stream in self._streams.items():
      saved = state["streams"][str(k)]
      stream.position = packing.StreamPosition(int(saved["doc"]), int(saved["part"]),
                                               int(saved["offset"]))
      stream.done = bool(saved["done"])


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """One state holding every stream of several processes' states (streams two hold agree)."""
  streams: dict[str, Any] = {}
  for state in states:
    streams.update(state["streams"])
  return {**states[0], "streams": dict(sorted(streams.items(), key=lambda kv: int(kv[0])))}


class DataIterator:
  """Batches of `[rows, seq_len]` NumPy arrays; `get_state`/`set_state` give exact resume."""

  def __init__(self, producer: _BatchProducer, prefetch: int):
    self._producer = producer
    self._prefetch = prefetch
    # Only this list holds the (Grain prefetch) iterator, so that the finalizer can release
    # it at exit while modules still exist: Grain's __del__ fails during interpreter teardown.
    self._holder = [self._wrap()]
    weakref.finalize(self, _release, self._holder)

  @property
  def _iterator(self):
    return self._holder[0]

  def _wrap(self):
    if not self._prefetch:
      return self._producer
    return grain.experimental.ThreadPrefetchDatasetIterator(self._producer, self._prefetch)

  def __iter__(self) -> DataIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position of the next batch (prefetched batches are not counted)."""
    return copy.deepcopy(self._iterator.get_state())

  def set_state(self, state: dict[str, Any]) -> None:
    self._iterator.set_state(copy.deepcopy(state))

  def close(self) -> None:
    if hasattr(self._iterator, "close"):
      self._iterator.close()


def _release(holder: list) -> None:
  iterator = holder.pop()
  if hasattr(iterator, "close"):
    iterator.close()
  holder.append(None)


def check_layout(seq_len: int, layout: str, num_shards: int) -> None:
  """DataError unless `seq_len` splits evenly over the sequence shards of `layout`."""
  try:
    layouts.check_seq_len(seq_len, layout, num_shards, name="data.seq_len")
  except ValueError as e:
    raise DataError(f"{e}; change data.seq_len or mesh.sequence") from None


def _own_rows(global_batch_size: int, process_index: int, process_count: int,
              rows: Sequence[int] | None) -> list[int]:
  if global_batch_size <= 0 or global_batch_size % process_count:
    raise DataError(f"global batch size {global_batch_size} must be a positive multiple of "
                    f"the process count {process_count}; change train.batch_size")
  if not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index} is outside [0, {process_count})")
  if rows is None:  # Contiguous blocks of rows per process, in process order.
    per_process = global_batch_size // process_count
    return list(range(process_index * per_process, (process_index + 1) * per_process))
  rows = sorted(set(int(r) for r in rows))
  if not rows or rows[0] < 0 or rows[-1] >= global_batch_size:
    raise DataError(f"rows {rows} must be a non-empty subset of 0..{global_batch_size - 1}")
  return rows


def build_iterator(cfg: DataConfig, tokenizer: Tokenizer, split: str, global_batch_size: int,
                   layout: str, num_shards: int, seed: int, process_index: int,
                   process_count: int, repeat: bool,
                   rows: Sequence[int] | None = None) -> DataIterator:
  check_layout(cfg.seq_len, layout, num_shards)
  own_rows = _own_rows(global_batch_size, process_index, process_count, rows)
  source = sources.split_source(cfg, split)
  stream_count = min(global_batch_size, len(source))
  # Shuffled before it is repeated: grain reseeds the shuffle for each epoch (index // len).
  documents = grain.MapDataset.source(source).shuffle(
      seed=int(np.random.SeedSequence(seed % 2**32).generate_state(1)[0]))
  if repeat:
    documents = documents.repeat()
  documents = documents.map(functools.partial(sources.document_of, cfg))
  streams = {}
  for k in sorted({row % stream_count for row in own_rows}):
    read = DocumentParts(documents[k::stream_count], tokenizer.encode_document)
    streams[k] = _Stream(read, cfg.seq_len, tokenizer.pad_id, cfg.cross_document_attention)
  producer = _BatchProducer(streams, stream_count, global_batch_size, own_rows, cfg.seq_len,
                            layout, num_shards, tokenizer.pad_id)
  return DataIterator(producer, cfg.prefetch)


def make_iterator(cfg: DataConfig, split: str, global_batch_size: int, layout: str = "ring",
                  num_shards: int = 1, seed: int = 0, process_index: int = 0,
                  process_count: int = 1, repeat: bool = True,
                  rows: Sequence[int] | None = None) -> DataIterator:
  """Batches of this process's rows of the global batch, from a prepared split.

  `rows` names the global rows this process holds (see `data.process_rows`); by default
  process p of P holds the p-th contiguous block of `global_batch_size // P` rows. Each batch
  is a dict of `[len(rows), cfg.seq_len]` arrays (`packing.FIELDS`), already in `layout` for
  `num_shards` sequence shards. With `repeat=False` the split is read once and the rows after
  its end are padded with masked rows.
  """
  return build_iterator(cfg, load_tokenizer(cfg), split, global_batch_size, layout, num_shards,
                        seed, process_index, process_count, repeat, rows)
