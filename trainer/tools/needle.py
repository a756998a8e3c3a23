"""Needle in a haystack: does a run find a fact hidden at any depth of a long prompt?

A fact (the needle) is placed at a fraction `depth` of filler text from the run's own eval
split, in a prompt of about `length` tokens that ends with a question about it. The sampler
answers greedily; a trial is correct when the answer's first word is the fact's value, and a
cell's score is the fraction of its trials that are.

The needle is worded as the dataset words facts: the synthetic corpus states and asks them
in exactly this form ("the code of mira is amber ." ... "what is the code of mira ? it is"),
so a model trained on it knows the format; any other dataset gets an English sentence about
a number, the common "magic number" needle. Filler sentences that mention a needle key or
value are dropped, so the haystack holds no competing answer.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Callable

import jax
import ml_collections
import numpy as np

import data
from data import sources, synthetic
from trainer.config import needle_grid
from trainer.config.needle_grid import NeedleError
from trainer.core.training import data_config
from trainer.tools.sampling import SampleError, Sampler, capacity_for, prompt_ids


@dataclasses.dataclass(frozen=True)
class NeedleFormat:
  fact: str  # With {key} and {value}.
  question: str  # With {key}; the answer's first word follows it.
  keys: tuple[str, ...]
  values: tuple[str, ...]


SYNTHETIC = NeedleFormat("the code of {key} is {value} .", "what is the code of {key} ? it is",
                         synthetic.KEYS, synthetic.VALUES)
ENGLISH = NeedleFormat(
    "The special magic number of {key} is {value}.",
    "What is the special magic number of {key}? The special magic number of {key} is",
    tuple(key.capitalize() for key in synthetic.KEYS),
    tuple(str(n) for n in range(1013, 10000, 797)))


def format_of(dataset: str) -> NeedleFormat:
  return SYNTHETIC if dataset == "synthetic_longrange" else ENGLISH


def filler_sentences(data_cfg: data.DataConfig, tokenizer: data.Tokenizer, fmt: NeedleFormat,
                     tokens: int, piece_tokens: int = 64) -> list[tuple[str, int]]:
  """(sentence, its token count) from the eval split, in order, until `tokens` are reached;
  sentences naming a needle key or value are left out, and one over 4 x `piece_tokens` (and
  32) tokens is cut at words into pieces of about `piece_tokens`: a prompt takes whole
  pieces, and text without sentence ends gave prompts a fraction of their length. No
  sentence of the synthetic corpus reaches 32 tokens: its prompts stay as they were."""
  # A key or a value in the filler would compete with the needle ("it is amber ." is a
  # sentence of its own once the synthetic corpus's questions are split at "?").
  banned = {word.lower() for word in fmt.keys + fmt.values}
  sentences, total = [], 0
  source = sources.split_source(data_cfg, data_cfg.eval_split)
  for index in range(len(source)):
    text = sources.text_of(data_cfg, source[index])
    for sentence in re.split(r"(?<=[.?!])\s+", text.strip()):
      if not sentence or banned & set(re.findall(r"\w+", sentence.lower())):
        continue
      for piece in _pieces(sentence, len(tokenizer.encode(sentence)), piece_tokens):
        count = len(tokenizer.encode(piece))
        sentences.append((piece, count))
        total += count
        if total >= tokens:
          return sentences
  raise NeedleError(f"the eval split '{data_cfg.eval_split}' holds only {total:,} filler tokens "
                    f"without a needle key, fewer than the longest length ({tokens:,})")


def _pieces(sentence: str, count: int, piece_tokens: int) -> list[str]:
  """`sentence` whole, or if over 4 x `piece_tokens` and 32 tokens, cut at words into about
  count / piece_tokens pieces of equal word counts."""
  words = sentence.split()
  parts = min(len(words), -(-count // piece_tokens))
  if count <= max(32, 4 * piece_tokens) or parts <= 1:
    return [sentence]
  bounds = np.linspace(0, len(words), parts + 1).round().astype(int)
  return [" ".join(words[start:end]) for start, end in zip(bounds, bounds[1:])]


def build_prompt(sentences: list[tuple[str, int]], tokenizer: data.Tokenizer, fact: str,
                 question: str, length: int, depth: float) -> list[int]:
  """BOS, filler with `fact` after the sentence nearest `depth` of it, then `question`: about
  `length` tokens (whole sentences, counted one by one: joined, a few more or fewer)."""
  budget = length - len(prompt_ids(tokenizer, f"{fact} {question}"))
  used, total = [], 0
  for sentence, count in sentences:
    if total + count > budget:
      break
    used.append((sentence, count))
    total += count
  cumulative = np.cumsum([0] + [count for _, count in used])
  at = int(np.argmin(np.abs(cumulative - depth * total)))
  words = [s for s, _ in used[:at]] + [fact] + [s for s, _ in used[at:]] + [question]
  return prompt_ids(tokenizer, " ".join(words))


def evaluate(sampler: Sampler, lengths: list[int], depths: list[float], trials: int = 3,
             seed: int = 0, log: Callable[[str], None] = print) -> list[dict]:
  """One row per trial: length, depth, prompt tokens, key, expected value, answer, whether
  it is correct, and whether it is a value at all (`a_value`)."""
  tokenizer = sampler.tokenizer
  fmt = format_of(sampler.config.data.dataset)
  # Sentences over 1/4 of the shortest prompt are cut into pieces of 1/16 of it: each prompt
  # comes within about 1/4 of its length, and ordinary sentences stay whole.
  sentences = filler_sentences(sampler.data_cfg, tokenizer, fmt, max(lengths),
                               piece_tokens=max(8, min(lengths) // 16))
  rng = np.random.default_rng(seed)
  rows = []
  for length in lengths:
    prompts = []
    for depth in depths:
      for trial in range(trials):
        key = fmt.keys[rng.integers(len(fmt.keys))]
        value = fmt.values[rng.integers(len(fmt.values))]
        ids = build_prompt(sentences, tokenizer, fmt.fact.format(key=key, value=value),
                           fmt.question.format(key=key), length, depth)
        prompts.append((depth, trial, key, value, ids))
    # Room for the value's tokens and one more; one capacity (one compile) per length.
    new_tokens = max(len(tokenizer.encode(value)) for *_, value, _ in prompts) + 1
    capacity = capacity_for(max(len(p[-1]) for p in prompts) + new_tokens, sampler.config,
                            sampler.num_shards, sampler.ulysses)
    for depth, trial, key, value, ids in prompts:
      answer_ids, _ = sampler.generate(ids, new_tokens, capacity=capacity)
      answer = tokenizer.decode(answer_ids).strip()
      first = re.findall(r"\w+", answer)
      rows.append({"length": length, "depth": depth, "trial": trial,
                   "prompt_tokens": len(ids), "key": key, "expected": value,
                   "answer": answer, "correct": bool(first) and first[0] == value,
                   # Some value, right or wrong: the model knows the question's form.
                   "a_value": bool(first) and first[0] in fmt.values})
    cell = [r for r in rows if r["length"] == length]
    log(f"  length {length:>7,}: {np.mean([r['correct'] for r in cell]):.0%} of {len(cell)} "
        f"needles found; {np.mean([r['a_value'] for r in cell]):.0%} answered with a value")
  return rows


def grid(rows: list[dict], lengths: list[int], depths: list[float]) -> np.ndarray:
  """Accuracy [length, depth]."""
  accuracy = np.zeros((len(lengths), len(depths)))
  for i, length in enumerate(lengths):
    for j, depth in enumerate(depths):
      cell = [r["correct"] for r in rows if r["length"] == length and r["depth"] == depth]
      accuracy[i, j] = np.mean(cell)
  return accuracy


def heatmap(accuracy: np.ndarray, lengths: list[int], depths: list[float], path: str,
            title: str) -> None:
  """Length x depth accuracy as a PNG, green where found."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  figure, axes = pyplot.subplots(figsize=(1.2 * len(depths) + 2.5, 0.6 * len(lengths) + 1.8))
  image = axes.imshow(accuracy, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
  axes.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
  axes.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths])
  axes.set_xlabel("depth of the needle in the prompt")
  axes.set_ylabel("prompt tokens")
  for i in range(len(lengths)):
    for j in range(len(depths)):
      axes.text(j, i, f"{accuracy[i, j]:.0%}", ha="center", va="center", fontsize=9)
  axes.set_title(title, fontsize=10)
  figure.colorbar(image, ax=axes, label="retrieved")
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  pyplot.close(figure)


def periodic_eval(config: ml_collections.ConfigDict, mesh) -> "PeriodicEval | None":
  """The loop's needle eval for a stage's `config` (`train.eval_needle_lengths`), or None."""
  return PeriodicEval(config, mesh) if config.train.eval_needle_lengths else None


class PeriodicEval:
  """The training loop's needle grid (`train.eval_needle_lengths`): accuracy overall and per
  length, at every eval. Optional: when it cannot run, it says why once and the run goes on
  without it."""

  def __init__(self, config: ml_collections.ConfigDict, mesh):
    self.config, self.mesh = config, mesh
    self.sampler = None  # Made at the first eval; its compiled steps serve every later one.
    self.off = False

  def __call__(self, params) -> dict[str, float]:
    cfg = self.config.train
    if self.off:
      return {}
    if jax.process_count() > 1:  # The sampler reads each new token from row 0 on this host.
      return self._turn_off("it samples in one process; run scripts/eval_needle.py on a "
                            "checkpoint")
    if self.sampler is None:
      self.sampler = Sampler(self.config, self.mesh, params,
                             data.load_tokenizer(data_config(self.config)),
                             log=lambda line: None)
    self.sampler.params = params
    lengths = needle_grid.parse_lengths(cfg.eval_needle_lengths)
    try:
      rows = evaluate(self.sampler, lengths, needle_grid.parse_depths(cfg.eval_needle_depths),
                      cfg.eval_needle_trials, log=lambda line: None)
    except (NeedleError, SampleError) as error:
      return self._turn_off(str(error))
    found = lambda length: [r["correct"] for r in rows if length in (None, r["length"])]
    return {"eval_needle_accuracy": statistics.mean(found(None)),
            **{f"eval_needle_accuracy_{n}": statistics.mean(found(n)) for n in lengths}}

  def _turn_off(self, why: str) -> dict[str, float]:
    print(f"warning: the needle eval (train.eval_needle_lengths) is off for this run: {why}",
          flush=True)
    self.off = True
    return {}
