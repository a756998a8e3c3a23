"""`synthetic_longrange`: a deterministic corpus whose answers need long-range attention.

A document is a run of short sentences over a vocabulary of a few hundred words. Early on it
states facts ("the code of mira is amber .") and much later asks for them
("what is the code of mira ? it is amber ."). Filler sentences follow a small grammar, so a
tiny model's loss falls within ~100 steps, while the answer word can only be predicted by
attending back to its fact, at distances from a few tokens to the whole document.

Lengths are drawn log-uniformly (as many short documents as long ones) and counted in words
and punctuation marks, up to `max_document_tokens`; the default 512-piece tokenizer makes
about 1.4 tokens of a word, so documents reach and pass `seq_len`. Facts sit in the first
half of a document, each question anywhere after its fact.
Each example stores the text plus the character spans of every answer word and of its fact's
word; `tokenizer.encode_document` turns them into per-token distances.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from data.local_builder import LocalBuilder

# Keys and values of facts: disjoint from the filler words, so an answer is never guessable
# from the grammar alone.
KEYS = tuple("""
mira tomas elin oskar nadia felix ingrid hugo lena viktor saga anton freya jonas alma
erik ines bruno clara dario edda fabio greta henri ida jules karla leon maja nils olga
pavel rosa stig tilde ugo vera wim xenia yusuf zora
""".split())
VALUES = tuple("""
amber azure crimson ivory jade ochre olive pearl ruby scarlet silver teal violet cobalt
copper bronze coral indigo lilac maroon mauve navy plum rust saffron sienna tan umber
apple cedar maple willow birch lemon mango peach quartz onyx topaz opal garnet beryl
""".split())
ADJECTIVES = tuple("""
big small old young quick slow bright dark quiet loud warm cold soft hard tall short green
red blue brown happy sad early late heavy light round flat sharp dull clean wet dry
""".split())
NOUNS = tuple("""
cat dog bird fish horse river mountain tree house garden road city village farmer teacher
child king queen ship boat train window door table chair book letter song story cloud storm
moon sun star field forest lake bridge tower market school
""".split())
VERBS = tuple("""
sees finds likes follows helps watches carries builds paints opens closes reads writes
visits leaves crosses calls meets holds pushes pulls keeps sells buys
""".split())
PLACES = tuple("in near under over behind beside across through".split())

FACT_WORDS = 7  # "the code of KEY is VALUE ."
QUESTION_WORDS = 11  # "what is the code of KEY ? it is VALUE ."
MIN_DOCUMENT_WORDS = 24


def vocabulary() -> tuple[str, ...]:
  """Every word the corpus can use (a few hundred)."""
  fixed = "the a of is code what it ? . , and then".split()
  return tuple(dict.fromkeys(fixed + [*KEYS, *VALUES, *ADJECTIVES, *NOUNS, *VERBS, *PLACES]))


@dataclasses.dataclass(frozen=True)
class Document:
  """One synthetic document: text plus char spans [start, end) of answers and their facts."""

  text: str
  answer_spans: np.ndarray  # int32 [n, 2]
  fact_spans: np.ndarray  # int32 [n, 2]: the fact word that answer i repeats.


def _filler(rng: np.random.Generator) -> list[str]:
  choice = lambda words: words[rng.integers(len(words))]
  if rng.random() < 0.5:
    return ["the", choice(ADJECTIVES), choice(NOUNS), choice(VERBS), "the", choice(NOUNS), "."]
  return ["a", choice(NOUNS), choice(VERBS), "a", choice(ADJECTIVES), choice(NOUNS),
          choice(PLACES), "the", choice(NOUNS), "."]


def make_document(seed: int, split_id: int, index: int, max_words: int) -> Document:
  """The document `index` of a split; depends only on its arguments (order-free, parallel)."""
  rng = np.random.default_rng([seed, split_id, index])
  max_words = max(max_words, MIN_DOCUMENT_WORDS)
  # Log-uniform lengths: as many short documents as long ones, so distances span all scales.
  length = int(np.exp(rng.uniform(np.log(MIN_DOCUMENT_WORDS), np.log(max_words + 1))))
  num_facts = int(min(len(KEYS), max(1, length // 64), rng.integers(1, 2 + length // 48)))
  slots = max(length // 8, 2)  # Sentences of ~8 words.
  keys = rng.choice(len(KEYS), size=num_facts, replace=False)
  values = rng.integers(len(VALUES), size=num_facts)
  fact_slot = rng.integers(0, max(slots // 2, 1), size=num_facts)
  # The question comes after its fact, anywhere up to the end: short and long distances.
  question_slot = np.array([rng.integers(f + 1, slots + 1) for f in fact_slot])
  events: dict[int, list[tuple[str, int]]] = {}
  for i in range(num_facts):
    events.setdefault(int(fact_slot[i]), []).append(("fact", i))
    events.setdefault(int(question_slot[i]), []).append(("question", i))

  words: list[str] = []
  fact_word, answer_word = {}, {}
  for slot in range(slots + 1):
    for kind, i in events.get(slot, []):
      key, value = KEYS[keys[i]], VALUES[values[i]]
      if kind == "fact":
        words += ["the", "code", "of", key, "is", value, "."]
        fact_word[i] = len(words) - 2
      else:
        words += ["what", "is", "the", "code", "of", key, "?", "it", "is", value, "."]
        answer_word[i] = len(words) - 2
    if slot < slots:
      words += _filler(rng)

  starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
  span = lambda w: (starts[w], starts[w] + len(words[w]))
  order = sorted(answer_word, key=answer_word.get)
  return Document(
      text=" ".join(words),
      answer_spans=np.array([span(answer_word[i]) for i in order], np.int32).reshape(-1, 2),
      fact_spans=np.array([span(fact_word[i]) for i in order], np.int32).reshape(-1, 2))


class SyntheticLongrangeConfig(tfds.core.BuilderConfig):
  """Corpus size, document length and seed; the config name encodes them."""

  def __init__(self, *, num_documents: int, num_eval_documents: int, max_document_tokens: int,
               seed: int):
    super().__init__(
        name=f"n{num_documents}_e{num_eval_documents}_len{max_document_tokens}_seed{seed}",
        description="Deterministic key/value retrieval corpus.")
    self.num_documents = num_documents
    self.num_eval_documents = num_eval_documents
    self.max_document_tokens = max_document_tokens
    self.seed = seed


class SyntheticLongrange(LocalBuilder):
  """The embedded default dataset; generated from a seed, nothing downloaded."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [SyntheticLongrangeConfig(num_documents=2000, num_eval_documents=200,
                                              max_document_tokens=1024, seed=0)]
  SPLIT_IDS = {"train": 0, "validation": 1}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__.split("\n\n")[0],
        features=tfds.features.FeaturesDict({
            "text": tfds.features.Text(),
            "answer_spans": tfds.features.Tensor(shape=(None, 2), dtype=np.int32),
            "fact_spans": tfds.features.Tensor(shape=(None, 2), dtype=np.int32),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    cfg = self.builder_config
    return {"train": self._generate_examples("train", cfg.num_documents),
            "validation": self._generate_examples("validation", cfg.num_eval_documents)}

  def _generate_examples(self, split: str, count: int):
    cfg = self.builder_config
    for index in range(count):
      doc = make_document(cfg.seed, self.SPLIT_IDS[split], index, cfg.max_document_tokens)
      yield index, {"text": doc.text, "answer_spans": doc.answer_spans,
                    "fact_spans": doc.fact_spans}
