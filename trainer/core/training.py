"""What a config trains with: the model and data configs, and on a mesh the model, optimizer,
state shardings and jitted train step. Shared by the loop, the dry-run planner, export and
the sampler; holds no loop, so the sampler can build what the loop builds without the
loop importing it back."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import ml_collections
import optax

import data
import parallelism
from model import Decoder, ModelConfig
from trainer.core.optimizer import make_optimizer, make_schedule
from trainer.core.state import TrainState, abstract_state, shardings_of
from trainer.core.step import jit_train_step


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict(), span_length=config.data.seq_len,
                     remat=config.train.remat,
                     loss_chunk=config.train.loss_chunk)


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


def build_training(config: ml_collections.ConfigDict, mesh) -> Training:
  """Model, optimizer, state shardings and the jitted train step of `config` on `mesh`.

  Shared by the loop and the dry-run planner; call it under `jax.set_mesh(mesh)` (the
  planner: the mesh's abstract mesh, its devices may be described only) and the config's
  logical axis rules.
  """
  model, optimizer = Decoder(model_config(config)), make_optimizer(config.train)
  batch_sharding = parallelism.batch_sharding(mesh)
  state = abstract_state(model, optimizer, mesh, config.mesh.rules)
  shardings = shardings_of(state)
  step_fn = jit_train_step(model, optimizer, make_schedule(config.train),
                           config.train.micro_batches, shardings, batch_sharding)
  return Training(model, optimizer, shardings, state, batch_sharding, step_fn)
