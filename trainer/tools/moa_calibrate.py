"""MoA's profile and search over a run: calibration rows, the influence profile, the plan.

A checkpoint of `--workdir` (the newest, or `--step`) is read as the sampler reads it; the
run's eval split gives the calibration rows, cut at each profiled length in their original
order; `model.moa_profile` turns each batch into each head's influence per distance, summed
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
from trainer.tools.sample import Sampler, load


def _batches(sampler: Sampler, length: int, request: moa_search.Request):
  """Calibration batches at `length` from the run's eval split, on the run's mesh: rows in
  their original order, `config.train.batch_size` (or fewer) at a time."""
  per_batch = min(request.rows, sampler.config.train.batch_size)
  shards = parallelism.batch_shards(sampler.mesh)
  if per_batch % shards or request.rows % per_batch:
    raise SampleError(f"--rows={request.rows} must be a multiple of {per_batch} (a batch of "
                      f"the run, over {shards} batch shard(s))")
  data_cfg = dataclasses.replace(sampler.data_cfg, seq_len=length)
  rows = data.make_iterator(data_cfg, data_cfg.eval_split, per_batch, "ring", 1,
                            seed=request.seed)
  sharding = parallelism.batch_sharding(sampler.mesh)
  for _ in range(request.rows // per_batch):
    batch = data.fields(next(rows), data.TRAIN_FIELDS)
    if not batch["loss_mask"].any():
      raise SampleError(f"--lengths: the eval split '{data_cfg.eval_split}' gives no tokens "
                        f"at length {length}")
    yield data.to_global_batch(batch, sharding)


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


def record_of(workdir: str, step: int, request: moa_search.Request, choice: moa_search.Choice,
              plan_bytes: bytes, losses: dict, seconds: float, eval_split: str) -> dict:
  """What the plan was computed from and what it keeps, for `<plan>.record.json`."""
  return {
      "plan_sha256": hashlib.sha256(plan_bytes).hexdigest(),
      "workdir": os.path.abspath(workdir), "checkpoint_step": step,
      "density_budget": request.density, "lengths": list(request.lengths),
      "calibration": {"split": eval_split, "rows": request.rows, "seed": request.seed,
                      "order": "original (dense attention, the run's dataset)"},
      "candidates": [list(rule) for rule in request.rules],
      "density": {str(n): d for n, d in choice.density.items()},
      "influence_lost": {str(n): x for n, x in choice.lost.items()},
      "calibration_loss": {str(n): x for n, x in losses.items()},
      "spans": {str(n): [[moa_search.span_at(r, n) for r in row] for row in choice.rules]
                for n in request.lengths},
      "seconds": round(seconds, 1),
  }


def search(workdir: str, config: ml_collections.ConfigDict, step: int | None,
           request: moa_search.Request, out: str, log: Callable[[str], None] = print) -> dict:
  """Profiles step `step` of `workdir`, searches, writes the plan to `out` (and its record
  and profile beside it); returns the record."""
  start = time.perf_counter()
  sampler, step = load(workdir, config, step, log)
  measured = profile(sampler, request, log)
  layers, heads = sampler.model_cfg.num_layers, sampler.model_cfg.num_heads
  log(f"search: {layers} layers x {heads} heads, {len(request.rules)} candidate rules, "
      f"density <= {request.density} at {', '.join(map(str, request.lengths))}")
  try:
    choice = moa_search.choose(measured["profiles"], list(request.rules), request.density)
  except ValueError as error:
    raise SampleError(f"--density={request.density}: {error}") from None
  plan_bytes = (json.dumps(moa_search.plan_json(choice)) + "\n").encode()
  record = record_of(workdir, step, request, choice, plan_bytes, measured["loss"],
                     time.perf_counter() - start, sampler.data_cfg.eval_split)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  workdir_files.write_atomically(out, plan_bytes)
  workdir_files.write_atomically(
      f"{out}.record.json", (json.dumps(record, indent=1) + "\n").encode())
  np.savez(f"{out}.profile.npz", **{str(n): p for n, p in measured["profiles"].items()})
  for length in request.lengths:
    log(f"plan at {length}: density {choice.density[length]:.3f}, "
        f"{100 * choice.lost[length]:.1f}% of the profiled influence dropped")
  log(f"wrote {out} (step {step}; record {out}.record.json)")
  return record
