"""What a config trains with: the model and data configs, and on a mesh the model, optimizer,
state shardings and jitted train step. Shared by the loop, the dry-run planner, export and
the sampler; holds no loop, so the sampler can build what the loop builds without the
loop importing it back."""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

import jax
import ml_collections
import optax

import data
import parallelism
from model import Decoder, ModelConfig
from trainer.config.models import model_config
from trainer.core.optimizer import (OptimizerSettings, make_optimizer, make_schedule,
                                    optimizer_settings)
from trainer.core.state import TrainState, abstract_state, jit_init, shardings_of
from trainer.core.step import jit_train_step


def data_config(config: ml_collections.ConfigDict) -> data.DataConfig:
  return data.DataConfig(**config.data.to_dict())


class Training(NamedTuple):
  """What a config trains with on a mesh; nothing in it holds an allocated array."""
  model: Decoder
  optimizer: optax.GradientTransformation
  shardings: TrainState  # NamedShardings of every state leaf, from the rules table.
  abstract_state: TrainState  # ShapeDtypeStructs with those shardings (restores, AOT).
  batch_sharding: jax.sharding.NamedSharding
  step_fn: Any  # The jitted train step.
  init_fn: Any  # The jitted init: a PRNG key -> step 0's state (trainer/core/state.py).


def build_training(config: ml_collections.ConfigDict, mesh) -> Training:
  """Model, optimizer, state shardings and the jitted train step of `config` on `mesh`.

  Shared by the loop and the dry-run planner; call it under `jax.set_mesh(mesh)` (the
  planner: the mesh's abstract mesh, its devices may be described only) and the config's
  logical axis rules.
  """
  cfg, settings = model_config(config), optimizer_settings(config.train)
  spans, rules_json = cfg.spans if cfg.head_spans else None, json.dumps(config.mesh.rules)
  model, optimizer, state, init_fn = _state_parts(cfg, spans, settings, mesh, rules_json)
  batch_sharding = parallelism.batch_sharding(mesh)
  shardings = shardings_of(state)
  leaves, tree = jax.tree.flatten(shardings)
  step_fn = _step_fn(cfg, spans, settings, config.train.micro_batches,
                     tuple(leaves), tree, batch_sharding, rules_json)
  return Training(model, optimizer, shardings, state, batch_sharding, step_fn, init_fn)


@functools.lru_cache(maxsize=8)
def _state_parts(cfg: ModelConfig, spans, settings: OptimizerSettings, mesh, rules_json: str):
  """(model, optimizer, abstract state, jitted init), one per process for each model,
  optimizer, mesh and rules, for the reason `_step_fn` is: the abstract state traces the
  model's init twice and the init once more, seconds of CPU that a repeated run would spend
  again for the same result."""
  del spans
  # The rules as the config holds them (tuples), not as JSON gives them back (lists).
  rules = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                for name, axes in json.loads(rules_json))
  model, optimizer = Decoder(cfg), make_optimizer(settings)
  state = abstract_state(model, optimizer, mesh, rules)
  return model, optimizer, state, jit_init(model, optimizer, shardings_of(state))


@functools.lru_cache(maxsize=8)
def _step_fn(cfg: ModelConfig, spans, settings: OptimizerSettings, micro_batches: int,
             state_leaves: tuple, state_tree, batch_sharding, rules_json: str):
  """The jitted train step, one per process for each set of what defines its program: a
  run that repeats an earlier run's model, optimizer, shardings and rules (a sweep in a
  notebook, a resumed or repeated run, the test suite's many tiny runs) calls the step
  jax has already traced, lowered and compiled, instead of tracing it again (seconds per
  run). `spans` (the plan file's content) and `rules_json` are in the key because the trace
  reads them: the plan from its file, the rules from flax's context around the call."""
  del spans, rules_json
  return jit_train_step(Decoder(cfg), make_optimizer(settings), make_schedule(settings),
                        micro_batches, jax.tree.unflatten(state_tree, state_leaves),
                        batch_sharding)
