"""The paper's 7B model at 1M (2^20) tokens per sequence with Striped Attention: 16 devices.

    python -m trainer --config configs/7b_1m_striped.py --workdir runs/7b_1m_striped
    python -m trainer --config configs/7b_1m_striped.py --dry_run

configs/7b_256k_striped.py at four times the length, on one ring of 16 devices (two nodes of
8 GPUs). What makes it fit, per device:
- each device holds 65,536 tokens of the sequence;
- the loss projects 2,048 tokens at a time onto the vocabulary (train.loss_chunk), never
  the 65,536 x 32,000 float32 logits (8 GiB per copy);
- remat 'offload' keeps each layer's input (32 x 65,536 x 4,096 bf16 = 16 GiB) in pinned
  host memory instead of on the device, and recomputes the rest of the layer;
- parameters and AdamW state are sharded over all 16 devices (ZeRO-3 over the ring).

The planner's figures per device (`--dry_run`, CPU compile, results/bench_plan.jsonl):

    devices  remat    CPU figure  floor     verdict at 80 GiB
    16       offload   66.3 GiB   31.2 GiB  fits
    16       full      82.3 GiB   47.2 GiB  may fit
     8       offload  130.9 GiB   61.7 GiB  may fit
     8       full     162.9 GiB   93.7 GiB  does not fit

The CPU figure errs high (the CPU compiler keeps bf16 buffers such as the saved layer inputs
as float32 too); the floor is what the step would need were every such buffer bf16. So 8
devices may hold it on a real GPU (`--config.mesh.sequence=8`), but only 16 are shown to.
"""

import importlib

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = importlib.import_module("configs.7b_256k_striped").get_config()
  config.mesh.sequence = 16
  config.data.seq_len = 1_048_576
  config.model.rope_theta = 50_000_000.0  # Raised base for 1M positions.
  config.train.remat = "offload"
  config.train.loss_chunk = 2048
  config.train.eval_every = 100
  config.checkpoint.every_steps = 50
  return config
