"""One-time preparation under `data_dir`: the dataset's array_record files and a tokenizer.

Layout of `data_dir`: TFDS's own `<dataset>/<config>/<version>/` folders, and
`tokenizers/<dataset>-<config>-<type><vocab>.model` for tokenizers trained here.
Both steps are skipped when their output exists, so `prepare` is cheap to call every run.
"""

from __future__ import annotations

import os
import time

from data import sources
from data.config import DataConfig, DataError
from data.tokenizer import Tokenizer, check_vocab_size, train_tokenizer

# Documents sampled (evenly over the train split) to train a tokenizer at preparation.
TOKENIZER_TRAINING_DOCUMENTS = 20_000


def tokenizer_path(cfg: DataConfig) -> str:
  """`cfg.tokenizer` when named, else where preparation puts the one it trains."""
  if cfg.tokenizer:
    return cfg.tokenizer
  name = f"{sources.storage_name(cfg)}-{cfg.tokenizer_type}{cfg.tokenizer_vocab_size}.model"
  return os.path.join(cfg.data_dir, "tokenizers", name)


def prepare(cfg: DataConfig) -> None:
  """Builds the dataset and, when `cfg.tokenizer` is empty, trains its tokenizer; idempotent."""
  start = time.monotonic()
  sources.prepare_dataset(cfg)
  path = tokenizer_path(cfg)
  if cfg.tokenizer:
    if not os.path.isfile(path):
      raise DataError(f"data.tokenizer={path} does not exist; fix the path or leave it empty "
                      f"to train one")
  elif not os.path.isfile(path):
    sources.require_writable(cfg, "its tokenizer is not trained there yet",
                             "set data.tokenizer to a SentencePiece model that exists")
    print(f"training a {cfg.tokenizer_type} tokenizer ({cfg.tokenizer_vocab_size} pieces) on "
          f"'{cfg.dataset}' split '{cfg.train_split}' -> {path}", flush=True)
    texts = sources.iter_texts(cfg, cfg.train_split, TOKENIZER_TRAINING_DOCUMENTS)
    train_tokenizer(texts, path, cfg.tokenizer_vocab_size, cfg.tokenizer_type)
  elapsed = time.monotonic() - start
  if elapsed > 1.0:
    print(f"data prepared under {cfg.data_dir} in {elapsed:.1f}s", flush=True)


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
  path = tokenizer_path(cfg)
  if not os.path.isfile(path):
    raise DataError(f"no tokenizer at {path}; run data.prepare(cfg) first"
                    + ("" if not cfg.tokenizer else " or fix data.tokenizer"))
  return Tokenizer(path)


def check_vocab(cfg: DataConfig, model_vocab_size: int) -> None:
  """DataError when the tokenizer has more pieces than the model has embedding rows."""
  check_vocab_size(load_tokenizer(cfg), model_vocab_size)
