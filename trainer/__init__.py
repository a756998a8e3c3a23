"""The trainer: one-way layers, each a package that imports only the ones before it in
`LAYERS` (tests/test_layers.py). The train path reads top-down:

- `config/`: the config's fields, checks and errors, stages, hardware figures, the workdir;
- `core/`: state, the train and eval step, the optimizer, building them for a config;
- `track/`: console, metrics trackers (JSONL, console, W&B), profiling, provenance;
- `ckpt/`: Orbax checkpoints, resume checks, Hugging Face import, step 0's state;
- `run/`: the train loop, several processes, stop signals, host memory;
- `plan/`: the dry-run planner (`--dry_run`) and its GPU targets;
- `tools/`: the sampler, the needle eval and the exporter.
The commands sit on top: `python -m trainer` (`__main__.py`), `python -m trainer.sample`,
`python -m trainer.export`.
"""

import importlib.abc
import sys

LAYERS = ("config", "core", "track", "ckpt", "run", "plan", "tools")

# Modules of the flat trainer/ before these packages, by the package each went to: an old
# import or `python -m` path fails with a line naming the new one.
MOVED = {
    "config": ("config_check", "fields", "flops", "needle_grid", "stages", "workdir"),
    "core": ("optimizer", "state", "step", "training"),
    "track": ("console", "profiling", "provenance", "tracking", "wandb_tracker"),
    "ckpt": ("checkpointing", "hf_import", "resume"),
    "run": ("distributed", "host_memory", "loop", "stop_signals"),
    "plan": ("dry_run", "plan_report", "plan_target", "strategy_plan"),
    "tools": ("needle", "run_flags"),
}


def _moved(module: str) -> str | None:
  """Where an old flat module went, as an error's words; None for any other name."""
  layer = next((layer for layer, modules in MOVED.items() if module in modules), None)
  return layer and f"{__name__}.{module} is now {__name__}.{layer}.{module}"


class _MovedModules(importlib.abc.MetaPathFinder):
  """Last on `sys.meta_path`: asked only for a module no other finder has."""

  def find_spec(self, name, path=None, target=None):
    parent, _, module = name.rpartition(".")
    if parent == __name__ and (words := _moved(module)):
      raise ModuleNotFoundError(words, name=name)
    return None


sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
  # `from trainer import stages` asks here first; only an ImportError carries its words out
  # (so `hasattr(trainer, "loop")` raises it too: nothing asks that of an old name).
  if words := _moved(name):
    raise ImportError(words, name=f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
