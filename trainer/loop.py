"""The host loop: build everything from the config, then dispatch steps and log behind them.

The loop dispatches step N before it reads step N-1's metrics, so the device always has
queued work and never waits for the host's logging.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Any, Iterator

import flax.linen as nn
import jax
import ml_collections
import numpy as np

import data
import parallelism
from model import Decoder, ModelConfig
from trainer import flops
from trainer.optimizer import make_optimizer, make_schedule
from trainer.state import init_state, state_shardings
from trainer.step import eval_step, train_step
from trainer.tracking import ConsoleTracker, JsonlTracker


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict(), remat=config.train.remat)


def data_config(config: ml_collections.ConfigDict) -> data.DataConfig:
  return data.DataConfig(**config.data.to_dict())


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains `config.train.steps` steps; returns a summary (first/last loss, median speed)."""
  mesh = parallelism.make_mesh(config.mesh)
  model_cfg = model_config(config)
  data_cfg = data_config(config)
  data.prepare(data_cfg)
  data.check_vocab(data_cfg, model_cfg.vocab_size)
  is_writer = jax.process_index() == 0
  if is_writer:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  trackers = [JsonlTracker(os.path.join(workdir, "metrics.jsonl")),
              ConsoleTracker(config.train.steps)] if is_writer else []

  model = Decoder(model_cfg)
  optimizer = make_optimizer(config.train)
  batch_sharding = parallelism.batch_sharding(mesh)
  rows = parallelism.batch_shards(mesh)  # Smallest batch that shards: enough for init shapes.
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    shardings = state_shardings(model, optimizer, mesh, config.mesh.rules, rows,
                                data_cfg.seq_len)
    state = init_state(model, optimizer, shardings, config.seed, rows, data_cfg.seq_len)
    step_fn = jax.jit(
        functools.partial(train_step, model=model, optimizer=optimizer,
                          schedule=make_schedule(config.train)),
        in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
        donate_argnums=0)
    eval_fn = jax.jit(functools.partial(eval_step, model=model),
                      in_shardings=(shardings.params, batch_sharding))
    batches = _global_batches(config, data_cfg, model_cfg, mesh, data_cfg.train_split)
    summary = _run(config, state, step_fn, eval_fn, batches, trackers, model_cfg, mesh)
  for tracker in trackers:
    tracker.close()
  return summary


def _global_batches(config, data_cfg, model_cfg, mesh, split, repeat=True) -> Iterator[dict]:
  iterator = data.make_iterator(
      data_cfg, split=split, global_batch_size=config.train.batch_size,
      layout=model_cfg.layout, num_shards=mesh.shape["sequence"], seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count(), repeat=repeat)
  sharding = parallelism.batch_sharding(mesh)
  for batch in iterator:
    yield data.to_global_batch(batch, sharding)


def _run(config, state, step_fn, eval_fn, batches, trackers, model_cfg, mesh) -> dict[str, Any]:
  steps, log_every = config.train.steps, config.train.log_every
  tokens_per_step = config.train.batch_size * config.data.seq_len
  flops_token = flops.flops_per_token(model_cfg, config.data.seq_len)
  peak = flops.PEAK_FLOPS.get(config.accelerator or flops.accelerator_name(
      jax.devices()[0].device_kind) or "")
  pending = None  # (step, metrics) dispatched but not yet read.
  last_time, last_step = time.monotonic(), 0
  records = []

  def emit(step: int, metrics) -> None:
    nonlocal last_time, last_step
    values = jax.device_get(metrics)  # Blocks until that step is done; the next is queued.
    now = time.monotonic()
    step_time = (now - last_time) / (step - last_step)
    tokens_per_sec = tokens_per_step / step_time
    record = {
        "step": step, "loss": float(values["loss"]), "grad_norm": float(values["grad_norm"]),
        "lr": float(values["lr"]), "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": tokens_per_sec / jax.device_count(),
        "step_time_s": step_time,
        "mfu": flops.mfu(flops_token, tokens_per_sec, jax.device_count(), peak),
        "attention": model_cfg.attention, "warmup": last_step == 0, "time": time.time()}
    records.append(record)
    for tracker in trackers:
      tracker.log(record)
    last_time, last_step = now, step

  for step in range(1, steps + 1):
    state, metrics = step_fn(state, next(batches))
    if pending is not None:
      emit(*pending)
      pending = None
    if step % log_every == 0 or step == steps:
      pending = (step, metrics)
    if config.train.eval_every and (step % config.train.eval_every == 0 or step == steps):
      if pending is not None:
        emit(*pending)
        pending = None
      _evaluate(config, state, eval_fn, model_cfg, mesh, step, trackers)
      last_time = time.monotonic()  # Eval time is not train step time.
  if pending is not None:
    emit(*pending)
  return _summarise(records, trackers)


def _evaluate(config, state, eval_fn, model_cfg, mesh, step, trackers) -> None:
  data_cfg = data_config(config)
  batches = _global_batches(config, data_cfg, model_cfg, mesh, data_cfg.eval_split)
  totals: dict[str, float] = {}
  for _ in range(config.train.eval_steps):
    for key, value in jax.device_get(eval_fn(state.params, next(batches))).items():
      totals[key] = totals.get(key, 0.0) + float(value)
  record = {"step": step, "eval_loss": totals["loss_sum"] / max(totals["tokens"], 1.0)}
  if totals.get("answers"):
    record["eval_retrieval_accuracy"] = totals["answers_correct"] / totals["answers"]
  for tracker in trackers:
    tracker.log(record)


def _summarise(records: list[dict[str, Any]], trackers) -> dict[str, Any]:
  timed = [r["tokens_per_sec"] for r in records if not r["warmup"]]
  summary = {"first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
             "median_tokens_per_sec": statistics.median(timed) if timed else None,
             "steps": records[-1]["step"]}
  if trackers:
    speed = (f"{summary['median_tokens_per_sec']:,.0f} tok/s median after warm-up"
             if timed else "too few steps to time")
    print(f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> "
          f"{summary['last_loss']:.4f}, {speed}", flush=True)
  return summary
