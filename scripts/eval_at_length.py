"""Eval loss and the dataset's retrieval accuracy of a run's checkpoint at other row lengths.

    python scripts/eval_at_length.py --workdir RUN --lengths 256,512 [--batches 16] [--step N]
        [--config.model.attention=... ]

The trainer's own eval (`eval_step`, the synthetic corpus's retrieval accuracy) on
`--batches` batches of the run's eval split cut at each length, with the run's attention;
a span plan (`model.head_spans`) is resolved at that length (MoA's rules `alpha + beta * N`
stretch with it). Prints one JSON line per length. Issue 58 compares span plans with it at
the training length and at twice it (results/moa_search.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402  (after the path fix above)

from trainer.tools import run_flags  # noqa: E402


def define_flags() -> None:
  flags.DEFINE_string("lengths", "256,512", "Row lengths to evaluate at, comma-separated.")
  flags.DEFINE_integer("batches", 16, "Eval batches (of train.batch_size rows) per length.")


def evaluate(workdir: str, config, step: int | None, length: int, batches: int) -> dict:
  """The eval's sums over `batches` batches at `length`, as the trainer's eval reports."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  import data  # pylint: disable=g-import-not-at-top
  import parallelism  # pylint: disable=g-import-not-at-top
  from model import Decoder  # pylint: disable=g-import-not-at-top
  from trainer.core.step import eval_step  # pylint: disable=g-import-not-at-top
  from trainer.tools import sampling  # pylint: disable=g-import-not-at-top
  config = config.copy_and_resolve_references()
  config.data.seq_len = length
  sampler, step = sampling.load(workdir, config, step, lambda line: None)
  evaluator = data.evaluator_of(sampler.data_cfg)
  model = Decoder(dataclasses.replace(sampler.model_cfg, remat="none"))
  step_fn = jax.jit(functools.partial(eval_step, model=model, evaluator=evaluator))
  rows = data.make_iterator(sampler.data_cfg, sampler.data_cfg.eval_split,
                            sampler.config.train.batch_size, sampler.model_cfg.layout,
                            sampler.num_shards, seed=sampler.config.seed)
  names = data.TRAIN_FIELDS + (evaluator.fields if evaluator else ())
  totals = {}
  with jax.set_mesh(sampler.mesh), nn.logical_axis_rules(sampler.rules):
    for _ in range(batches):
      batch = data.to_global_batch(data.fields(next(rows), names),
                                   parallelism.batch_sharding(sampler.mesh))
      for key, value in jax.device_get(step_fn(sampler.params, batch)).items():
        totals[key] = totals.get(key, 0.0) + float(value)
  rows.close()
  record = {"step": step, "length": length,
            "eval_loss": totals["loss_sum"] / max(totals["tokens"], 1.0),
            "answers": totals.get("answers", 0)}
  record.update(evaluator.metrics(totals) if evaluator else {})
  return record


def main(argv: list[str]) -> None:
  f = run_flags.parse_run_flags(argv, define_flags)
  run_flags.use_cpu_devices(f.config)
  for length in [int(x) for x in f.lengths.split(",")]:
    print(json.dumps(evaluate(f.workdir, f.config, f.step, length, f.batches)), flush=True)


if __name__ == "__main__":
  main(sys.argv)
