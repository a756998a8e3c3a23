"""SentencePiece tokenizers: train one from documents, load one, encode documents for packing."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm

from data.config import RESERVED_PIECES, DataError

# Fixed ids of the tokenizers trained here; a named model brings its own.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
  """A SentencePiece model with the special ids the pipeline needs.

  Padding uses the model's pad id; a model without one pads with EOS (padding is masked).
  A model without BOS or EOS gets no such marker around documents.
  """

  def __init__(self, model_path: str):
    try:
      self._sp = spm.SentencePieceProcessor(model_file=model_path)
    except (OSError, RuntimeError) as error:
      raise DataError(f"cannot load SentencePiece model {model_path}: {error}; "
                      f"fix data.tokenizer or leave it empty to train one") from None
    self.path = model_path
    self.vocab_size: int = self._sp.vocab_size()
    self.bos_id: int = self._sp.bos_id()
    self.eos_id: int = self._sp.eos_id()
    pad = self._sp.pad_id()
    self.pad_id: int = pad if pad >= 0 else max(self.eos_id, 0)
    self._word_tokens: dict[str, int] = {}

  def _token_starts(self, text: str, ids: np.ndarray):
    """A function from a word's first character to the index of its first token.

    Fast path: SentencePiece never lets a piece cross a space, so a word's first token
    follows the tokens of all words before it; per-word token counts are cached (the
    synthetic vocabulary is small). When the counts do not add up (a tokenizer that merges
    across spaces, odd whitespace) it falls back to the offsets SentencePiece reports.
    """
    words = text.split(" ")
    counts = [self._word_tokens[w] if w in self._word_tokens else self._count_tokens(w)
              for w in words]  # 0 is a cached count too (the empty word of a double space)
    if sum(counts) == len(ids):
      word_chars = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
      word_tokens = np.cumsum([0] + counts[:-1])
      return lambda char: int(word_tokens[np.searchsorted(word_chars, char, side="right") - 1])
    proto = self._sp.encode(text, return_type="proto")
    # Offsets are bytes of the UTF-8 text (characters, for ASCII). A piece's span includes
    # the space before its word, so the first piece ending after a word's start is its first.
    ends = np.array([p.end for p in proto.pieces], np.int64)
    return lambda char: int(np.searchsorted(ends, char, side="right"))

  def _count_tokens(self, word: str) -> int:
    count = len(self._sp.encode(word))
    if len(self._word_tokens) < 100_000:  # A cache for small vocabularies, not a leak.
      self._word_tokens[word] = count
    return count

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def encode_document(self, text: str, answer_spans: np.ndarray | None = None,
                      fact_spans: np.ndarray | None = None, bos: bool = True,
                      eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of one document (with BOS/EOS) and, per token, its answer distance.

    A part of a long document has BOS only if it is the first part (`bos`), EOS only if last.

    `answer_spans[i]` and `fact_spans[i]` are [start, end) character spans of an answer word
    and of the earlier word it repeats. The first token of an answer word gets the distance
    in tokens back to the first token of its fact word; all other tokens get 0. Only the
    first token is marked: once it is right, the rest of a word follows without retrieval.
    """
    ids = np.asarray(self._sp.encode(text), np.int32)
    distance = np.zeros(len(ids), np.int32)
    if answer_spans is not None and len(answer_spans):
      starts = self._token_starts(text, ids)
      for (answer_char, _), (fact_char, _) in zip(answer_spans, fact_spans):
        answer, fact = starts(answer_char), starts(fact_char)
        distance[answer] = answer - fact
    head = [self.bos_id] if bos and self.bos_id >= 0 else []
    tail = [self.eos_id] if eos and self.eos_id >= 0 else []
    ids = np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)])
    distance = np.concatenate([np.zeros(len(head), np.int32), distance,
                               np.zeros(len(tail), np.int32)])
    return ids, distance


def train_tokenizer(texts: Iterable[str], output_path: str, vocab_size: int,
                    model_type: str = "bpe") -> str:
  """Trains a SentencePiece model with byte fallback and writes it to `output_path`.

  Ids: pad 0, unk 1, BOS 2, EOS 3. The vocabulary may come out smaller than `vocab_size`
  when the text has fewer distinct pieces (a small corpus); it is never larger.
  """
  if vocab_size <= RESERVED_PIECES:
    raise DataError(f"tokenizer vocab_size={vocab_size} must exceed {RESERVED_PIECES}: byte "
                    f"fallback alone takes 256 pieces plus 4 special ids")
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, byte_fallback=True, pad_id=PAD_ID, unk_id=UNK_ID,
        bos_id=BOS_ID, eos_id=EOS_ID, hard_vocab_limit=False, character_coverage=1.0,
        max_sentence_length=1 << 24, input_sentence_size=200_000,
        shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as error:
    raise DataError(f"SentencePiece training failed: {error}; check the dataset has text and "
                    f"data.tokenizer_vocab_size={vocab_size} suits it") from None
  directory = os.path.dirname(output_path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  # Write then rename, so an interrupted run never leaves a truncated model behind.
  partial = output_path + ".partial"
  with open(partial, "wb") as f:
    f.write(model.getvalue())
  os.replace(partial, output_path)
  return output_path


def check_vocab_size(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  if tokenizer.vocab_size > model_vocab_size:
    raise DataError(
        f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but model.vocab_size="
        f"{model_vocab_size}; raise model.vocab_size to >= {tokenizer.vocab_size} or use a "
        f"smaller tokenizer")
