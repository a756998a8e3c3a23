"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import ml_collections
import optax


def make_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` at the schedule's end.

  The schedule's length is its own field so that a run stopped early and resumed, or
  extended, can keep the learning rate of the run it continues.
  """
  length = train.schedule_steps or train.steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.lr, warmup_steps=train.warmup_steps,
      decay_steps=max(length, train.warmup_steps + 1),
      end_value=train.lr * train.min_lr_ratio)


def _decay_mask(params):
  # Decay matrices only: norm scales are gains, shrinking them towards 0 hurts.
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  clip = [optax.clip_by_global_norm(train.grad_clip)] if train.grad_clip > 0 else []
  return optax.chain(*clip, optax.adamw(
      make_schedule(train), b1=train.b1, b2=train.b2, weight_decay=train.weight_decay,
      mask=_decay_mask))
