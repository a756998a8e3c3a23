"""What a training run is built from, once, before its first step: the mesh and stages, the
prepared data and tokenizer, the checkpointer, and the state it starts or resumes from."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections
from jax.experimental import multihost_utils

import data
import parallelism
from model import ModelConfig, dense_line
from model.config import LOCAL
from trainer.ckpt.checkpointing import Checkpointer
from trainer.ckpt.resume import (checkpoint_meta, compatibility_check, config_dict, config_path,
                                 file_sha256, start_warning)
from trainer.config import span_plan, stages
from trainer.config import workdir as workdir_lock
from trainer.config.config_check import ConfigError, block_kernels
from trainer.core.state import TrainState
from trainer.core.training import build_training, data_config, model_config
from trainer.run import distributed, host_memory
from trainer.track import wandb_tracker
from trainer.track.provenance import run_records
from trainer.track.tracking import ConsoleTracker, JsonlTracker, Tracker


@dataclasses.dataclass
class Setup:
  """A run's parts that every stage shares."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: Any
  stages: list[stages.Stage]
  data_cfg: data.DataConfig
  tokenizer_file: str
  plan: bytes  # The span plan's bytes (model.head_spans; b"": none), copied once accepted.
  meta: dict[str, Any]  # What every checkpoint records of the run (resume checks read it).
  records: dict[str, Any] | None  # provenance and resolved settings; process 0 only
  log: Callable[[str], None]  # Prints on process 0, nothing elsewhere.
  checkpointer: Checkpointer


def prepare(config: ml_collections.ConfigDict, workdir: str, is_writer: bool) -> Setup:
  """Checks the host can hold the state, prepares the data and tokenizer (process 0 first),
  and opens the checkpointer (the caller closes it)."""
  mesh = parallelism.make_mesh(config.mesh)
  all_stages = stages.resolve(config)
  # The stages share the dataset, tokenizer and model shape: only the row length differs.
  model_cfg, data_cfg = model_config(config), data_config(config)
  if jax.default_backend() == "cpu":  # Before anything is allocated: the OS kills silently.
    with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
      distributed.stop_together(
          host_memory.cpu_state_problem(build_training(config, mesh).abstract_state),
          "its host's memory cannot hold its part of the training state")
  _prepare_data(data_cfg, is_writer)
  data.check_vocab(data_cfg, model_cfg.vocab_size)
  tokenizer_file = data.tokenizer_path(data_cfg)
  tokenizer_sha256 = file_sha256(tokenizer_file)  # Read once: checked on restore, then stored.
  corpus = data.corpus_id(data_cfg)  # The same: its data position indexes these documents.
  distributed.same_everywhere(corpus, "prepared corpus")  # Else a check stops some of them.
  distributed.same_everywhere(tokenizer_sha256, "tokenizer file")
  plan = span_plan.read(config)  # Read once, like the tokenizer: checked on restore, kept.
  distributed.same_everywhere(span_plan.sha256(plan), "span plan (model.head_spans)")
  log = (lambda line: print(line, flush=True)) if is_writer else (lambda line: None)
  if jax.default_backend() == "cpu" and any(s.config.train.remat == "offload" for s in all_stages):
    log("train.remat='offload' on the CPU: there is no device memory apart from the host's "
        "to relieve, so the layer inputs stay put and it runs as 'full'")
  # Created after data preparation, and closed on every path: an Orbax manager left open
  # by an early error prints background-thread tracebacks at interpreter exit.
  checkpointer = Checkpointer(workdir, config.checkpoint.every_steps, config.checkpoint.keep,
                              config.checkpoint.async_save)
  return Setup(config, workdir, mesh, all_stages, data_cfg, tokenizer_file, plan,
               checkpoint_meta(config, tokenizer_sha256, corpus, span_plan.sha256(plan)),
               run_records(config) if is_writer else None, log, checkpointer)


def restore(setup: Setup, start_over: bool) -> tuple[int, TrainState | None, dict | None]:
  """(step, state, data position) of the newest usable checkpoint, each read as the state of
  the stage that wrote it, or (0, None, None); writes config.json and says where it starts.
  Call under the mesh and the config's axis rules."""
  config, workdir, all_stages = setup.config, setup.workdir, setup.stages
  changes: list[str] = []
  check = compatibility_check(config, workdir, setup.tokenizer_file,
                              setup.meta["tokenizer_sha256"], setup.meta["corpus"], changes,
                              setup.meta["head_spans_sha256"])

  def check_with_stage(step: int, meta: dict) -> None:
    # The stage first: it names the change (stages added or removed, a begun stage's steps
    # moved) that the config comparison would report as a bare field.
    problem = stages.check_checkpoint(all_stages, step, meta)
    if problem:
      raise ConfigError(problem)
    check(step, meta)

  def abstract_state(step: int):
    return build_training(stages.holding(all_stages, step).config, setup.mesh).abstract_state

  restored = setup.checkpointer.restore(abstract_state, check_with_stage, start_over)
  if setup.records is not None:  # After the restore: an older checkpoint is checked first.
    written = {**config_dict(config), **setup.records}
    workdir_lock.write_atomically(config_path(workdir),
                                  json.dumps(written, indent=2, sort_keys=True))
    # The writer alone: other hosts keep reading their own file of the same hash.
    span_plan.keep(setup.plan, [config, *(stage.config for stage in all_stages)], workdir)
  step, state, data_state = restored[:3] if restored else (0, None, None)
  if restored:
    setup.log(f"resuming from step {step} ({setup.checkpointer.directory}/{step})"
              + (f"; changed: {', '.join(changes)}" if changes else ""))
  warning = start_warning(workdir, step if restored else None, start_over)
  if warning:
    setup.log(warning)
  if not setup.checkpointer.saves:
    setup.log("note: checkpoint.every_steps=0: this run saves no checkpoint (nothing to "
              "resume)")
  return step, state, data_state


def make_trackers(config: ml_collections.ConfigDict, workdir: str, records: dict[str, Any],
                  total_steps: int, step: int) -> list[Tracker]:
  """The trackers of process 0 for this run: JSONL, console, and W&B unless disabled or
  there is nothing left to train (a W&B run, or an online start's wait, for no step)."""
  return [JsonlTracker(os.path.join(workdir, "metrics.jsonl")), ConsoleTracker(total_steps),
          *([wandb_tracker.make(config, workdir, records)] if step < total_steps else [])]


def make_iterator(config: ml_collections.ConfigDict, model_cfg: ModelConfig, mesh, split: str,
                  seed: int):
  """This process's rows of `split`, permuted into the model's layout for the mesh's ring."""
  data_cfg = data_config(config)
  rows = data.process_rows(parallelism.batch_sharding(mesh), config.train.batch_size,
                           data_cfg.seq_len)
  return data.make_iterator(
      data_cfg, split=split, global_batch_size=config.train.batch_size,
      layout=model_cfg.layout, num_shards=mesh.shape["sequence"], seed=seed,
      repeat=True, rows=rows)


def stage_lines(stage: stages.Stage, model_cfg: ModelConfig, step: int) -> list[str]:
  """What a stage says as it starts (or resumes): its steps and settings, when the run has
  stages, and what computes its attention."""
  if step >= stage.last_step:
    return []
  lines = [_stage_line(stage, step)] if stage.name else []
  return lines + [_kernel_line(stage.config, model_cfg)]


def _stage_line(stage: stages.Stage, step: int) -> str:
  cfg = stage.config
  rope = cfg.model.rope_scaling
  scaling = f", {rope.type} x{rope.factor:g}" if rope.type != "default" else ""
  origin = (f"resuming at step {step}" if step >= stage.first_step else
            "from step 0's weights" if stage.index == 0 else
            f"from step {step}'s weights, optimizer "
            f"{'kept' if stage.keep_optimizer else 'reset'}")
  return (f"{stage.label}: steps {stage.first_step}-{stage.last_step}, "
          f"{cfg.data.seq_len:,} tokens per row, RoPE theta {cfg.model.rope_theta:g}{scaling}, "
          f"lr {cfg.train.lr:g}; {origin}")


def _kernel_line(config: ml_collections.ConfigDict, model_cfg: ModelConfig) -> str:
  if model_cfg.attention == "dense":
    return dense_line(model_cfg) + _local_part(model_cfg)
  named = parallelism.describe_kernel(model_cfg.kernel)  # 'xla', or 'auto on gpu: cudnn'
  kernels, with_why = block_kernels(config, jax.device_count())
  if kernels != parallelism.resolve_kernel(model_cfg.kernel):
    # e.g. 'auto on gpu: xla (the pallas kernel cannot take these attention blocks (...))'
    named = f"{named.rsplit(':', 1)[0]}: {with_why}"
  return f"attention: {model_cfg.attention}, block kernel {named}{_local_part(model_cfg)}"


def _local_part(model_cfg: ModelConfig) -> str:
  """'; local layers LGLG (L: window 32)' (or the range of a span plan's heads), the soft
  cap and hash attention's buckets, when the model has them."""
  kinds = model_cfg.layer_kinds
  local = ""
  if model_cfg.head_spans and LOCAL in kinds:
    widest = model_cfg.window_of(LOCAL)
    narrowest = model_cfg.narrowest_span or widest
    local = (f"; local layers {kinds} (L: per-head spans of {narrowest}-{widest} keys from "
             f"{model_cfg.head_spans})")
  elif model_cfg.window:
    local = f"; local layers {kinds} (L: window {model_cfg.window})"
  cap = (f"; logits soft-capped at {model_cfg.attention_softcap:g}"
         if model_cfg.attention_softcap else "")
  sparse = {"hash": f"; hash attention, {model_cfg.hash_buckets} buckets",
            "qk_drop": f"; QK-dropping at rate {model_cfg.qk_drop_rate:g}",
            "sparsek": f"; SparseK, {model_cfg.sparsek_k} keys per query beside a window of "
                       f"{model_cfg.sparsek_window}"}
  return local + cap + sparse.get(model_cfg.sparse, "")


def _prepare_data(data_cfg: data.DataConfig, is_writer: bool) -> None:
  """Process 0 prepares first; the others then find it done on a shared disk, or build their
  own copy on a local one, but never race process 0 for the same files."""
  if jax.process_count() == 1:
    data.prepare(data_cfg)
    return
  if is_writer:
    data.prepare(data_cfg)
  multihost_utils.sync_global_devices("data prepared by process 0")
  if not is_writer:
    data.prepare(data_cfg)
