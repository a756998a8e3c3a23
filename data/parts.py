"""Long documents read in parts: each part is tokenized only when the packer reaches it.

A whole 50 MB book tokenized in one SentencePiece call took 3.5 GB of host memory and stalled
training for 42 s. Here a document longer than `PART_CHARS` characters is cut just before a
whitespace character into parts of at most that many characters, and the packer asks for
one part at a time (`packing.Part`). SentencePiece never lets a piece cross whitespace and
the tokenizers trained here drop leading whitespace before their own word-start marker, so the
parts' ids joined are exactly the whole document's (tested). A tokenizer that keeps leading
spaces may differ in one token per cut, once per `PART_CHARS` characters.

Documents with answer spans (the synthetic corpus) are short and always come whole: their
answer distances are counted over the whole document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from data.packing import Part

PART_CHARS = 1 << 20  # About 250k tokens of English text per part.
_WHITESPACE = (" ", "\n", "\t", "\r")


def part_bounds(text: str, part_chars: int) -> list[int]:
  """Start offsets of each part, then len(text): parts end just before a whitespace."""
  bounds = [0]
  while len(text) - bounds[-1] > part_chars:
    end = bounds[-1] + part_chars
    cut = max(text.rfind(c, bounds[-1] + 1, end + 1) for c in _WHITESPACE)
    bounds.append(cut if cut > bounds[-1] else end)  # No whitespace at all: cut anyway.
  return bounds + [len(text)]


class DocumentParts:
  """`read(doc, part)` over a stream of documents, tokenizing the current part only.

  `documents[i]` is a document as `(text, answer_spans, fact_spans)`; the last document read
  and its last part read are kept, because consecutive rows read them again.
  """

  def __init__(self, documents: Sequence[Any], encode: Callable[..., tuple[np.ndarray, np.ndarray]],
               part_chars: int = PART_CHARS):
    self._documents, self._encode, self._part_chars = documents, encode, part_chars
    self._doc: tuple[int, str, Any, Any, list[int]] | None = None
    self._part: tuple[int, int, Part] | None = None

  def __call__(self, doc: int, part: int) -> Part | None:
    if self._part is not None and self._part[:2] == (doc, part):
      return self._part[2]
    if doc >= len(self._documents):
      return None
    if self._doc is None or self._doc[0] != doc:
      text, answers, facts = self._documents[doc]
      whole = answers is not None and len(answers)
      bounds = [0, len(text)] if whole else part_bounds(text, self._part_chars)
      self._doc = (doc, text, answers, facts, bounds)
    _, text, answers, facts, bounds = self._doc
    if part >= len(bounds) - 1:
      raise IndexError(f"document {doc} has {len(bounds) - 1} parts, not {part + 1}")
    last = part == len(bounds) - 2
    ids, distance = self._encode(text[bounds[part]:bounds[part + 1]], answers, facts,
                                 bos=part == 0, eos=last)
    self._part = (doc, part, Part(ids, distance, last))
    return self._part[2]
