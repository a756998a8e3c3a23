"""`text_files`: a TFDS builder over a directory of `.txt` or `.jsonl` files.

One document per `.txt` file, or per line of a `.jsonl` file (the `text_field` of each JSON
object). Files are found recursively and read in sorted order.

Splits: when `path` holds `train/` and `validation/` folders (the layout of PG-19's public
release, `train/`, `validation/` and `test/` of `<book id>.txt`), each split is its folder,
so a book-level split is kept as published (`test/` stays held out). Otherwise every 20th
document, starting with the first (index 0, 20, 40, ...), goes to `validation` and the rest to
`train`, so two documents are enough (the data pipeline fills any batch from one stream).

An unreadable file, a file that is not UTF-8, an empty document, or a JSON line that does
not parse or lacks the field is "bad": with `on_bad_file='skip'` it is left out and counted
(the count is printed and written to `bad_files.json` beside the prepared data), with
`'fail'` preparation stops with a `DataError` naming it. A leading byte-order mark is not
part of a file's text.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os

import tensorflow_datasets as tfds

from data.config import DataError
from data.local_builder import LocalBuilder

EXTENSIONS = (".txt", ".jsonl")
VALIDATION_EVERY = 20


def list_files(path: str) -> list[str]:
  """The `.txt`/`.jsonl` files under `path`, sorted; DataError when there are none."""
  if not path:
    raise DataError("data.path is empty; name a directory of .txt/.jsonl files for text_files")
  if not os.path.exists(path):
    raise DataError(f"data.path={path} does not exist; name a directory of .txt/.jsonl files")
  if not os.path.isdir(path):
    raise DataError(f"data.path={path} is not a directory; name a directory of .txt/.jsonl files")
  files, seen = [], set()
  # Linked folders are followed as linked files are; each real folder is read once, so a
  # link back up the tree cannot loop.
  for root, dirs, names in os.walk(path, followlinks=True):
    real = os.path.realpath(root)
    if real in seen:  # A second way to the same folder (a link to it, or back up the tree).
      dirs[:] = []
      continue
    seen.add(real)
    dirs.sort()
    files += [os.path.join(root, n) for n in sorted(names) if n.endswith(EXTENSIONS)]
  if not files:
    raise DataError(f"data.path={path} holds no .txt or .jsonl files; add some or fix data.path")
  return files


def split_folders(path: str) -> dict[str, str] | None:
  """{"train": path/train, "validation": path/validation} when both folders exist."""
  folders = {split: os.path.join(path, split) for split in ("train", "validation")}
  return folders if all(os.path.isdir(folder) for folder in folders.values()) else None


def fingerprint(path: str, text_field: str, on_bad_file: str) -> str:
  """A hash of the options and of every file's name, size and mtime: edits make a new build."""
  digest = hashlib.sha256(json.dumps([os.path.abspath(path), text_field, on_bad_file]).encode())
  for file in list_files(path):
    try:
      stat = os.stat(file)
      signature = f"{stat.st_size}\0{stat.st_mtime_ns}"
    except OSError:  # A dangling link, say: reading it later reports the problem.
      signature = "unreadable"
    digest.update(f"{os.path.relpath(file, path)}\0{signature}\n".encode())
  return digest.hexdigest()[:12]


class TextFilesConfig(tfds.core.BuilderConfig):
  """A directory and how to read it; the name carries a fingerprint of the files."""

  def __init__(self, *, path: str, text_field: str = "text", on_bad_file: str = "skip"):
    base = "".join(c if c.isalnum() else "_" for c in os.path.basename(os.path.normpath(path)))
    super().__init__(name=f"{base or 'root'}_{fingerprint(path, text_field, on_bad_file)}",
                     description=f"Text documents from {path}")
    self.path = path
    self.text_field = text_field
    self.on_bad_file = on_bad_file


class TextFiles(LocalBuilder):
  """Documents from a user's directory; build with `TextFiles(config=TextFilesConfig(...))`."""

  VERSION = tfds.core.Version("1.2.0")
  RELEASE_NOTES = {"1.1.0": "Validation takes documents 0, 20, 40, ... (was 19, 39, ...).",
                   "1.2.0": "Empty documents are bad, not documents; linked folders are read; "
                            "a byte-order mark is dropped."}
  BUILDER_CONFIGS = []  # A config is always given: it names the directory.

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=__doc__.split("\n\n")[0],
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager  # The files are local.
    return {"train": self._generate_examples(train=True),
            "validation": self._generate_examples(train=False)}

  def _generate_examples(self, train: bool):
    bad: list[str] = []
    index = yielded = 0
    folders = split_folders(self.builder_config.path)
    root = folders["train" if train else "validation"] if folders else self.builder_config.path
    for file, document, problem in self._documents(root):
      if problem:
        bad.append(f"{file}: {problem}")
        if self.builder_config.on_bad_file == "fail":
          raise DataError(f"bad input {file}: {problem}; fix or remove it, or set "
                          f"data.on_bad_file=skip")
        continue
      if not folders and (index % VALIDATION_EVERY == 0) == train:
        index += 1
        continue
      yield f"{index:012d}", {"text": document}
      index += 1
      yielded += 1
    if not yielded:  # TFDS would stop on an empty split with a bare AssertionError.
      skipped = f", {len(bad)} bad file(s) or line(s) skipped (first: {bad[0]})" if bad else ""
      if folders:
        raise DataError(f"{root} has no usable document{skipped}; add documents to it")
      raise DataError(
          f"data.path={self.builder_config.path} has {index} usable document(s){skipped}; "
          f"validation takes every {VALIDATION_EVERY}th from the first and train the rest, so "
          f"at least 2 are needed; add documents, or put them in train/ and validation/ folders")
    if train:
      self._report_bad(bad)

  def _documents(self, root: str):
    """(file, document, problem) for each document under `root`, or each bad file or line."""
    field = self.builder_config.text_field
    for file in list_files(root):
      try:
        with open(file, "rb") as f:
          raw = f.read()
        text = raw.decode("utf-8-sig")  # A byte-order mark (Windows editors) is not text.
      except OSError as error:
        yield file, None, f"unreadable ({error.strerror or error})"
        continue
      except UnicodeDecodeError as error:  # Its offset counts from after a byte-order mark.
        yield file, None, f"not UTF-8 (byte {error.start + 3 * raw.startswith(codecs.BOM_UTF8)})"
        continue
      if file.endswith(".txt"):
        yield file, text, None if text.strip() else "empty"
        continue
      for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
          continue
        try:
          value = json.loads(line)[field]
          if not isinstance(value, str):
            raise TypeError
        except (ValueError, KeyError, TypeError, IndexError):
          yield f"{file}:{number}", None, f"not a JSON object with a string field '{field}'"
          continue
        yield (file, value, None) if value.strip() else (f"{file}:{number}", None, "empty")

  def _report_bad(self, bad: list[str]) -> None:
    if not bad:
      return
    print(f"text_files: skipped {len(bad)} bad file(s) or line(s) under "
          f"{self.builder_config.path}; first: {bad[0]}", flush=True)
    os.makedirs(self.data_dir, exist_ok=True)
    with open(os.path.join(self.data_dir, "bad_files.json"), "w", encoding="utf-8") as f:
      json.dump({"count": len(bad), "bad": bad}, f, indent=1)
