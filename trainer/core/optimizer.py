"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import ml_collections
import optax


class OptimizerSettings(NamedTuple):
  """Every `config.train` value the optimizer and its schedule read (and nothing else), so
  that equal settings mean an equal optimizer (`trainer.core.training` reuses a traced step)."""
  lr: float
  schedule_length: int
  warmup_steps: int
  min_lr_ratio: float
  weight_decay: float
  b1: float
  b2: float
  grad_clip: float


def optimizer_settings(train: ml_collections.ConfigDict) -> OptimizerSettings:
  # The schedule's length is its own field so that a run stopped early and resumed, or
  # extended, can keep the learning rate of the run it continues; 0 means train.steps.
  return OptimizerSettings(train.lr, train.schedule_steps or train.steps, train.warmup_steps,
                           train.min_lr_ratio, train.weight_decay, train.b1, train.b2,
                           train.grad_clip)


def make_schedule(train: ml_collections.ConfigDict | OptimizerSettings) -> optax.Schedule:
  """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` at the schedule's end."""
  s = train if isinstance(train, OptimizerSettings) else optimizer_settings(train)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=s.lr, warmup_steps=s.warmup_steps,
      decay_steps=max(s.schedule_length, s.warmup_steps + 1),
      end_value=s.lr * s.min_lr_ratio)


def _decay_mask(params):
  # Decay matrices only: norm scales are gains, shrinking them towards 0 hurts.
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def make_optimizer(train: ml_collections.ConfigDict | OptimizerSettings,
                   ) -> optax.GradientTransformation:
  """AdamW on `config.train` (or its `OptimizerSettings`)."""
  s = train if isinstance(train, OptimizerSettings) else optimizer_settings(train)
  clip = [optax.clip_by_global_norm(s.grad_clip)] if s.grad_clip > 0 else []
  return optax.chain(*clip, optax.adamw(
      make_schedule(s), b1=s.b1, b2=s.b2, weight_decay=s.weight_decay, mask=_decay_mask))
