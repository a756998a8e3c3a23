"""One stage's host loop: dispatch step N, then read step N-1's metrics (so the device always
has queued work and never waits for logging), and run the hooks due after each step.

A hook runs every N steps (and, as it asks, at the stage's last step or when a signal
stops the run), with the step in flight read first and its time left out of the steps'.
The stage registers two: saving a checkpoint and evaluating.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import ml_collections

import data
import parallelism
from trainer.config import flops, stages
from trainer.core.state import TrainState
from trainer.core.step import eval_step
from trainer.core.training import Training, data_config
from trainer.run.setup import Setup, make_iterator
from trainer.run.stop_signals import StopSignals
from trainer.track.profiling import StepProfiler
from trainer.track.tracking import Tracker, device_memory_bytes

# Makes one periodic evaluation for a stage's config on the mesh (None: the config asks for
# none); what it makes maps the parameters to metrics for the eval line.
PeriodicEvalMaker = Callable[[ml_collections.ConfigDict, Any],
                             Callable[[Any], dict[str, float]] | None]


class NonFiniteError(RuntimeError):
  """The loss or gradient of a step was NaN or Inf and the config says stop."""


class Hook(NamedTuple):
  """`run(step, state)` every `every` steps, at the stage's last step, and (`on_stop`) at the
  step a signal stops."""
  every: int
  run: Callable[[int, TrainState], None]
  on_stop: bool = False

  def due(self, step: int, last: bool, stopping: bool) -> bool:
    return step % self.every == 0 or last or (self.on_stop and stopping)


class StageRun:
  """One stage's pass of the host loop over the steps it trains."""

  def __init__(self, setup: Setup, stage: stages.Stage, parts: Training, model_cfg,
               trackers: Sequence[Tracker], data_state: dict | None,
               periodic_evals: Sequence[PeriodicEvalMaker]):
    config = self.config = stage.config
    self.setup, self.stage, self.parts, self.model_cfg = setup, stage, parts, model_cfg
    self.trackers = trackers
    self.iterator = make_iterator(config, model_cfg, setup.mesh, setup.data_cfg.train_split,
                                  stages.data_seed(setup.config.seed, stage.index))
    if data_state is not None:
      self.iterator.set_state(data_state)
    self.evaluator = data.evaluator_of(data_config(config))
    self.eval_fn = jax.jit(functools.partial(eval_step, model=parts.model,
                                             evaluator=self.evaluator),
                           in_shardings=(parts.shardings.params, parts.batch_sharding))
    self.make_periodic, self.periodic = periodic_evals, None  # made at the first eval
    self.meta = {**setup.meta, **stage.checkpoint_meta()}
    self.tokens_per_step = config.train.batch_size * config.data.seq_len
    self.flops_token = flops.flops_per_token(model_cfg, config.data.seq_len)
    self.peak = flops.peak_flops(config, jax.devices()[0].device_kind)
    self.records: list[dict[str, Any]] = []
    self.skipped = 0
    self.pending = None  # (step, metrics) dispatched but not read yet
    self.clock = (time.monotonic(), 0)  # (when, step) the current timing interval began
    self.hooks = []
    if setup.checkpointer.saves:
      self.hooks.append(Hook(config.checkpoint.every_steps, self._save, on_stop=True))
    if config.train.eval_every:
      self.hooks.append(Hook(config.train.eval_every, self._evaluate))

  def close(self) -> None:
    self.iterator.close()

  def loop(self, state: TrainState, start: int, signals: StopSignals,
           profiler: StepProfiler) -> tuple[TrainState, dict[str, Any]]:
    """Trains from step `start` to the stage's last step; the last state and a summary."""
    steps = self.config.train.steps
    sharding = parallelism.batch_sharding(self.setup.mesh)
    self._restart_clock(start)
    signals.enter_loop()
    stop, reached = None, start
    for step in range(start + 1, steps + 1):
      reached = step
      if profiler.starts_at(step):
        self._read_pending()
        profiler.start(step)
        self._restart_clock(step - 1)  # Starting the trace is not step time.
      profiler.before(step)  # The trace holds the step's batch too.
      batch = data.to_global_batch(data.fields(next(self.iterator), data.TRAIN_FIELDS),
                                   sharding, self.config.train.batch_size)
      state, metrics = self.parts.step_fn(state, batch)
      self.setup.checkpointer.check()  # A failed background save stops the run now.
      self._read_pending()
      self.pending = (step, metrics)
      if profiler.ends_at(step):
        self._read_pending()  # Inside the trace: the step's results are computed.
        profiler.close()
        self._restart_clock(step)  # Writing the trace out is not step time.
      stop = signals.received or self.setup.checkpointer.reached_preemption(step)
      for hook in self.hooks:
        if hook.due(step, step == steps, bool(stop)):
          self._read_pending()  # Know the step was finite before its state is saved.
          hook.run(step, state)
          self._restart_clock(step)  # Host work is not step time.
      if stop:
        print(f"stopping at step {step} on {signals.received or 'preemption'}: "
              + ("saved a checkpoint; re-run with the same --workdir to resume"
                 if self.setup.checkpointer.saves else "checkpoint.every_steps=0 keeps no "
                 "checkpoint, so a re-run starts over"), flush=True)
        break
    self._read_pending()
    return state, self._summarise(start, reached, stopped=bool(stop))

  def _save(self, step: int, state: TrainState) -> None:
    self.setup.checkpointer.save(step, state, data.gather_state(self.iterator.get_state()),
                                 self.meta)

  def _read_pending(self) -> None:
    """Reads the step in flight, if any (before host work that must not overlap it)."""
    if self.pending:
      self._read(*self.pending)
      self.pending = None

  def _read(self, step: int, metrics) -> None:
    """Reads a step's metrics (blocking until it is done; the next step is queued)."""
    values = jax.device_get(metrics)
    if not values["finite"]:
      self._non_finite(step)
    else:
      self.setup.checkpointer.step_was_finite(step)
    if step % self.config.train.log_every and step != self.config.train.steps:
      return
    now = time.monotonic()
    step_time = (now - self.clock[0]) / (step - self.clock[1])
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
    self.clock = (now, step)

  def _non_finite(self, step: int) -> None:
    if self.config.train.on_nonfinite == "skip":
      self.skipped += 1
      print(f"warning: non-finite loss or gradient at step {step}; update skipped "
            f"({self.skipped} so far)", flush=True)
      return
    checkpointer = self.setup.checkpointer
    # A finite update can still blow the weights up: the checkpoint the failing step started
    # from is no good one, so it goes aside and the one named is the newest a finite step
    # followed (kept for this; see Checkpointer).
    moved = checkpointer.set_aside_what_led_to(step)
    last_good = checkpointer.latest_committed()
    where = (f"the last good checkpoint is step {last_good} in {checkpointer.directory}"
             if last_good is not None else "there is no good checkpoint")
    aside = (f"; step {step - 1}'s state may be what overflowed, so its checkpoint was moved "
             f"to {moved[0]}" if moved else "")
    raise NonFiniteError(f"non-finite loss or gradient at step {step}; the update was not "
                         f"applied and the run stops{aside}; {where}")

  def _evaluate(self, step: int, state: TrainState) -> None:
    cfg, mesh = self.config, self.setup.mesh
    iterator = make_iterator(cfg, self.model_cfg, mesh, cfg.data.eval_split, cfg.seed)
    sharding = parallelism.batch_sharding(mesh)
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
      self.periodic = [e for e in (make(cfg, mesh) for make in self.make_periodic) if e]
    for evaluate in self.periodic:
      record.update(evaluate(state.params))
    for tracker in self.trackers:
      tracker.log(record)

  def _restart_clock(self, step: int) -> None:
    """Starts step timing afresh after host work (save, eval) with nothing in flight."""
    self.clock = (time.monotonic(), step)

  def _summarise(self, start: int, reached: int, stopped: bool) -> dict[str, Any]:
    timed = [r["tokens_per_sec"] for r in self.records if not r["warmup"]]
    first, last = (self.records[0], self.records[-1]) if self.records else ({}, {})
    summary = {"first_loss": first.get("loss"), "last_loss": last.get("loss"),
               "median_tokens_per_sec": statistics.median(timed) if timed else None,
               "steps": reached,  # A stop on a signal may come between logged steps.
               "stopped_by_signal": stopped, "skipped_steps": self.skipped}
    if self.trackers and self.records:
      speed = (f"{summary['median_tokens_per_sec']:,.0f} tok/s median after warm-up"
               if timed else "too few steps to time")
      label = f"{self.stage.label} " if self.stage.name else ""
      # The steps of both losses: the first logged one is not step 0's.
      losses = " -> ".join(f"{r['loss']:.4f} (step {r['step']})"
                           for r in ([first] if first is last else [first, last]))
      print(f"{label}{'stopped' if stopped else 'done'}: step {reached}, loss {losses}, "
            f"{speed}", flush=True)
    elif self.trackers and not stopped:
      print(f"nothing to do: the run is already at step {start}", flush=True)
    return summary
