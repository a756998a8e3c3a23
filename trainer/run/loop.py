"""`train`: build the run once (trainer.run.setup), resume, then train its stages in order
(trainer.run.stage), each from the state the one before left."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import ml_collections

from trainer.ckpt.checkpointing import CheckpointError
from trainer.ckpt.start import initial_state
from trainer.config import stages
from trainer.config import workdir as workdir_lock
from trainer.core.state import carry_over_stage
from trainer.core.training import build_training, model_config
from trainer.run import setup as run_setup
from trainer.run.stage import NonFiniteError, PeriodicEvalMaker, StageRun
from trainer.run.stop_signals import StopSignals
from trainer.track.profiling import StepProfiler
from trainer.track.tracking import TrackingError

__all__ = ["NonFiniteError", "PeriodicEvalMaker", "train"]


def train(config: ml_collections.ConfigDict, workdir: str, start_over: bool = False,
          profile_steps: tuple[int, int] | None = None,
          periodic_evals: Sequence[PeriodicEvalMaker] = ()) -> dict[str, Any]:
  """Trains up to `config.train.steps`, resuming from `workdir` when it holds a checkpoint.

  Holds the workdir's lock throughout (one run per workdir). `start_over` allows a fresh
  start beside damaged checkpoints set aside in `checkpoints_unusable/`; `profile_steps`
  (first, last) traces those steps (trainer/track/profiling.py); `periodic_evals` make the
  evaluations that run beside the eval loss (the needle grid's, from the command). Returns
  a summary (first/last loss, median speed, final step, whether a signal stopped it).
  """
  is_writer = jax.process_index() == 0
  with StopSignals() as signals:
    if is_writer:
      workdir_lock.claim(workdir)
    try:
      setup = run_setup.prepare(config, workdir, is_writer)
      profiler = StepProfiler(profile_steps, workdir, setup.log)
      trackers = []
      try:
        with jax.set_mesh(setup.mesh), nn.logical_axis_rules(config.mesh.rules):
          return _train_stages(setup, start_over, signals, profiler, trackers, periodic_evals)
      finally:
        profiler.close()
        setup.checkpointer.close()
        for tracker in trackers:
          tracker.close()
    finally:
      if is_writer:
        workdir_lock.release(workdir)


def _train_stages(setup: run_setup.Setup, start_over: bool, signals: StopSignals,
                  profiler: StepProfiler, trackers: list,
                  periodic_evals: Sequence[PeriodicEvalMaker]) -> dict[str, Any]:
  """Resumes, then trains each stage left; `trackers` are opened at the first stage run."""
  step, state, data_state = run_setup.restore(setup, start_over)
  all_stages, summaries = setup.stages, []
  try:
    for stage in all_stages[stages.next_to_run(all_stages, step).index:]:
      parts = build_training(stage.config, setup.mesh)
      model_cfg = model_config(stage.config)
      if state is None:
        state = initial_state(stage.config, parts, setup.log)
      elif step == stage.first_step - 1 and stage.index > 0:
        state = carry_over_stage(state, parts.optimizer, parts.shardings,
                                 stage.keep_optimizer)
        data_state = None  # Each stage reads the data afresh, with a seed of its own.
      for line in run_setup.stage_lines(stage, model_cfg, step):
        setup.log(line)
      if setup.records is not None and not trackers:  # Once the first step is near.
        trackers += run_setup.make_trackers(setup.config, setup.workdir, setup.records,
                                            all_stages[-1].last_step, step)
      run = StageRun(setup, stage, parts, model_cfg, trackers, data_state, periodic_evals)
      try:
        state, summary = run.loop(state, step, signals, profiler)
      finally:
        run.close()
      summaries.append(summary)
      if summary["stopped_by_signal"]:
        break
      step, data_state = stage.last_step, None
    setup.checkpointer.finish()  # An async save that failed raises here: the exit is non-zero.
  except BaseException as error:
    # Let saves already started commit; the original error is the one to report.
    try:
      setup.checkpointer.wait()
    except CheckpointError as also:
      print(f"also: {also}", flush=True)
    if isinstance(error, (TrackingError, workdir_lock.WorkdirError)):  # A file it writes.
      raise type(error)(f"{error}; {_where_a_rerun_resumes(setup.checkpointer)}") from error
    raise
  return _combined(summaries)


def _where_a_rerun_resumes(checkpointer) -> str:
  """Said after a write that stopped the run mid-way (a full disk under metrics.jsonl or
  wandb/run.json), as a failed checkpoint save says it: the saves started have committed."""
  latest = checkpointer.latest_committed()
  if latest is None:
    return f"no checkpoint is committed in {checkpointer.directory}: a re-run starts at step 0"
  return (f"the newest committed checkpoint is step {latest} in {checkpointer.directory}, "
          f"where a re-run resumes")


def _combined(summaries: list[dict[str, Any]]) -> dict[str, Any]:
  """One summary of the stages run: the last stage's, with the first loss of the first."""
  summary = dict(summaries[-1])
  losses = [s["first_loss"] for s in summaries if s["first_loss"] is not None]
  summary["first_loss"] = losses[0] if losses else None
  summary["skipped_steps"] = sum(s["skipped_steps"] for s in summaries)
  return summary
