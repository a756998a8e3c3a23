"""The host loop: build everything from the config, resume, then dispatch steps and log behind.

The loop dispatches step N before it reads step N-1's metrics, so the device always has
queued work and never waits for the host's logging.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import ml_collections
from jax.experimental import multihost_utils

import data
import parallelism
from model import ModelConfig, dense_line
from trainer.ckpt.checkpointing import CheckpointError, Checkpointer
from trainer.ckpt.resume import (checkpoint_meta, compatibility_check, config_dict, config_path,
                                 file_sha256, start_warning)
from trainer.ckpt.start import initial_state
from trainer.config import flops, stages
from trainer.config import workdir as workdir_lock
from trainer.config.config_check import ConfigError, attention_split
from trainer.core.state import TrainState, carry_over_stage
from trainer.core.step import eval_step
from trainer.core.training import build_training, data_config, model_config
from trainer.run import distributed, host_memory
from trainer.run.stop_signals import StopSignals
from trainer.track import wandb_tracker
from trainer.track.profiling import StepProfiler
from trainer.track.provenance import run_records
from trainer.track.tracking import ConsoleTracker, JsonlTracker, Tracker, device_memory_bytes


class NonFiniteError(RuntimeError):
  """The loss or gradient of a step was NaN or Inf and the config says stop."""


# Makes one periodic evaluation for a stage's config on the mesh (None: the config asks for
# none); what it makes maps the parameters to metrics for the eval line.
PeriodicEvalMaker = Callable[[ml_collections.ConfigDict, Any],
                             Callable[[Any], dict[str, float]] | None]


def train(config: ml_collections.ConfigDict, workdir: str, start_over: bool = False,
          profile_steps: tuple[int, int] | None = None,
          periodic_evals: Sequence[PeriodicEvalMaker] = ()) -> dict[str, Any]:
  """Trains up to `config.train.steps`, resuming from `workdir` when it holds a checkpoint.

  Holds the workdir's lock throughout (one run per workdir). `start_over` allows a fresh
  start beside damaged checkpoints set aside in `checkpoints_unusable/`; `profile_steps`
  (first, last) traces those steps (trainer/track/profiling.py); `periodic_evals` make the
  evaluations that run beside the eval loss (the needle grid's, from the command), each
  given a stage's config and the mesh, None where that config asks for none. Returns a summary
  (first/last loss, median speed, final step, whether a signal stopped it).
  """
  is_writer = jax.process_index() == 0
  with StopSignals() as signals:
    if is_writer:
      workdir_lock.claim(workdir)
    try:
      return _train(config, workdir, start_over, signals, is_writer, profile_steps,
                    periodic_evals)
    finally:
      if is_writer:
        workdir_lock.release(workdir)


def _train(config, workdir: str, start_over: bool, signals: StopSignals, is_writer: bool,
           profile_steps: tuple[int, int] | None,
           periodic_evals: Sequence[PeriodicEvalMaker]) -> dict[str, Any]:
  mesh = parallelism.make_mesh(config.mesh)
  plan = stages.plan(config)
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
  records = run_records(config) if is_writer else None  # For config.json and W&B alike.
  log = (lambda line: print(line, flush=True)) if is_writer else (lambda line: None)

  if jax.default_backend() == "cpu" and any(s.config.train.remat == "offload" for s in plan):
    log("train.remat='offload' on the CPU: there is no device memory apart from the host's "
        "to relieve, so the layer inputs stay put and it runs as 'full'")
  # Created after data preparation, and closed on every path: an Orbax manager left open
  # by an early error prints background-thread tracebacks at interpreter exit.
  checkpointer = Checkpointer(workdir, config.checkpoint.every_steps, config.checkpoint.keep,
                              config.checkpoint.async_save)
  trackers, iterator = [], None
  profiler = StepProfiler(profile_steps, workdir, log)
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
      changes: list[str] = []
      check = compatibility_check(config, workdir, tokenizer_file, tokenizer_sha256, corpus,
                                  changes)

      def check_with_stage(step: int, meta: dict) -> None:
        # The stage first: it names the change (stages added or removed, a begun stage's
        # steps moved) that the config comparison would report as a bare field.
        problem = stages.check_checkpoint(plan, step, meta)
        if problem:
          raise ConfigError(problem)
        check(step, meta)

      # Each checkpoint is read as the state of the stage that wrote it.
      restored = checkpointer.restore(
          lambda step: build_training(stages.holding(plan, step).config, mesh).abstract_state,
          check_with_stage, start_over)
      if is_writer:  # After the restore: an older checkpoint is checked against the old one.
        written = {**config_dict(config), **records}
        workdir_lock.write_atomically(config_path(workdir),
                                      json.dumps(written, indent=2, sort_keys=True))
      step, state, data_state = restored[:3] if restored else (0, None, None)
      if restored:
        log(f"resuming from step {step} ({checkpointer.directory}/{step})"
            + (f"; changed: {', '.join(changes)}" if changes else ""))
      warning = start_warning(workdir, step if restored else None, start_over)
      if warning:
        log(warning)
      if not checkpointer.saves:
        log("note: checkpoint.every_steps=0: this run saves no checkpoint (nothing to resume)")
      summaries = []
      try:
        for stage in plan[stages.next_to_run(plan, step).index:]:
          parts = build_training(stage.config, mesh)
          stage_model_cfg = model_config(stage.config)
          if state is None:
            state = initial_state(stage.config, parts, log)
          elif step == stage.first_step - 1 and stage.index > 0:
            state = carry_over_stage(state, parts.optimizer, parts.shardings,
                                     stage.keep_optimizer)
            data_state = None  # Each stage reads the data afresh, with a seed of its own.
          if stage.name and step < stage.last_step:
            log(_stage_line(stage, step))
          if step < stage.last_step:
            log(_kernel_line(stage.config, stage_model_cfg))
          iterator = _make_iterator(stage.config, stage_model_cfg, mesh, data_cfg.train_split,
                                    stages.data_seed(config.seed, stage.index))
          if data_state is not None:
            iterator.set_state(data_state)
          evaluator = data.evaluator_of(data_config(stage.config))
          eval_fn = jax.jit(
              functools.partial(eval_step, model=parts.model, evaluator=evaluator),
              in_shardings=(parts.shardings.params, parts.batch_sharding))
          if is_writer and not trackers:  # Once the first step is near: files, W&B run.
            trackers = make_trackers(config, workdir, records, plan[-1].last_step, step)
          run = _Run(stage, stage_model_cfg, mesh, checkpointer, trackers, iterator, eval_fn,
                     evaluator, {**checkpoint_meta(config, tokenizer_sha256, corpus),
                                 **stage.checkpoint_meta()}, periodic_evals)
          state, summary = run.loop(state, parts.step_fn, step, signals, profiler)
          iterator.close()
          iterator = None
          summaries.append(summary)
          if summary["stopped_by_signal"]:
            break
          step, data_state = stage.last_step, None
        checkpointer.wait()  # An async save that failed raises here: the exit is non-zero.
      except BaseException:
        # Let saves already started commit; the original error is the one to report.
        try:
          checkpointer.wait()
        except CheckpointError as error:
          print(f"also: {error}", flush=True)
        raise
  finally:
    profiler.close()
    if iterator is not None:
      iterator.close()
    checkpointer.close()
    for tracker in trackers:
      tracker.close()
  return _combined(summaries)


def _kernel_line(config: ml_collections.ConfigDict, model_cfg: ModelConfig) -> str:
  """What computes the attention, as the run starts (a stage may change it)."""
  if model_cfg.attention == "dense":
    return dense_line(model_cfg)
  split = attention_split(config, jax.device_count())
  described = parallelism.describe_kernel(model_cfg.kernel)
  if split.kernel_fallback:  # e.g. 'auto on gpu: xla (the pallas kernel cannot take ...)'
    described = f"{described.rsplit(':', 1)[0]}: {split.kernel} ({split.kernel_fallback})"
  return f"attention: {model_cfg.attention}, block kernel {described}"


def _stage_line(stage: stages.Stage, step: int) -> str:
  """The console line a stage starts (or resumes) with: what it trains and from where."""
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


def _combined(summaries: list[dict[str, Any]]) -> dict[str, Any]:
  """One summary of the stages run: the last stage's, with the first loss of the first."""
  summary = dict(summaries[-1])
  losses = [s["first_loss"] for s in summaries if s["first_loss"] is not None]
  summary["first_loss"] = losses[0] if losses else None
  summary["skipped_steps"] = sum(s["skipped_steps"] for s in summaries)
  return summary


def make_trackers(config: ml_collections.ConfigDict, workdir: str, records: dict[str, Any],
                  total_steps: int, step: int) -> list[Tracker]:
  """The trackers of process 0 for this run: JSONL, console, and W&B unless disabled or
  there is nothing left to train (a W&B run, or an online start's wait, for no step)."""
  return [JsonlTracker(os.path.join(workdir, "metrics.jsonl")), ConsoleTracker(total_steps),
          *([wandb_tracker.make(config, workdir, records)] if step < total_steps else [])]


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


def _make_iterator(config, model_cfg, mesh, split, seed):
  data_cfg = data_config(config)
  rows = data.process_rows(parallelism.batch_sharding(mesh), config.train.batch_size,
                           data_cfg.seq_len)
  return data.make_iterator(
      data_cfg, split=split, global_batch_size=config.train.batch_size,
      layout=model_cfg.layout, num_shards=mesh.shape["sequence"], seed=seed,
      repeat=True, rows=rows)


class _Run:
  """The state of one pass of the host loop: timing, pending metrics, records."""

  def __init__(self, stage: stages.Stage, model_cfg, mesh, checkpointer, trackers, iterator,
               eval_fn, evaluator, meta, periodic_evals: Sequence[PeriodicEvalMaker]):
    config = stage.config
    self.stage, self.config, self.model_cfg, self.mesh = stage, config, model_cfg, mesh
    self.meta = meta
    self.checkpointer, self.trackers = checkpointer, trackers
    self.iterator, self.eval_fn, self.evaluator = iterator, eval_fn, evaluator
    self.tokens_per_step = config.train.batch_size * config.data.seq_len
    self.flops_token = flops.flops_per_token(model_cfg, config.data.seq_len)
    self.peak = flops.peak_flops(config, jax.devices()[0].device_kind)
    self.records: list[dict[str, Any]] = []
    self.skipped = 0
    self.make_periodic = periodic_evals
    self.periodic = None  # Made at the first eval (a sampler each: not for runs that never eval).

  def loop(self, state, step_fn, start: int, signals: StopSignals,
           profiler: StepProfiler) -> tuple[TrainState, dict[str, Any]]:
    """Trains from step `start` to the stage's last step; the last state and a summary."""
    steps = self.config.train.steps
    sharding = parallelism.batch_sharding(self.mesh)
    self.last_time, self.last_step = time.monotonic(), start
    self.start_step = start
    self._pending = None  # (step, metrics) dispatched but not read yet.
    stop = None
    signals.in_loop = True
    self.reached = start
    for step in range(start + 1, steps + 1):
      self.reached = step
      if profiler.starts_at(step):
        self._read_pending()
        profiler.start(step)
        self._restart_clock(step - 1)  # Starting the trace is not step time.
      profiler.before(step)  # The trace holds the step's batch too.
      batch = data.to_global_batch(data.fields(next(self.iterator), data.TRAIN_FIELDS),
                                   sharding, self.config.train.batch_size)
      state, metrics = step_fn(state, batch)
      self.checkpointer.check()  # A failed background save stops the run now.
      self._read_pending()
      self._pending = (step, metrics)
      if profiler.ends_at(step):
        self._read_pending()  # Inside the trace: the step's results are computed.
        profiler.close()
        self._restart_clock(step)  # Writing the trace out is not step time.
      stop = signals.received or self.checkpointer.reached_preemption(step)
      if self.checkpointer.due(step) or (self.checkpointer.saves and (step == steps or stop)):
        self._read_pending()  # Know the step was finite before its state is saved.
        self.checkpointer.save(step, state, data.gather_state(self.iterator.get_state()),
                               self.meta)
        self._restart_clock(step)  # Save time is not step time.
      if self.config.train.eval_every and (step % self.config.train.eval_every == 0
                                           or step == steps):
        self._read_pending()
        self._evaluate(state, step)
        self._restart_clock(step)
      if stop:
        print(f"stopping at step {step} on {signals.received or 'preemption'}: "
              + ("saved a checkpoint; re-run with the same --workdir to resume"
                 if self.checkpointer.saves else "checkpoint.every_steps=0 keeps no "
                 "checkpoint, so a re-run starts over"), flush=True)
        break
    self._read_pending()
    return state, self._summarise(stopped=bool(stop))

  def _read_pending(self) -> None:
    """Reads the step in flight, if any (before host work that must not overlap it)."""
    if self._pending:
      self._read(*self._pending)
      self._pending = None

  def _read(self, step: int, metrics) -> None:
    """Reads a step's metrics (blocking until it is done; the next step is queued)."""
    values = jax.device_get(metrics)
    if not values["finite"]:
      self._non_finite(step)
    if step % self.config.train.log_every and step != self.config.train.steps:
      return
    now = time.monotonic()
    step_time = (now - self.last_time) / (step - self.last_step)
    tokens_per_sec = self.tokens_per_step / step_time
    record = {
        "step": step, "loss": float(values["loss"]), "grad_norm": float(values["grad_norm"]),
        "lr": float(values["lr"]), "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": tokens_per_sec / jax.device_count(),
        "step_time_s": step_time,
        "mfu": flops.mfu(self.flops_token, tokens_per_sec, jax.device_count(), self.peak),
        "device_memory_bytes": device_memory_bytes(),  # None where unreported (CPU).
        "attention": self.model_cfg.attention,
        "warmup": not self.records,  # The first interval includes compilation.
        "time": time.time(), **self.stage.record()}
    self.records.append(record)
    for tracker in self.trackers:
      tracker.log(record)
    self.last_time, self.last_step = now, step

  def _non_finite(self, step: int) -> None:
    last_good = self.checkpointer.latest_committed()
    where = (f"the last good checkpoint is step {last_good} in {self.checkpointer.directory}"
             if last_good is not None else "there is no checkpoint yet")
    if self.config.train.on_nonfinite == "skip":
      self.skipped += 1
      print(f"warning: non-finite loss or gradient at step {step}; update skipped "
            f"({self.skipped} so far)", flush=True)
      return
    raise NonFiniteError(f"non-finite loss or gradient at step {step}; the update was not "
                         f"applied and the run stops; {where}")

  def _evaluate(self, state, step: int) -> None:
    cfg = self.config
    iterator = _make_iterator(cfg, self.model_cfg, self.mesh, cfg.data.eval_split, cfg.seed)
    sharding = parallelism.batch_sharding(self.mesh)
    names = data.TRAIN_FIELDS + (self.evaluator.fields if self.evaluator else ())
    totals: dict[str, float] = {}
    try:
      for _ in range(cfg.train.eval_steps):
        batch = data.to_global_batch(data.fields(next(iterator), names), sharding,
                                     cfg.train.batch_size)
        sums = self.eval_fn(state.params, batch)
        for key, value in jax.device_get(sums).items():
          totals[key] = totals.get(key, 0.0) + float(value)
    finally:
      iterator.close()  # A fresh iterator per eval: stop its prefetch thread now, not at exit.
    record = {"step": step, "eval_loss": totals["loss_sum"] / max(totals["tokens"], 1.0),
              **self.stage.record()}
    if self.evaluator:
      record.update(self.evaluator.metrics(totals))
    if self.periodic is None:
      self.periodic = [e for e in (make(cfg, self.mesh) for make in self.make_periodic) if e]
    for evaluate in self.periodic:
      record.update(evaluate(state.params))
    for tracker in self.trackers:
      tracker.log(record)

  def _restart_clock(self, step: int) -> None:
    """Starts step timing afresh after host work (save, eval) with nothing in flight."""
    self.last_time, self.last_step = time.monotonic(), step

  def _summarise(self, stopped: bool) -> dict[str, Any]:
    timed = [r["tokens_per_sec"] for r in self.records if not r["warmup"]]
    first, last = (self.records[0], self.records[-1]) if self.records else ({}, {})
    summary = {"first_loss": first.get("loss"), "last_loss": last.get("loss"),
               "median_tokens_per_sec": statistics.median(timed) if timed else None,
               "steps": self.reached,  # A stop on a signal may come between logged steps.
               "stopped_by_signal": stopped, "skipped_steps": self.skipped}
    if self.trackers and self.records:
      speed = (f"{summary['median_tokens_per_sec']:,.0f} tok/s median after warm-up"
               if timed else "too few steps to time")
      label = f"{self.stage.label} " if self.stage.name else ""
      # The steps of both losses: the first logged one is not step 0's.
      losses = " -> ".join(f"{r['loss']:.4f} (step {r['step']})"
                           for r in ([first] if first is last else [first, last]))
      print(f"{label}{'stopped' if stopped else 'done'}: step {self.reached}, loss {losses}, "
            f"{speed}", flush=True)
    elif self.trackers and not stopped:
      print(f"nothing to do: the run is already at step {self.start_step}", flush=True)
    return summary
