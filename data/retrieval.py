"""Retrieval accuracy: the evaluator the synthetic corpus provides.

An answer token of `synthetic_longrange` can only be predicted by attending back to its
fact; the batch field `answer_distance` says how far back (0 elsewhere). The evaluator counts,
over an eval, how often the model's top guess at an answer token is right, overall and per
distance bucket, so a run shows how far its attention reaches. Only eval batches carry the
field; training never sees it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Evaluator(NamedTuple):
  """What a dataset adds to the trainer's eval: batch fields, per-batch sums, and metrics."""
  fields: tuple[str, ...]  # Batch fields beyond training's that `sums` reads.
  # (whether each token's argmax is its target [B, S], batch) -> sums; jitted, additive.
  sums: Callable[[jax.Array, dict[str, jax.Array]], dict[str, jax.Array]]
  metrics: Callable[[dict[str, float]], dict[str, float]]  # From the eval's summed totals.


def distance_buckets() -> list[tuple[int, int]]:
  """[low, high) token distances of the buckets: 1-15, 16-63, ... up to 1M."""
  edges = [1] + [4 ** k for k in range(2, 11)]
  return list(zip(edges[:-1], edges[1:]))


def _sums(hit_BS: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  distance_BS = batch["answer_distance"]
  answer_BS = (distance_BS > 0).astype(jnp.float32) * batch["loss_mask"].astype(jnp.float32)
  correct_BS = hit_BS.astype(jnp.float32)
  sums = {"answers": jnp.sum(answer_BS), "answers_correct": jnp.sum(answer_BS * correct_BS)}
  for low, high in distance_buckets():
    in_bucket_BS = answer_BS * ((distance_BS >= low) & (distance_BS < high))
    sums[f"answers_{low}"] = jnp.sum(in_bucket_BS)
    sums[f"answers_correct_{low}"] = jnp.sum(in_bucket_BS * correct_BS)
  return sums


def _metrics(totals: dict[str, float]) -> dict[str, float]:
  if not totals.get("answers"):
    return {}
  metrics = {"eval_retrieval_accuracy": totals["answers_correct"] / totals["answers"]}
  for low, high in distance_buckets():
    if totals[f"answers_{low}"]:
      metrics[f"eval_retrieval_accuracy_{low}_{high}"] = (
          totals[f"answers_correct_{low}"] / totals[f"answers_{low}"])
  return metrics


RETRIEVAL = Evaluator(("answer_distance",), _sums, _metrics)
