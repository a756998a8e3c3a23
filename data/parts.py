"""Long documents read in parts: each part is tokenized only when the packer reaches it.

A 50 MB one-line book tokenized in one SentencePiece call stalls the pipeline for tens of
seconds and holds gigabytes of host memory (`scripts/bench_data.py --case 8k`; figures in
docs/data.md and results/bench_data.jsonl). Here a document longer than `PART_CHARS` characters is cut just before a whitespace character
into parts of at most that many characters, and the packer asks for one part at a time
(`packing.Part`). The tokenizers trained here map newlines and tabs to spaces, drop leading
whitespace and never let a piece cross a space, so the parts' ids joined are exactly the
whole document's (tested). Two exceptions, each costing at most one token per cut, once per
`PART_CHARS` characters: a window with no whitespace at all is cut mid-word, and a tokenizer
whose normalizer keeps newlines and tabs (LLaMA's, say) adds a word-start piece at a cut
before one.

Documents with answer spans (the synthetic corpus) are short and always come whole: their
answer distances are counted over the whole document. Changing `PART_CHARS` or the cut rule
moves saved data positions (`data/pipeline.py` STATE_VERSION).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from data.config import DataError
from data.packing import Part

PART_CHARS = 1 << 20  # About 250k tokens of English text per part.
_WHITESPACE = (" ", "\n", "\t", "\r")


def part_bounds(text: str, part_chars: int) -> list[int]:
  """Start offsets of each part, then len(text): parts end just before a whitespace."""
  if part_chars < 1:
    raise ValueError(f"part_chars={part_chars} must be >= 1")
  bounds = [0]
  while len(text) - bounds[-1] > part_chars:
    end = bounds[-1] + part_chars
    cut = max(text.rfind(c, bounds[-1] + 1, end + 1) for c in _WHITESPACE)
    bounds.append(cut if cut > bounds[-1] else end)  # No whitespace at all: cut anyway.
  return bounds + [len(text)]


def bounds_of(text: str, answer_spans) -> list[int]:
  """Where a document's parts start (then its end): one part when it has answer spans."""
  whole = answer_spans is not None and len(answer_spans) > 0
  return [0, len(text)] if whole else part_bounds(text, PART_CHARS)


class DocumentParts:
  """`read(doc, part)` over a stream of documents, tokenizing the requested part only.

  `documents[i]` is a document as `(text, answer_spans, fact_spans)`. The last document read
  (its text and part bounds) and the last part are kept: consecutive rows read them again.
  """

  def __init__(self, documents: Sequence[Any],
               encode: Callable[..., tuple[np.ndarray, np.ndarray]]):
    self._documents, self._encode = documents, encode
    self._doc_index = -1
    self._text, self._answers, self._facts, self._bounds = "", None, None, [0, 0]
    self._part: tuple[int, int, Part] | None = None

  def __call__(self, doc: int, part: int) -> Part | None:
    if self._part is not None and self._part[:2] == (doc, part):
      return self._part[2]
    if doc >= len(self._documents):
      return None
    if doc != self._doc_index:
      self._text, self._answers, self._facts = self._documents[doc]
      self._bounds, self._doc_index = bounds_of(self._text, self._answers), doc
    if part >= len(self._bounds) - 1:
      raise DataError(f"document {doc} of the stream has {len(self._bounds) - 1} part(s), "
                      f"not {part + 1}: the data position was saved with another cut rule")
    last = part == len(self._bounds) - 2
    ids, distance = self._encode(self._text[self._bounds[part]:self._bounds[part + 1]],
                                 self._answers, self._facts, bos=part == 0, eos=last)
    self._part = (doc, part, Part(ids, distance, last))
    return self._part[2]
