"""The model's own config (`model.ModelConfig`) from a run's config: built here only, so the
checks, the planner, the trainer and the Hugging Face import see the same model (its span
plan resolved at the run's sequence length, its remat and loss chunk)."""

from __future__ import annotations

import ml_collections

from model.config import ModelConfig


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict(), span_length=config.data.seq_len,
                     remat=config.train.remat, loss_chunk=config.train.loss_chunk)
