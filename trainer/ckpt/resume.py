"""What a resumed run may change: compute, schedule and logging yes; anything else no.

Every checkpoint stores the resolved config it was trained with and the SHA-256 of its
tokenizer file and of its span plan (`checkpoint_meta`; trainer/config/span_plan.py). A
resumed run compares its own config with that one, by an allow-list: a field that is not
listed in `MAY_CHANGE` must be equal, so a field added later is guarded from the day it
exists. Changed allowed fields are reported.
`<workdir>/config.json` is for people to read; only checkpoints written before configs were
stored in them are compared against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Callable

import ml_collections

from trainer.config import fields, span_plan
from trainer.config.config_check import ConfigError
from trainer.config.stored import config_of, config_path
from trainer.track.tracking import last_logged_step, scrub

# Fields (or groups, ending in '.') a resumed run may change. They decide how the same
# computation is laid out, scheduled or logged, not which parameters or tokens it sees. The
# layout may change: the data iterator's position does not depend on the per-batch
# permutation. The optimizer's hyper-parameters may change (a lower lr after a spike is
# routine); one that changes the optimizer state's structure (grad_clip to 0) is caught by
# the checkpoint's array shapes instead.
MAY_CHANGE = (
    "cpu_devices", "accelerator", "peak_flops_per_device", "mesh.", "checkpoint.", "wandb.",
    "model.attention", "model.sequence_parallel", "model.kernel", "model.attention_tile",
    "model.dtype",
    "train.steps", "train.micro_batches", "train.remat", "train.loss_chunk", "train.on_nonfinite",
    "train.log_every", "train.eval_every", "train.eval_steps", "train.eval_needle_lengths",
    "train.eval_needle_depths", "train.eval_needle_trials", "train.lr",
    "train.schedule_steps", "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay",
    "train.b1", "train.b2", "train.grad_clip",
    "data.data_dir", "data.tokenizer", "data.prefetch", "data.eval_split",
    # Where the span plan is read from: its bytes' hash is compared instead (span_plan.py).
    "model.head_spans",
    # Where step 0's weights came from: a resumed run starts from its checkpoint instead.
    "init.")


def config_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config as plain JSON values, secrets redacted: what files and checkpoints store."""
  return scrub(json.loads(config.to_json_best_effort()))


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def tokenizer_problem(path: str, recorded_sha256: str | None) -> str | None:
  """Why `path` cannot be the tokenizer a checkpoint recorded by hash (None if it can)."""
  if not os.path.isfile(path):
    return (f"the run's tokenizer {path} is not there (data paths are relative to where "
            f"the run started)")
  if recorded_sha256 and file_sha256(path) != recorded_sha256:
    return (f"{path} is not the tokenizer this checkpoint was trained with (its SHA-256 "
            f"differs from the recorded one)")
  return None


def checkpoint_meta(config: ml_collections.ConfigDict, tokenizer_sha256: str,
                    corpus: str, head_spans_sha256: str = "") -> dict[str, Any]:
  """What each checkpoint records about the run besides its arrays."""
  return {"seed": config.seed, "config": config_dict(config),
          "tokenizer_sha256": tokenizer_sha256, "corpus": corpus,
          "head_spans_sha256": head_spans_sha256}


_STAGE_FIELD = re.compile(r"stages\[(\d+)\]\.(.+)")


def _may_change(name: str, started_stages: int | None = None) -> bool:
  """Whether a resumed run may change the field. A stage's field follows the same rule once
  the stage has begun (`started_stages` is how many have; None counts all); before, anything
  of it may change, and stages may be added after the last."""
  stage_field = _STAGE_FIELD.fullmatch(name)
  if stage_field:
    index, name = int(stage_field.group(1)), stage_field.group(2)
    if started_stages is not None and index >= started_stages:
      return True
  return fields.matches(name, MAY_CHANGE)


def _defaults() -> dict[str, Any]:
  """Every field of `configs/base.py` at its default, flattened as `compare` reads them."""
  from configs import base  # pylint: disable=g-import-not-at-top  (configs import no trainer)
  return fields.flatten(config_dict(base.get_config()))


def compare(stored: dict[str, Any], config: ml_collections.ConfigDict,
            trained_with: str = "the checkpoint", started_stages: int | None = None) -> list[str]:
  """Changed allowed fields as 'name: old -> new'; raises ConfigError on any other change.

  A field the checkpoint does not record was added to the trainer since: at its default
  (`configs/base.py`, which keeps what runs did before the field) it changes nothing, so a
  checkpoint of an older trainer resumes; set otherwise, it is a change like any other."""
  old, new = fields.flatten(stored), fields.flatten(config_dict(config))
  defaults = _defaults()
  added = {name for name in new.keys() - old.keys()
           if name in defaults and defaults[name] == new[name]}
  changed = sorted(name for name in (old.keys() | new.keys()) - added
                   if old.get(name) != new.get(name))
  fixed = [name for name in changed if not _may_change(name, started_stages)]
  if fixed:
    name = fixed[0]
    more = f" (and {', '.join(fixed[1:4])}{', ...' if len(fixed) > 4 else ''})" if len(
        fixed) > 1 else ""
    raise ConfigError(f"cannot resume with {name}={new.get(name, '<absent>')!r}{more}: "
                      f"{trained_with} was trained with {old.get(name, '<absent>')!r}; "
                      f"resume with that value or use a new --workdir")
  return [f"{name}: {old.get(name)!r} -> {new.get(name)!r}" for name in changed]


def compatibility_check(config: ml_collections.ConfigDict, workdir: str, tokenizer_file: str,
                        tokenizer_sha256: str, corpus: str, report: list[str],
                        head_spans_sha256: str = "") -> Callable[[int, dict], None]:
  """The `check_compatible(step, meta)` a restore calls; appends allowed changes to `report`."""

  def check(step: int, meta: dict) -> None:
    where = f"the checkpoint of step {step}"
    stored = meta.get("config")
    if stored is None and os.path.exists(config_path(workdir)):  # An older checkpoint.
      try:
        with open(config_path(workdir), encoding="utf-8") as f:
          stored, where = config_of(json.load(f)), config_path(workdir)
      except (OSError, ValueError) as error:  # Older versions wrote it non-atomically.
        print(f"warning: cannot read {config_path(workdir)} ({error}) to compare configs; "
              f"the checkpoint's array shapes are still checked", flush=True)
    if stored is not None:
      stage = meta.get("stage")  # Staged runs: stages after the checkpoint's may change.
      report[:] = compare(stored, config, where, stage["stage"] if stage else None)
    stored_plan = None if stored is None else stored.get("model", {}).get("head_spans", "")
    problem = span_plan.resume_problem(config, head_spans_sha256,
                                       meta.get("head_spans_sha256"), stored_plan, workdir,
                                       where)
    if problem:
      raise ConfigError(problem)
    # Before the tokenizer: a corpus that changed explains a tokenizer trained on it anew.
    recorded_corpus = meta.get("corpus")
    if not recorded_corpus:
      print(f"note: {where} records no corpus (it predates them), so the data is not checked "
            f"against it", flush=True)
    elif recorded_corpus != corpus:
      fix = ("data.path's files changed since: restore them, or train on the new ones in a "
             "new --workdir" if config.data.dataset == "text_files" else
             "resume with that corpus, or use a new --workdir")
      raise ConfigError(f"the corpus is not the one {where} was trained on ({recorded_corpus}, "
                        f"now {corpus}), so its data position would index other documents; "
                        f"{fix}")
    recorded = meta.get("tokenizer_sha256")
    if recorded and recorded != tokenizer_sha256:
      raise ConfigError(f"the tokenizer file {tokenizer_file} is not the one {where} was "
                        f"trained with (its SHA-256 differs); point data.tokenizer at that "
                        f"file or use a new --workdir")

  return check


def start_warning(workdir: str, resumed_step: int | None, start_over: bool) -> str | None:
  """What a start must say besides where it resumes: that --start_over_from_step_0 did
  nothing (a usable checkpoint exists), or that a start from step 0 follows logged steps
  (`checkpoints/` deleted, or a crash before the first save)."""
  if resumed_step is not None:
    return (f"note: --start_over_from_step_0 does nothing here: step {resumed_step} is a "
            f"usable checkpoint (the flag applies when every one was set aside as damaged)"
            if start_over else None)
  logged = last_logged_step(os.path.join(workdir, "metrics.jsonl"))
  if not logged:
    return None
  return (f"warning: {workdir} holds no checkpoint, but its metrics.jsonl logs steps up to "
          f"{logged}: training from step 0, and the file goes on with a second series")
