"""Packing tokenized documents end to end into rows of `seq_len` (+1 for the targets).

The stream of documents is cut into rows with no padding except at the very end of a finite
stream: row k holds stream tokens [k*S, k*S + S] (S + 1 of them; the last is only a target
and is also the first token of row k + 1), so every document token is a `tokens` entry
exactly once. A document longer than the rest of a row continues in the next row. A long
document arrives in parts (tokenized one at a time, data/parts.py); its parts join into one
piece, as if it had come whole.

Per row (before any layout permutation):
- `tokens`, `targets` (= the next stream token), int32.
- `loss_mask` float32: 1 where the target belongs to the same document piece as the token;
  0 where a target crosses into the next document and on padding.
- `positions`: 0, 1, ... from the start of each document piece. A document continued from the
  previous row restarts at 0 there too: the model cannot see the earlier row anyway. Padding
  counts up as one more piece: its first tokens only are "sinks" (`model.sink_tokens` keys
  below position k), so a padded row costs the sink table no more than a document does.
- `segment_ids`: 1, 2, ... per document piece within the row (all 1 with
  `cross_document_attention`); 0 on padding.
- `token_index`: 0..S-1.
- `answer_distance`: d > 0 at position i when `targets[i]` is an answer token whose fact lies
  d tokens earlier in the same piece (so it can be retrieved); else 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

# What a train step reads: what reaches the devices.
TRAIN_FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")
# Host-side only: `token_index` (the tests read a layout's order from it) and the retrieval
# evaluator's `answer_distance`.
FIELDS = (*TRAIN_FIELDS, "token_index", "answer_distance")


@dataclasses.dataclass
class StreamPosition:
  """Where the next row starts: `offset` tokens into part `part` of document `doc`."""

  doc: int = 0
  part: int = 0
  offset: int = 0


class Part(NamedTuple):
  """A run of one document's tokens: the whole document, or one of its parts when long."""

  ids: np.ndarray
  answer_distance: np.ndarray
  last: bool  # The document's last part.


def pack_row(read: Callable[[int, int], Part | None], start: StreamPosition, seq_len: int,
             pad_id: int, cross_document_attention: bool,
             ) -> tuple[dict[str, np.ndarray], StreamPosition] | None:
  """Packs one row from `start`; returns it and where the next row starts, or None at the end.

  `read(doc, part)` gives that part of document `doc` of the stream, or None past the end.
  The parts of one document continue one piece: same segment, positions counting on.
  """
  need = seq_len + 1
  ids, dist, pos, piece = [], [], [], []
  doc, part, offset = start.doc, start.part, start.offset
  filled = pieces = piece_length = 0
  piece_doc = None
  last = start
  while filled < need:
    chunk = read(doc, part)
    if chunk is None:
      break
    take = min(len(chunk.ids) - offset, need - filled)
    if take > 0:
      if doc != piece_doc:
        pieces, piece_doc, piece_length = pieces + 1, doc, 0
      ids.append(chunk.ids[offset:offset + take])
      # An answer is retrievable only when its fact is inside this piece.
      local = piece_length + np.arange(take, dtype=np.int32)
      d = chunk.answer_distance[offset:offset + take]
      dist.append(np.where(local - d >= 0, d, 0))
      pos.append(local)
      piece.append(np.full(take, pieces, np.int32))
      last = StreamPosition(doc, part, offset + take - 1)
      filled, offset, piece_length = filled + take, offset + take, piece_length + take
    if offset >= len(chunk.ids):  # Used up (or empty): on to the next part or document.
      doc, part, offset = (doc + 1, 0, 0) if chunk.last else (doc, part + 1, 0)
  if filled == 0:
    return None
  # A full row's last token (a target only) starts the next row; a short row ends the stream.
  next_start = last if filled == need else StreamPosition(doc, part, offset)
  pad = need - filled
  ids_ = np.concatenate(ids + [np.full(pad, pad_id, np.int32)])
  dist_ = np.concatenate(dist + [np.zeros(pad, np.int32)])
  pos_ = np.concatenate(pos + [np.arange(pad, dtype=np.int32)])
  piece_ = np.concatenate(piece + [np.zeros(pad, np.int32)])
  same = (piece_[1:] == piece_[:-1]) & (piece_[:-1] > 0)
  segments = piece_[:-1]
  if cross_document_attention:
    segments = (segments > 0).astype(np.int32)
  row = {
      "tokens": ids_[:-1].astype(np.int32),
      "targets": ids_[1:].astype(np.int32),
      "loss_mask": same.astype(np.float32),
      "positions": pos_[:-1].astype(np.int32),
      "segment_ids": segments.astype(np.int32),
      "token_index": np.arange(seq_len, dtype=np.int32),
      "answer_distance": np.where(same, dist_[1:], 0).astype(np.int32),
  }
  return row, next_start


def empty_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """An all-padding row: fills the last batch of a finite stream to full size."""
  row = {name: np.zeros(seq_len, np.int32) for name in FIELDS}
  row["tokens"][:] = pad_id
  row["targets"][:] = pad_id
  row["loss_mask"] = np.zeros(seq_len, np.float32)
  row["positions"] = np.arange(seq_len, dtype=np.int32)  # As padding in `pack_row`.
  row["token_index"] = np.arange(seq_len, dtype=np.int32)
  return row
