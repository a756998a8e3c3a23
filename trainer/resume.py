"""What a resumed run may change: compute and schedule yes, the model and its data no.

The config of a run is stored in `<workdir>/config.json`. A resumed run compares its config
with the stored one: fields that change the parameters' shapes or the data stream are
incompatible (a clear error); the rest (steps, schedule, logging, mesh, kernels, layout)
may change and are reported.
"""

from __future__ import annotations

import json
import os

import ml_collections

from trainer.config_check import ConfigError

# Prefixes of fields a resumed run must keep. The layout (model.attention) may change: the
# data iterator's position is independent of the permutation applied to each batch.
_FIXED = ("model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads",
          "model.head_dim", "model.d_ff", "model.vocab_size", "model.tie_embeddings",
          "model.param_dtype", "data.dataset", "data.seq_len", "data.tokenizer",
          "data.tokenizer_vocab_size", "data.path", "data.text_field", "data.train_split",
          "data.cross_document_attention", "data.num_documents", "data.max_document_tokens",
          "train.batch_size", "seed")


def config_path(workdir: str) -> str:
  return os.path.join(workdir, "config.json")


def load_stored_config(workdir: str) -> ml_collections.ConfigDict | None:
  path = config_path(workdir)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return ml_collections.ConfigDict(json.load(f))


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(_flatten(value, name + "."))
    else:
      flat[name] = value
  return flat


def compare_configs(stored: ml_collections.ConfigDict,
                    config: ml_collections.ConfigDict) -> list[str]:
  """Changed compatible fields as 'name: old -> new'; raises ConfigError on an incompatible one."""
  old = _flatten(json.loads(stored.to_json_best_effort()))
  new = _flatten(json.loads(config.to_json_best_effort()))
  changed = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
  fixed = [name for name in changed if name in _FIXED]
  if fixed:
    name = fixed[0]
    raise ConfigError(f"cannot resume with {name}={new.get(name)!r}: the checkpoint was "
                      f"trained with {old.get(name)!r} (use a new --workdir to start over)")
  return [f"{name}: {old.get(name)!r} -> {new.get(name)!r}" for name in changed]
