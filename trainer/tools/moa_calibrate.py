"""MoA's profile and search over a run: calibration rows, the influence profile, the plan.

A checkpoint of `--workdir` (the newest, or `--step`) is read as the sampler reads it; the
run's eval split gives the calibration rows, cut at each profiled length in the run's
layout; `model.moa_profile` turns each batch into each head's influence per distance, summed
over the rows; `trainer.tools.moa_search` picks one rule per head. The plan is written where
a run takes it (`--config.model.head_spans=PLAN`) and beside it a record of what it came
from (`<plan>.record.json`) and the profile itself (`<plan>.profile.npz`), so a search at
another budget need not profile again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from typing import Callable

import flax.linen as nn
import jax
import ml_collections
import numpy as np

import data
import parallelism
from model.moa_profile import all_global, profile_batch
from trainer.config import workdir as workdir_files
from trainer.tools import moa_search
from trainer.tools.run_flags import SampleError
from trainer.tools.sampling import Sampler, from_hf, load


def loss_on(sampler: Sampler, request: moa_search.Request) -> str:
  """Which tokens' loss the profile differentiates: "answers" (the tokens the dataset marks
  as answers to a question asked far from its fact, the synthetic corpus's) or "all". MoA's
  pipeline profiles the loss of long-range responses only (`pipeline_profile.py
  --response_mask`): the whole text's loss is mostly local, and would send every head short.
  "auto" takes answers where the dataset marks them."""
  marks = data.evaluator_of(sampler.data_cfg) is not None
  if request.loss_on == "answers" and not marks:
    raise SampleError(f"--loss_on=answers: the dataset '{sampler.data_cfg.dataset}' marks no "
                      f"answers; use --loss_on=all")
  if request.loss_on == "auto":
    return "answers" if marks else "all"
  return request.loss_on


def _batches(sampler: Sampler, length: int, request: moa_search.Request):
  """Calibration batches at `length` from the run's eval split, on the run's mesh in its
  layout, `config.train.batch_size` rows (or fewer) at a time, the loss kept on the tokens
  `loss_on` names."""
  per_batch = min(request.rows, sampler.config.train.batch_size)
  shards = parallelism.batch_shards(sampler.mesh)
  if per_batch % shards or request.rows % per_batch:
    raise SampleError(f"--rows={request.rows} must be a multiple of {per_batch} (a batch of "
                      f"the run, over {shards} batch shard(s))")
  data_cfg = dataclasses.replace(sampler.data_cfg, seq_len=length)
  answers = loss_on(sampler, request) == "answers"
  rows = data.make_iterator(data_cfg, data_cfg.eval_split, per_batch,
                            sampler.model_cfg.layout, sampler.num_shards, seed=request.seed)
  try:
    for _ in range(request.rows // per_batch):
      row = next(rows)
      batch = data.fields(row, data.TRAIN_FIELDS + ("token_index",))
      if answers:
        batch["loss_mask"] = batch["loss_mask"] * (row["answer_distance"] > 0)
      if not batch["loss_mask"].any():
        raise SampleError(f"--lengths: {request.rows} rows of the eval split "
                          f"'{data_cfg.eval_split}' give no {'answer ' * answers}tokens at "
                          f"length {length}; profile more --rows")
      yield data.to_global_batch(batch, parallelism.batch_sharding(sampler.mesh))
  finally:
    rows.close()


def profile(sampler: Sampler, request: moa_search.Request, log: Callable[[str], None]) -> dict:
  """{length: [L, H, length] influence summed over the calibration rows}, and the mean loss
  of the rows at each length ("loss")."""
  cfg = all_global(sampler.model_cfg)
  profiles, losses = {}, {}
  with jax.set_mesh(sampler.mesh), nn.logical_axis_rules(sampler.rules):
    for length in request.lengths:
      chunk = math.gcd(length, request.chunk)
      step = jax.jit(functools.partial(profile_batch, cfg, chunk=chunk))
      start, total, batch_losses = time.perf_counter(), 0.0, []
      for index, batch in enumerate(_batches(sampler, length, request)):
        loss, influence = step(sampler.params, batch)
        total = total + influence
        batch_losses.append(float(loss))
        log(f"profile at {length}: batch {index + 1}, loss {batch_losses[-1]:.3f} "
            f"({time.perf_counter() - start:.1f} s)")
      profiles[length] = np.asarray(jax.device_get(total), np.float64)
      losses[length] = float(np.mean(batch_losses))
  return {"profiles": profiles, "loss": losses}


def record_of(origin: dict, request: moa_search.Request, choice: moa_search.Choice,
              plan_bytes: bytes, losses: dict, seconds: float, eval_split: str,
              tokens: str) -> dict:
  """What the plan was computed from (`origin`: the checkpoint) and what it keeps, for
  `<plan>.record.json`."""
  return {
      "plan_sha256": hashlib.sha256(plan_bytes).hexdigest(), **origin,
      "density_budget": request.density, "lengths": list(request.lengths),
      "calibration": {"split": eval_split, "rows": request.rows, "seed": request.seed,
                      "loss_on": tokens},
      "candidates": [list(rule) for rule in request.rules],
      "density": {str(n): d for n, d in choice.density.items()},
      "influence_lost": {str(n): x for n, x in choice.lost.items()},
      "calibration_loss": {str(n): x for n, x in losses.items()},
      "spans": {str(n): [[moa_search.span_at(r, n) for r in row] for row in choice.rules]
                for n in request.lengths},
      "seconds": round(seconds, 1),
  }


def load_run(workdir: str | None, config: ml_collections.ConfigDict, step: int | None,
             log: Callable[[str], None]) -> tuple[Sampler, dict]:
  """The model to profile, as the sampler reads it, and where it came from: step `step`
  (default the newest) of `workdir`, or without one the Hugging Face directory of
  `config.init.from_hf` (after `hf_import.apply_to_config`)."""
  if workdir is None:
    return from_hf(config, log), {"from_hf": os.path.abspath(config.init.from_hf)}
  sampler, step = load(workdir, config, step, log)
  return sampler, {"workdir": os.path.abspath(workdir), "checkpoint_step": step}


def search(sampler: Sampler, origin: dict, request: moa_search.Request, out: str,
           log: Callable[[str], None] = print) -> dict:
  """Profiles `sampler`'s model (from `origin`: `load_run`), searches, writes the plan to
  `out` (and its record and profile beside it); returns the record."""
  start = time.perf_counter()
  measured = profile(sampler, request, log)
  layers, heads = sampler.model_cfg.num_layers, sampler.model_cfg.num_heads
  log(f"search: {layers} layers x {heads} heads, {len(request.rules)} candidate rules, "
      f"density <= {request.density} at {', '.join(map(str, request.lengths))}")
  try:
    choice = moa_search.choose(measured["profiles"], list(request.rules), request.density)
  except ValueError as error:
    raise SampleError(f"--density={request.density}: {error}") from None
  plan_bytes = (json.dumps(moa_search.plan_json(choice)) + "\n").encode()
  record = record_of(origin, request, choice, plan_bytes, measured["loss"],
                     time.perf_counter() - start, sampler.data_cfg.eval_split,
                     loss_on(sampler, request))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  workdir_files.write_atomically(out, plan_bytes)
  workdir_files.write_atomically(
      f"{out}.record.json", (json.dumps(record, indent=1) + "\n").encode())
  np.savez(f"{out}.profile.npz", **{str(n): p for n, p in measured["profiles"].items()})
  for length in request.lengths:
    log(f"plan at {length}: density {choice.density[length]:.3f}, "
        f"{100 * choice.lost[length]:.1f}% of the profiled influence dropped")
  made_from = origin.get("from_hf") or f"step {origin['checkpoint_step']}"
  log(f"wrote {out} ({made_from}; record {out}.record.json)")
  return record
