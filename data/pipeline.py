"""The checkpointable batch iterator: shard, shuffle, tokenize, pack, permute, prefetch.

Global row r of every batch is packed from its own document stream: the split's records
`r, r + G, r + 2G, ...` (G = global batch rows), shuffled with a seed of its own (afresh each
epoch when repeating) and tokenized lazily by Grain. A process builds only the rows its
devices hold (`rows`), so it reads only those rows' records, and the global batch is the
same whatever the number of processes: a run on 2 hosts sees the batches a run on 1 sees.
Every per-token array is permuted into the sequence layout once, here on the host, and a
Grain thread prefetches `cfg.prefetch` batches in the background.

The state is, per row, where its next piece starts in its stream, `{"doc": j, "offset": o}`:
plain JSON; restoring it replays exactly the batches that would have come next. States of
several processes merge (`merge_states`) into one that any process layout can resume from.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from data import packing, sources
from data.config import DataConfig, DataError
from data.prepare import load_tokenizer
from data.tokenizer import Tokenizer
from parallelism import layouts

STATE_VERSION = 2


class _RowStream:
  """Packs consecutive rows from one (possibly infinite) indexable document stream."""

  def __init__(self, docs: grain.MapDataset, seq_len: int, pad_id: int,
               cross_document_attention: bool):
    self._docs, self._seq_len = docs, seq_len
    self._pad_id, self._cross = pad_id, cross_document_attention
    self.position = packing.StreamPosition()
    self.done = False
    self._cache: tuple[int, Any] = (-1, None)  # The last document read: rows share it.

  def _read(self, index: int):
    if index >= len(self._docs):
      return None
    if self._cache[0] != index:
      self._cache = (index, self._docs[index])
    return self._cache[1]

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
  """Stacks one row from each of this process's row streams into a batch."""

  def __init__(self, streams: dict[int, _RowStream], seq_len: int, layout: str,
               num_shards: int, pad_id: int):
    self._streams = streams  # Global row index -> its stream, in row order.
    self._seq_len, self._layout, self._num_shards = seq_len, layout, num_shards
    self._pad_id = pad_id

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rows = [stream.next_row() for stream in self._streams.values()]
    if all(row is None for row in rows):
      raise StopIteration
    # A finite stream that ran out is filled with padding rows: shapes stay static.
    empty = packing.empty_row(self._seq_len, self._pad_id)
    rows = [empty if row is None else row for row in rows]
    return {name: layouts.permute(np.stack([r[name] for r in rows]), self._layout,
                                  self._num_shards)
            for name in packing.FIELDS}

  def get_state(self) -> dict[str, Any]:
    return {"version": STATE_VERSION, "rows": {
        str(row): {"doc": int(s.position.doc), "offset": int(s.position.offset),
                   "done": s.done} for row, s in self._streams.items()}}

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("version") != STATE_VERSION:
      raise DataError(f"data iterator state version {state.get('version')} is not "
                      f"{STATE_VERSION}: it comes from another pipeline version")
    missing = [row for row in self._streams if str(row) not in state["rows"]]
    if missing:
      raise DataError(f"data iterator state has no position for rows {missing}; it was saved "
                      f"with a different train.batch_size")
    for row, stream in self._streams.items():
      saved = state["rows"][str(row)]
      stream.position = packing.StreamPosition(int(saved["doc"]), int(saved["offset"]))
      stream.done = bool(saved["done"])


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """One state holding every row of several processes' states (rows two hold agree)."""
  rows: dict[str, Any] = {}
  for state in states:
    rows.update(state["rows"])
  return {"version": STATE_VERSION, "rows": dict(sorted(rows.items(), key=lambda kv: int(kv[0])))}


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


def _encoder(cfg: DataConfig, tokenizer: Tokenizer):
  def encode(example: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    text = sources.text_of(cfg, example)
    return tokenizer.encode_document(text, example.get("answer_spans"),
                                     example.get("fact_spans"))

  return encode


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
  if len(source) < global_batch_size:
    raise DataError(f"split '{split}' has {len(source)} documents, fewer than the "
                    f"{global_batch_size} rows of a batch; add documents or lower "
                    f"train.batch_size")
  records = grain.MapDataset.source(source)
  encode = _encoder(cfg, tokenizer)
  streams = {}
  for row in own_rows:
    # Each row reads only its own records, with its own shuffle seed.
    docs = records[row::global_batch_size].shuffle(
        seed=int(np.random.SeedSequence([seed % 2**32, row]).generate_state(1)[0]))
    if repeat:
      docs = docs.repeat()
    streams[row] = _RowStream(docs.map(encode), cfg.seq_len, tokenizer.pad_id,
                              cfg.cross_document_attention)
  producer = _BatchProducer(streams, cfg.seq_len, layout, num_shards, tokenizer.pad_id)
  return DataIterator(producer, cfg.prefetch)


def make_iterator(cfg: DataConfig, split: str, global_batch_size: int, layout: str = "ring",
                  num_shards: int = 1, seed: int = 0, process_index: int = 0,
                  process_count: int = 1, repeat: bool = True,
                  rows: Sequence[int] | None = None) -> DataIterator:
  """Batches of this process's rows of the global batch, from a prepared split.

  `rows` names the global rows this process holds (see `data.process_rows`); by default
  process p of P holds the p-th contiguous block of `global_batch_size // P` rows. Each batch
  is a dict of `[len(rows), cfg.seq_len]` arrays (`packing.FIELDS`), already in `layout` for
  `num_shards` sequence shards. With `repeat=False` the split is read once and rows that
  ran out are padded with masked rows.
  """
  return build_iterator(cfg, load_tokenizer(cfg), split, global_batch_size, layout, num_shards,
                        seed, process_index, process_count, repeat, rows)
