"""Which TFDS builder a config names, preparing it once, and reading its documents.

Everything is stored as array_record files and read with `tfds` data sources, so no
TensorFlow is needed: TFDS serialises examples with its own protobufs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from data import parts, synthetic, text_files
from data.config import DataConfig, DataError

FILE_FORMAT = "array_record"
# Registered datasets that TFDS downloads itself, with the optional extra (pyproject.toml)
# their builders need.
EXTRAS = {"pg19": "pg19"}


def dataset_builder(cfg: DataConfig) -> tfds.core.DatasetBuilder:
  """The builder for `cfg.dataset`, rooted at `cfg.data_dir` (nothing is built here)."""
  with _quiet_absl():
    return _builder(cfg)


@contextlib.contextmanager
def _quiet_absl():
  # TFDS warns "Using custom data configuration" on every builder made from a config
  # object, which is how all of ours are made: expected, so not worth a line each time.
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _is_prepared(builder: tfds.core.DatasetBuilder) -> bool:
  # TFDS warns "Variant folder ... has no dataset_info.json" for a dataset not prepared yet,
  # which every first run is: the line that follows ("preparing ...") says it better.
  with _quiet_absl():
    return builder.is_prepared()


def _builder(cfg: DataConfig) -> tfds.core.DatasetBuilder:
  if cfg.dataset == "synthetic_longrange":
    config = synthetic.SyntheticLongrangeConfig(
        num_documents=cfg.num_documents, num_eval_documents=cfg.num_eval_documents,
        max_document_tokens=cfg.max_document_tokens, seed=cfg.corpus_seed)
    # TFDS refuses an instance equal to a predefined config, but takes its name.
    predefined = {c.name for c in synthetic.SyntheticLongrange.BUILDER_CONFIGS}
    return synthetic.SyntheticLongrange(
        config=config.name if config.name in predefined else config, data_dir=cfg.data_dir,
        file_format=FILE_FORMAT)
  if cfg.dataset == "text_files":
    config = text_files.TextFilesConfig(path=cfg.path, text_field=cfg.text_field,
                                        on_bad_file=cfg.on_bad_file)
    return text_files.TextFiles(config=config, data_dir=cfg.data_dir, file_format=FILE_FORMAT)
  return _registered_builder(cfg)


def _registered_builder(cfg: DataConfig) -> tfds.core.DatasetBuilder:
  downloads = cfg.dataset in EXTRAS  # Prepared into an empty data_dir, not looked up there.
  if not downloads and (not os.path.isdir(cfg.data_dir) or not os.listdir(cfg.data_dir)):
    raise DataError(f"data.data_dir={cfg.data_dir} is missing or empty; prepare "
                    f"'{cfg.dataset}' there with TFDS (file_format='array_record') or fix the path")
  try:
    return tfds.builder(cfg.dataset, data_dir=cfg.data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise DataError(f"data.dataset='{cfg.dataset}' is neither synthetic_longrange, text_files, "
                    f"a registered TFDS name nor prepared under data.data_dir={cfg.data_dir}"
                    ) from None


def prepare_dataset(cfg: DataConfig) -> tfds.core.DatasetBuilder:
  """Builds the dataset's array_record files under `cfg.data_dir` unless already there."""
  builder = dataset_builder(cfg)
  if _is_prepared(builder):
    _check_format(cfg, builder)
    return builder
  built_in = cfg.dataset in ("synthetic_longrange", "text_files")
  name = (f"{cfg.dataset} ({builder.builder_config.name})" if built_in
          else f"TFDS dataset '{cfg.dataset}'")
  require_writable(cfg, f"{name} is not prepared there",
                   "prepare it with this config where one is and copy it here")
  # A registered dataset may need a download; TFDS raises if it cannot get one.
  print(f"preparing {name} under {cfg.data_dir}", flush=True)
  # TFDS's nested bars redraw with carriage returns and cursor-up escapes: on a terminal that
  # is progress, in a job's log file it is kilobytes of escapes and blanks per split.
  tfds.display_progress_bar(sys.stderr.isatty())
  try:
    builder.download_and_prepare(
        file_format=FILE_FORMAT,
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  except DataError:
    raise
  except Exception as error:  # TFDS and download errors come in many types.
    if built_in:
      raise
    raise _preparation_error(cfg, error) from None
  return builder


def require_writable(cfg: DataConfig, need: str, other_way: str) -> None:
  """Makes `cfg.data_dir` and writes a probe file there; a DataError naming the folder, the
  OS's reason, what needed writing and how else to get it, instead of an OSError from deep in
  TFDS or SentencePiece."""
  try:
    os.makedirs(cfg.data_dir, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=cfg.data_dir, prefix=".write-check-")
    os.close(fd)
    os.remove(probe)
  except OSError as error:
    raise DataError(f"data.data_dir={cfg.data_dir} cannot be written ({error.strerror or error})"
                    f", and {need}: set data.data_dir to a writable folder, or {other_way}"
                    ) from None


_NETWORK_WORDS = ("resolve", "connect", "network", "unreachable", "timed out", "timeout",
                  "name or service", "could not reach", "credentials")


def _preparation_error(cfg: DataConfig, error: BaseException) -> DataError:
  """One line: the missing extra, the failed download, or TFDS's own first line."""
  chain = []
  while error is not None and error not in chain:
    chain.append(error)
    error = error.__cause__ or error.__context__
  missing = next((e for e in chain if isinstance(e, ModuleNotFoundError)), None)
  if missing is not None:
    extra = EXTRAS.get(cfg.dataset)
    install = (f"pip install -c constraints.txt -e '.[{extra}]'" if extra else
               f"install the module '{missing.name}'")
    return DataError(f"preparing TFDS dataset '{cfg.dataset}' needs the Python module "
                     f"'{missing.name}', which is not installed; {install}")
  first = f"{type(chain[0]).__name__}: {(str(chain[0]).splitlines() or [''])[0][:300]}"
  if any(word in str(e).lower() for e in chain for word in _NETWORK_WORDS):
    return DataError(f"downloading TFDS dataset '{cfg.dataset}' failed ({first}); without "
                     f"network access, prepare it where there is some and copy data.data_dir="
                     f"{cfg.data_dir} here, or train on a local copy (docs/data.md)")
  return DataError(f"cannot prepare TFDS dataset '{cfg.dataset}' under data.data_dir="
                   f"{cfg.data_dir}: {first}; prepare it there beforehand (array_record) or "
                   f"fix data.dataset")


def _check_format(cfg: DataConfig, builder: tfds.core.DatasetBuilder) -> None:
  file_format = builder.info.file_format
  if file_format is not None and file_format.value != FILE_FORMAT:
    raise DataError(f"'{cfg.dataset}' under {cfg.data_dir} is stored as {file_format.value}; "
                    f"re-prepare it with file_format='array_record' (no TensorFlow to read it)")


def split_source(cfg: DataConfig, split: str) -> Sequence[dict[str, Any]]:
  """Random-access records of one split of a prepared dataset."""
  builder = dataset_builder(cfg)
  if not _is_prepared(builder):
    raise DataError(f"'{cfg.dataset}' is not prepared under data.data_dir={cfg.data_dir}; "
                    f"call data.prepare(cfg) first")
  _check_format(cfg, builder)
  if split not in builder.info.splits:
    raise DataError(f"split '{split}' is not in '{cfg.dataset}' (has "
                    f"{sorted(builder.info.splits)}); fix data.train_split/data.eval_split")
  features = builder.info.features
  if cfg.text_field not in features and "text" not in features:
    raise DataError(f"'{cfg.dataset}' has no text feature '{cfg.text_field}' (has "
                    f"{sorted(features)}); set data.text_field")
  source = builder.as_data_source(split=split)
  if len(source) == 0:
    raise DataError(f"split '{split}' of '{cfg.dataset}' is empty; add documents or choose "
                    f"another split (data.train_split/data.eval_split)")
  return source


def text_of(cfg: DataConfig, example: dict[str, Any]) -> str:
  """The document text of one decoded record (TFDS returns text features as bytes)."""
  value = example[cfg.text_field] if cfg.text_field in example else example["text"]
  if isinstance(value, np.ndarray):
    value = value.item()
  return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def document_of(cfg: DataConfig, example: dict[str, Any]) -> tuple[str, Any, Any]:
  """(text, answer_spans, fact_spans) of one decoded record; the spans are None unless the
  dataset marks answers (the synthetic corpus)."""
  return text_of(cfg, example), example.get("answer_spans"), example.get("fact_spans")


def iter_texts(cfg: DataConfig, split: str, limit: int) -> Iterator[str]:
  """Up to `limit` documents of a split, spread evenly over it (for tokenizer training).

  A long document comes as its parts (`data/parts.py`), the pieces the pipeline tokenizes:
  SentencePiece's trainer skips any sentence over its 16 MiB limit whole."""
  source = split_source(cfg, split)
  count = min(limit, len(source))
  for index in np.linspace(0, len(source) - 1, count).astype(int):
    text, answers, _ = document_of(cfg, source[int(index)])
    bounds = parts.bounds_of(text, answers)
    yield from (text[start:end] for start, end in zip(bounds, bounds[1:]))


def storage_name(cfg: DataConfig) -> str:
  """A file-name-safe identity of the prepared corpus (dataset and builder config)."""
  builder = dataset_builder(cfg)
  config = builder.builder_config.name if builder.builder_config else "default"
  return f"{builder.name}-{config}".replace("/", "_")


def corpus_id(cfg: DataConfig) -> str:
  """What the prepared corpus holds, by the figures TFDS recorded when it prepared it: the
  builder and its version, and each split's documents and bytes. A checkpoint records it,
  since its data position indexes these documents. Paths and file times are not part of
  it: the same files copied elsewhere, or touched, are the same corpus (an edit that keeps
  every size escapes it)."""
  builder = dataset_builder(cfg)
  splits = ", ".join(f"{name} {split.num_examples:,} documents {split.num_bytes:,} bytes"
                     for name, split in sorted(builder.info.splits.items()))
  return f"{builder.name} {builder.version}: {splits}"
