"""`stage(...)`: one stage of a staged context extension, for `config.stages` (the trainer's
trainer/config/stages.py trains them). Config files build stages with it; it needs nothing but
ml_collections, so loading a config never imports the trainer."""

import ml_collections

# The model fields a stage may set by their last name; every other setting is `train.*`.
MODEL_FIELDS = ("rope_theta", "rope_scaling", "attention", "sequence_parallel", "kernel",
                "attention_tile")


def stage(name: str, steps: int, seq_len: int | None = None, keep_optimizer: bool = False,
          **settings) -> ml_collections.ConfigDict:
  """A stage: its `name`, `steps`, `seq_len` (data.seq_len) and `keep_optimizer` (AdamW's
  moments carried over from the previous stage), and `settings`, its other fields by their
  last name: `lr`, `warmup_steps` and every other `train.*` field, `rope_theta`,
  `rope_scaling` (a dict of `model.rope_scaling.*`), `attention`, `sequence_parallel`,
  `kernel`, `attention_tile`."""
  spec = {"name": name, "keep_optimizer": keep_optimizer, "train": {"steps": steps}}
  if seq_len is not None:
    spec["data"] = {"seq_len": seq_len}
  for key, value in settings.items():
    group = "model" if key in MODEL_FIELDS else "train"
    spec.setdefault(group, {})[key] = value
  return ml_collections.ConfigDict(spec)
