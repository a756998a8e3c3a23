"""Staged context extension: one run trains stages of growing sequence length in one workdir.

    config.stages = (stage("32k", steps=200, seq_len=32768, lr=2e-5),
                     stage("256k", steps=100, seq_len=262144, lr=1e-5,
                           rope_scaling=dict(type="yarn", factor=8.0, original_max_len=32768)))

A stage is a partial config (written with `configs.stages.stage`): a `name`, the fields of
STAGE_FIELDS it sets (every other field comes from the run's config), and `keep_optimizer`.
Step numbers run on across stages: a stage of 200 steps after one ending at step 100 trains
steps 101-300, and its checkpoints, metrics and W&B points carry those numbers and the
stage. Each stage:
- starts from the previous stage's final checkpoint: its weights, and its AdamW moments
  when `keep_optimizer` is set, else fresh ones (`trainer.core.state.carry_over_stage`);
- has a learning-rate schedule of its own (warmup then cosine over the stage's
  `train.schedule_steps`, else its `train.steps`), counted from the stage's first step;
- reads the data afresh at its length, with a shuffle of its own (`data_seed`).
An interrupted stage resumes inside that stage from its newest checkpoint; a run stopped
exactly at a stage's end starts the next stage on its rerun.

A run without stages is one stage (index 0, no name) of the config itself.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import ml_collections
import numpy as np

from trainer.config import fields

# The fields a stage may set: what grows the context and how the stage trains. The model's
# shape, the tokenizer and the mesh stay those of the run (its weights carry over).
STAGE_FIELDS = ("data.seq_len", "model.rope_theta", "model.rope_scaling.", "model.attention",
                "model.kernel", "model.attention_tile", "train.")
_OWN_FIELDS = ("name", "keep_optimizer")


@dataclasses.dataclass(frozen=True)
class Stage:
  index: int  # 0-based position in config.stages.
  count: int  # Stages in the run.
  name: str  # '' for a run without stages.
  config: ml_collections.ConfigDict  # The run's config with the stage applied (see `resolve`).
  first_step: int
  last_step: int
  keep_optimizer: bool

  @property
  def label(self) -> str:
    return f"stage {self.index + 1}/{self.count} '{self.name}'"

  def record(self) -> dict[str, Any]:
    """What every metrics line carries of its stage (nothing when unstaged)."""
    if not self.name:
      return {}
    return {"stage": self.index + 1, "stage_name": self.name}

  def checkpoint_meta(self) -> dict[str, Any]:
    """What a checkpoint records of its stage, for `check_checkpoint` on resume."""
    if not self.name:
      return {}
    return {"stage": {**self.record(), "first_step": self.first_step}}


def _has_field(config: ml_collections.ConfigDict, name: str) -> bool:
  node = config
  for part in name.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return True


def problem(config: ml_collections.ConfigDict) -> str | None:
  """What makes `config.stages` unusable, naming the stage and field; None if nothing."""
  if not isinstance(config.stages, (tuple, list)):
    return "stages must be a tuple of stages (configs.stages.stage(...)); () trains one stage"
  names = set()
  for index, spec in enumerate(config.stages):
    where = f"stages[{index}]"
    if not isinstance(spec, ml_collections.ConfigDict):
      return f"{where} must be a ConfigDict (configs.stages.stage(...))"
    name = spec.get("name")
    if not isinstance(name, str) or not name:
      return f"{where}.name must be a non-empty string"
    if name in names:
      return f"{where}.name='{name}' names two stages"
    names.add(name)
    if spec.get("keep_optimizer") and index == 0:
      return (f"{where}.keep_optimizer: the first stage has no earlier optimizer state to "
              f"keep")
    for field in fields.flatten(spec.to_dict()):
      if field in _OWN_FIELDS:
        continue
      if not fields.matches(field, STAGE_FIELDS):
        return (f"{where}.{field} cannot be set by a stage (a stage may set "
                f"{', '.join(f + '*' if f.endswith('.') else f for f in STAGE_FIELDS)})")
      if not _has_field(config, field):
        return f"{where}.{field} is not a config field"
    steps = spec.get("train", {}).get("steps", 0)
    if not isinstance(steps, int) or steps <= 0:
      return f"{where}.train.steps must be a positive number of the stage's own steps"
  return None


def resolve(config: ml_collections.ConfigDict) -> list[Stage]:
  """The run's stages in order, each with its resolved config.

  A stage's config is the run's with the stage's fields applied, `stages` emptied,
  `train.steps` set to the stage's last step number (the loop trains up to it), and
  `train.schedule_steps` set to the stage's own schedule length.
  """
  if not config.stages:
    return [Stage(0, 1, "", config, 1, config.train.steps, False)]
  stages, end = [], 0
  for index, spec in enumerate(config.stages):
    spec = ml_collections.ConfigDict(spec)  # Stored configs hold plain dicts.
    resolved = copy.deepcopy(config)
    with resolved.unlocked():
      resolved.stages = ()
      for field, value in fields.flatten(spec.to_dict()).items():
        if field in _OWN_FIELDS:
          continue
        *groups, last = field.split(".")
        node = resolved
        for group in groups:
          node = node[group]
        node[last] = value
      steps = spec.train.steps
      resolved.train.schedule_steps = spec.train.get("schedule_steps", 0) or steps
      resolved.train.steps = end + steps
    stages.append(Stage(index, len(config.stages), spec.name, resolved, end + 1, end + steps,
                        bool(spec.get("keep_optimizer", False))))
    end += steps
  return stages


def replaced_overrides(config: ml_collections.ConfigDict,
                       overrides: dict[str, Any]) -> tuple[str | None, list[str]]:
  """(problem, notes) of command-line overrides (ml_collections' flat names) that stages
  replace with their own value: one every stage replaces would do nothing (the problem);
  one some replace holds in the others (a note each)."""
  specs = [ml_collections.ConfigDict(spec) for spec in config.stages]  # Stored: plain dicts.
  notes = []
  for name in sorted(overrides):
    setting = [i for i, spec in enumerate(specs)
               if name in fields.flatten(spec.to_dict()) and name not in _OWN_FIELDS]
    if not setting:
      continue
    stages = ", ".join(f"{i + 1} '{specs[i].name}'" for i in setting)
    if len(setting) == len(specs):
      return (f"--config.{name} is set by every stage of config.stages, whose values win: "
              f"set --config.stages[{setting[0]}].{name} (and so on) instead"), []
    notes.append(f"note: --config.{name} holds in stages that do not set it; stage {stages} "
                 f"sets its own (--config.stages[{setting[0]}].{name} overrides that)")
  return None, notes


def holding(stages: list[Stage], step: int) -> Stage:
  """The stage that trained up to `step` (a checkpoint's); the first one for step 0."""
  return next((s for s in stages if s.last_step >= step), stages[-1])


def next_to_run(stages: list[Stage], step: int) -> Stage:
  """The stage that trains the step after `step`; the last one when the run is done."""
  return next((s for s in stages if s.last_step > step), stages[-1])


def check_checkpoint(stages: list[Stage], step: int, meta: dict) -> str | None:
  """Why a checkpoint cannot continue under these stages (None if it can): its stage, as it
  recorded it, must be where this config puts its step."""
  recorded = meta.get("stage")
  here = holding(stages, step)
  if recorded is None:
    return None if not here.name else (
        f"the checkpoint of step {step} was trained without stages; resume it without "
        f"config.stages or use a new --workdir")
  if not here.name:
    return (f"the checkpoint of step {step} was trained in stage '{recorded['stage_name']}'; "
            f"resume it with the config's stages or use a new --workdir")
  if (recorded["stage_name"], recorded["first_step"]) != (here.name, here.first_step):
    return (f"the checkpoint of step {step} was trained in stage '{recorded['stage_name']}' "
            f"(from step {recorded['first_step']}), but this config puts step {step} in "
            f"stage '{here.name}' (from step {here.first_step}): the steps of a stage that "
            f"has begun cannot change; restore them or use a new --workdir")
  return None


def data_seed(seed: int, index: int) -> int:
  """Stage 0 shuffles with the run's seed (as a run without stages); later stages with seeds
  of their own, so a stage does not reread the documents its predecessor began with."""
  if index == 0:
    return seed
  return int(np.random.SeedSequence([seed % 2**32, index]).generate_state(1)[0])
