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

LAYERS = ("config", "core", "track", "ckpt", "run", "plan", "tools")
