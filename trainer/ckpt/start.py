"""The state step 0 starts from: random weights from the seed, or a Hugging Face checkpoint's
(`init.from_hf`). Shared by the loop, the sampler's untrained baseline and `--from_hf`."""

from __future__ import annotations

from typing import Any, Callable

import jax
import ml_collections

from trainer.ckpt import hf_import
from trainer.core.state import TrainState, state_from_params
from trainer.core.training import Training, model_config


def initial_state(config: ml_collections.ConfigDict, parts: Training,
                  log: Callable[[str], None]) -> TrainState:
  """Step 0's state: random weights from the seed, or a Hugging Face checkpoint's."""
  if not config.init.from_hf:
    return parts.init_fn(jax.random.key(config.seed))
  return state_from_params(initial_params(config, parts, log), parts.optimizer,
                           parts.shardings)


def initial_params(config: ml_collections.ConfigDict, parts: Training,
                   log: Callable[[str], None]) -> Any:
  """Step 0's parameters (the sampler's untrained baseline, and a Hugging Face checkpoint
  sampled as it is): a checkpoint's are read without building an optimizer state."""
  if not config.init.from_hf:
    return parts.init_fn(jax.random.key(config.seed)).params
  log(f"loading weights from {config.init.from_hf}")
  return hf_import.load_params(config.init.from_hf, model_config(config),
                               parts.abstract_state.params, log)
