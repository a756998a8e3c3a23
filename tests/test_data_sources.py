"""text_files, registered TFDS names and the bad-input errors (each a one-line DataError)."""

import importlib.util
import json
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath

import data
from data import sources, text_files


class LocalCorpus(tfds.core.GeneratorBasedBuilder):
  """A stand-in for a registered TFDS dataset, prepared locally (no download)."""

  VERSION = tfds.core.Version("1.0.0")

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)  # See data/synthetic.py: TFDS 4.9.10 needs this on 3.11.

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"body": tfds.features.Text(), "label": np.int64}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(40), "test": self._generate_examples(5)}

  def _generate_examples(self, count):
    for i in range(count):
      yield i, {"body": f"record {i} is about the number {i * 7} and nothing else", "label": i}


def _write_corpus(root, bad=True):
  os.makedirs(root / "nested", exist_ok=True)
  for i in range(25):
    (root / f"doc{i:02d}.txt").write_text(f"plain text file {i} talks about rivers and hills.\n")
  lines = [json.dumps({"text": f"json line {i} is a short story"}) for i in range(10)]
  (root / "nested" / "lines.jsonl").write_text("\n".join(lines) + "\n")
  if bad:
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    os.symlink(root / "does_not_exist", root / "dangling.txt")


@pytest.fixture(scope="module")
def text_cfg(tmp_path_factory):
  root = tmp_path_factory.mktemp("docs")
  _write_corpus(root)
  cfg = data.DataConfig(dataset="text_files", path=str(root), seq_len=32,
                        tokenizer_vocab_size=300, data_dir=str(tmp_path_factory.mktemp("tf")))
  data.prepare(cfg)
  return cfg


def test_text_files_builds_skips_bad_files_and_yields_batches(text_cfg, capsys):
  train = sources.split_source(text_cfg, "train")
  validation = sources.split_source(text_cfg, "validation")
  assert len(train) + len(validation) == 35 and len(validation) == 2
  texts = {sources.text_of(text_cfg, train[i]) for i in range(len(train))}
  assert "json line 3 is a short story" in texts
  builder = sources.dataset_builder(text_cfg)
  bad = json.loads((epath.Path(builder.data_dir) / "bad_files.json").read_text())
  assert bad["count"] == 2  # The non-UTF-8 file and the dangling link.
  batch = next(data.make_iterator(text_cfg, split="train", global_batch_size=2,
                                  layout="zigzag", num_shards=2))
  assert batch["tokens"].shape == (2, 32) and batch["loss_mask"].sum() > 0
  assert not batch["answer_distance"].any()
  data.prepare(text_cfg)  # Cached: no rebuild.
  assert "preparing" not in capsys.readouterr().out


def test_a_first_preparation_logs_no_tfds_warning_nor_bars_into_a_file(tmp_path, caplog,
                                                                        capfd):
  """TFDS warns that a dataset not prepared yet has no dataset_info.json: every first run. And
  its progress bars, redrawn with carriage returns and cursor-up escapes, are for terminals:
  a job's log file (here pytest's capture) gets none."""
  _write_corpus(tmp_path / "docs", bad=False)
  cfg = data.DataConfig(dataset="text_files", path=str(tmp_path / "docs"),
                        data_dir=str(tmp_path / "prepared"))
  with caplog.at_level("WARNING"):
    sources.prepare_dataset(cfg)
  assert sources.split_source(cfg, "train")
  assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  output = "".join(capfd.readouterr())
  assert "preparing text_files" in output and "\r" not in output and "\x1b[" not in output


def test_text_files_follow_linked_folders_once_and_skip_empty_documents(tmp_path):
  """A linked folder is read like a linked file (a link back up the tree is not followed
  round); empty documents are bad, not a document each; a byte-order mark is not text."""
  root, elsewhere = tmp_path / "docs", tmp_path / "elsewhere"
  root.mkdir()
  elsewhere.mkdir()
  (root / "a.txt").write_text("alpha text")
  (root / "empty.txt").write_text("")
  (root / "blank.txt").write_text("  \n")
  (root / "bom.jsonl").write_bytes('\ufeff{"text": "first line"}\r\n{"text": ""}\r\n'
                                   '{"text": "third"}\r\n'.encode("utf-8"))
  (elsewhere / "b.txt").write_text("bravo")
  os.symlink(elsewhere, root / "linked")
  os.symlink(elsewhere, root / "same")  # A second link to the same folder: read once.
  os.symlink(root, elsewhere / "up")  # A loop: docs/linked/up is docs again.
  assert [os.path.relpath(f, root) for f in text_files.list_files(str(root))] == [
      "a.txt", "blank.txt", "bom.jsonl", "empty.txt", os.path.join("linked", "b.txt")]
  cfg = data.DataConfig(dataset="text_files", path=str(root), tokenizer_vocab_size=64,
                        data_dir=str(tmp_path / "prepared"))
  sources.prepare_dataset(cfg)
  texts = {sources.text_of(cfg, source[i]) for split in ("train", "validation")
           for source in [sources.split_source(cfg, split)] for i in range(len(source))}
  assert texts == {"alpha text", "first line", "third", "bravo"}
  bad = json.loads((epath.Path(sources.dataset_builder(cfg).data_dir) / "bad_files.json")
                   .read_text())["bad"]
  assert [entry.rsplit("/", 1)[-1] for entry in bad] == [
      "blank.txt: empty", "bom.jsonl:2: empty", "empty.txt: empty"]
  with pytest.raises(data.DataError, match="data.path=.*missing does not exist"):
    text_files.list_files(str(tmp_path / "missing"))


def test_text_files_fail_policy_names_the_file(tmp_path):
  _write_corpus(tmp_path / "docs")
  cfg = data.DataConfig(dataset="text_files", path=str(tmp_path / "docs"), on_bad_file="fail",
                        data_dir=str(tmp_path / "prepared"))
  with pytest.raises(data.DataError, match=r"bad input .*(latin1|dangling)\.txt.*on_bad_file"):
    data.prepare(cfg)


def test_text_files_keeps_a_published_book_level_split(tmp_path):
  """PG-19's release layout: train/, validation/, test/ of <book id>.txt, and metadata.csv."""
  root = tmp_path / "deepmind-gutenberg"
  books = {"train": [10, 11, 12], "validation": [20, 21], "test": [30]}
  for split, ids in books.items():
    (root / split).mkdir(parents=True)
    for book in ids:
      (root / split / f"{book}.txt").write_text(f"book {book} of the {split} split")
  (root / "metadata.csv").write_text("10,Title,1900,http://x\n")
  cfg = data.DataConfig(dataset="text_files", path=str(root), tokenizer_vocab_size=64,
                        data_dir=str(tmp_path / "prepared"))
  sources.prepare_dataset(cfg)
  for split in ("train", "validation"):
    source = sources.split_source(cfg, split)
    texts = sorted(sources.text_of(cfg, source[i]) for i in range(len(source)))
    assert texts == [f"book {book} of the {split} split" for book in books[split]]


def test_five_books_fill_every_row_of_a_larger_batch(tmp_path, monkeypatch):
  """Fewer documents than rows: 4 streams fill 8 rows; a long book, read in parts, runs on
  across rows and batches, and a position inside it resumes exactly."""
  from data import parts
  monkeypatch.setattr(parts, "PART_CHARS", 200)
  books = tmp_path / "books"
  books.mkdir()
  lengths = [40, 600, 30, 50, 45]  # Words; book 0 goes to validation.
  for i, words in enumerate(lengths):
    (books / f"book{i}.txt").write_text(" ".join(f"w{i}x{j % 7}" for j in range(words)))
  cfg = data.DataConfig(dataset="text_files", path=str(books), seq_len=32,
                        tokenizer_vocab_size=300, data_dir=str(tmp_path / "d"), prefetch=0)
  data.prepare(cfg)
  texts = [sources.text_of(cfg, r) for r in sources.split_source(cfg, "train")]
  assert len(texts) == 4
  make = lambda repeat: data.make_iterator(cfg, split="train", global_batch_size=8,
                                           repeat=repeat)
  batches = list(make(repeat=False))
  tok = data.load_tokenizer(cfg)
  tokens = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
  assert tokens == sum(len(tok.encode(t)) + 2 for t in texts)  # Every token once.
  assert batches[0]["segment_ids"].all()  # Full rows at the start.
  long_rows = [(b, r) for b, batch in enumerate(batches) for r in range(8)
               if "w1x" in tok.decode(batch["tokens"][r])]
  assert len({b for b, _ in long_rows}) >= 2  # The long book runs across batches.

  # 4 processes of 2 rows: streams 0 and 1 feed processes 0 and 2, and so on. The global
  # batch and its state are still the one-process ones.
  whole = make(repeat=True)
  processes = [data.make_iterator(cfg, split="train", global_batch_size=8, process_index=p,
                                  process_count=4) for p in range(4)]
  for _ in range(3):
    expected = next(whole)
    got = np.concatenate([next(process)["tokens"] for process in processes])
    assert np.array_equal(got, expected["tokens"])
  merged = data.pipeline.merge_states([process.get_state() for process in processes])
  assert merged == whole.get_state()

  it = make(repeat=True)
  states = []
  for _ in range(6):
    states.append(it.get_state())
    next(it)
  inside = [s for s in states if any(p["part"] > 0 for p in s["streams"].values())]
  assert inside, "the long book was never read in parts"
  it.set_state(inside[0])
  fresh = make(repeat=True)
  fresh.set_state(inside[0])
  for _ in range(3):
    assert np.array_equal(next(it)["tokens"], next(fresh)["tokens"])


def test_long_document_parts_tokenize_like_the_whole(text_cfg, monkeypatch):
  from data import parts
  monkeypatch.setattr(parts, "PART_CHARS", 97)
  tok = data.load_tokenizer(text_cfg)
  text = "  ".join(f"plain text {i} talks about\nrivers,\thills and jsonl lines."
                   for i in range(300))
  whole = tok.encode_document(text)[0]
  bounds = parts.part_bounds(text, 97)
  assert len(bounds) > 100 and all(text[b] in " \n\t" for b in bounds[1:-1])
  read = parts.DocumentParts([(text, None, None)], tok.encode_document)
  joined, part = [], 0
  while True:
    chunk = read(0, part)
    joined.append(chunk.ids)
    if chunk.last:
      break
    part += 1
  assert np.array_equal(np.concatenate(joined), whole)


@pytest.mark.parametrize("good,bad", [(1, 0), (0, 3)])
def test_text_files_too_few_documents_for_the_splits(tmp_path, good, bad):
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(good):
    (docs / f"book{i}.txt").write_text(f"book {i}")
  for i in range(bad):
    (docs / f"bad{i}.txt").write_bytes(b"\xff\xfe not utf-8")
  cfg = data.DataConfig(dataset="text_files", path=str(docs), data_dir=str(tmp_path / "d"))
  skipped = r", 3 bad file\(s\) or line\(s\) skipped \(first: .*bad0.txt: not UTF-8" if bad else ""
  with pytest.raises(data.DataError, match=rf"has {good} usable document\(s\){skipped}.*at "
                                           rf"least 2 are needed"):
    data.prepare(cfg)


@pytest.mark.parametrize("make_dir", [False, True])
def test_text_files_missing_or_empty_path(tmp_path, make_dir):
  path = tmp_path / "nothing"
  if make_dir:
    path.mkdir()
    (path / "notes.md").write_text("not a .txt file")
  cfg = data.DataConfig(dataset="text_files", path=str(path), data_dir=str(tmp_path / "d"))
  with pytest.raises(data.DataError, match="data.path"):
    data.prepare(cfg)


def test_registered_name_reads_a_locally_prepared_builder(tmp_path):
  LocalCorpus(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
  cfg = data.DataConfig(dataset="local_corpus", data_dir=str(tmp_path), text_field="body",
                        seq_len=32, tokenizer_vocab_size=300)
  data.prepare(cfg)
  assert data.load_tokenizer(cfg).vocab_size <= 300
  batch = next(data.make_iterator(cfg, split="test", global_batch_size=2))
  assert batch["tokens"].shape == (2, 32)
  assert "record" in data.load_tokenizer(cfg).decode(batch["tokens"][0])


def test_registered_name_wrong_field_or_split(tmp_path):
  LocalCorpus(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
  cfg = data.DataConfig(dataset="local_corpus", data_dir=str(tmp_path), text_field="missing")
  with pytest.raises(data.DataError, match="data.text_field"):
    sources.split_source(cfg, "train")
  cfg = data.DataConfig(dataset="local_corpus", data_dir=str(tmp_path), text_field="body")
  with pytest.raises(data.DataError, match="split 'validation'"):
    sources.split_source(cfg, "validation")


@pytest.mark.parametrize("make_dir", [False, True])
def test_registered_name_missing_or_empty_data_dir(tmp_path, make_dir):
  data_dir = tmp_path / "empty"
  if make_dir:
    data_dir.mkdir()
  cfg = data.DataConfig(dataset="local_corpus", data_dir=str(data_dir))
  with pytest.raises(data.DataError, match="data.data_dir=.* is missing or empty"):
    data.prepare(cfg)


def test_a_read_only_data_dir_that_needs_preparation_says_what_to_do(tmp_path):
  """Was an OSError traceback from TFDS (or os.makedirs) deep in the preparation."""
  from conftest import mounted_tmpfs  # pylint: disable=g-import-not-at-top
  with mounted_tmpfs(tmp_path / "ro", "ro,size=1M") as read_only:
    for data_dir in (read_only, read_only / "new"):  # There, or still to be made.
      cfg = data.DataConfig(data_dir=str(data_dir), num_documents=4, num_eval_documents=2)
      with pytest.raises(data.DataError) as error:
        data.prepare(cfg)
      assert str(error.value) == (
          f"data.data_dir={data_dir} cannot be written (Read-only file system), and "
          f"synthetic_longrange (n4_e2_len1024_seed0) is not prepared there: set data.data_dir "
          f"to a writable folder, or prepare it with this config where one is and copy it here")


def test_unknown_name(tmp_path):
  (tmp_path / "something").mkdir()
  cfg = data.DataConfig(dataset="no_such_dataset_anywhere", data_dir=str(tmp_path))
  with pytest.raises(data.DataError, match="no_such_dataset_anywhere"):
    data.prepare(cfg)


def test_named_tokenizer_and_its_vocab_check(tmp_path, text_cfg):
  trained = data.tokenizer_path(text_cfg)
  cfg = data.DataConfig(**{**text_cfg.__dict__, "tokenizer": trained})
  data.prepare(cfg)
  assert data.load_tokenizer(cfg).vocab_size <= 300
  with pytest.raises(data.DataError, match="raise model.vocab_size"):
    data.check_vocab(cfg, 256)
  missing = data.DataConfig(**{**text_cfg.__dict__, "tokenizer": str(tmp_path / "no.model")})
  with pytest.raises(data.DataError, match="data.tokenizer"):
    data.prepare(missing)


def test_errors_are_value_errors_with_one_line_messages(tmp_path):
  assert issubclass(data.DataError, ValueError)
  with pytest.raises(data.DataError) as error:
    data.DataConfig(on_bad_file="ignore")
  assert "\n" not in str(error.value) and "data.on_bad_file" in str(error.value)


def _installed(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


def test_pg19_resolves_into_an_empty_data_dir(tmp_path):
  builder = sources.dataset_builder(
      data.DataConfig(dataset="pg19", data_dir=str(tmp_path / "empty")))
  assert builder.name == "pg19" and not builder.is_prepared()


@pytest.mark.skipif(_installed("tensorflow"), reason="the pg19 extra is installed here")
def test_pg19_without_its_extra_names_the_extra(tmp_path):
  cfg = data.DataConfig(dataset="pg19", data_dir=str(tmp_path / "pg19"))
  with pytest.raises(data.DataError, match=r"needs the Python module '\w+', which is not "
                                           r"installed; pip install .*'\.\[pg19\]'$"):
    data.prepare(cfg)


@pytest.mark.skipif(not _installed("tensorflow"), reason="needs the pg19 extra")
def test_pg19_offline_says_the_download_failed(tmp_path, monkeypatch):
  """Offline by construction (tests never reach the internet): every HTTP(S) request of
  TensorFlow's GCS client goes to a proxy on a port where nothing listens."""
  for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
    monkeypatch.setenv(name, "http://127.0.0.1:9")
  for name in ("no_proxy", "NO_PROXY"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_RETRIES", "0")  # TF retries for ~3 min otherwise.
  cfg = data.DataConfig(dataset="pg19", data_dir=str(tmp_path / "pg19"))
  with pytest.raises(data.DataError, match="downloading TFDS dataset 'pg19' failed"):
    data.prepare(cfg)
