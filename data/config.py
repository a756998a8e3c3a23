"""The data pipeline's frozen, typed configuration and its one error type."""

from __future__ import annotations

import dataclasses

DATASETS_BUILT_IN = ("synthetic_longrange", "text_files")
BAD_FILE_POLICIES = ("skip", "fail")
TOKENIZER_TYPES = ("bpe", "unigram")
# Pieces a trained tokenizer holds before any learned one: byte fallback's 256 and 4 special ids.
RESERVED_PIECES = 256 + 4


class DataError(ValueError):
  """Data that cannot be read or used; the one-line message names what to fix."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Everything the pipeline reads from `config.data`. Field meanings: configs/base.py.

  The fields are exactly the keys of the `config.data` block, so that
  `DataConfig(**config.data.to_dict())` works and a new key fails loudly.
  """

  dataset: str = "synthetic_longrange"
  seq_len: int = 256
  tokenizer: str = ""
  tokenizer_vocab_size: int = 512
  tokenizer_type: str = "bpe"
  data_dir: str = ".data"
  path: str = ""
  text_field: str = "text"
  train_split: str = "train"
  eval_split: str = "validation"
  cross_document_attention: bool = False
  num_documents: int = 2000
  num_eval_documents: int = 200
  max_document_tokens: int = 1024
  corpus_seed: int = 0
  on_bad_file: str = "skip"
  prefetch: int = 2

  def __post_init__(self):
    if self.seq_len <= 0:
      raise DataError(f"data.seq_len={self.seq_len} must be positive")
    if self.on_bad_file not in BAD_FILE_POLICIES:
      raise DataError(f"data.on_bad_file='{self.on_bad_file}' must be one of {BAD_FILE_POLICIES}")
    if self.tokenizer_type not in TOKENIZER_TYPES:
      raise DataError(
          f"data.tokenizer_type='{self.tokenizer_type}' must be one of {TOKENIZER_TYPES}")
    if self.prefetch < 0:
      raise DataError(f"data.prefetch={self.prefetch} must be >= 0")
    if self.dataset == "synthetic_longrange":
      self._check_synthetic()
    if not self.data_dir:
      raise DataError("data.data_dir is empty; name a directory for prepared data")

  def _check_synthetic(self):
    # Preparation writes both splits whether or not evals run (TFDS refuses an empty one),
    # and the corpus's identity names both sizes.
    for field in ("num_documents", "num_eval_documents", "max_document_tokens"):
      if getattr(self, field) < 1:
        raise DataError(f"data.{field}={getattr(self, field)} must be >= 1")
    if self.corpus_seed < 0:  # NumPy's seed sequences take no negative entropy.
      raise DataError(f"data.corpus_seed={self.corpus_seed} must be >= 0")
