"""The paper's 7B model at 1M (2^20) tokens per sequence on 8 GPUs; the layout is the
argument (striped by default).

    python -m trainer --config configs/7b_1m_striped.py --workdir runs/7b_1m_striped
    python -m trainer --config configs/7b_1m_striped.py:ring --workdir runs/7b_1m_ring
    python -m trainer --config configs/7b_1m_striped.py --dry_run

configs/7b_256k_striped.py at four times the length, on one ring of 8 devices (one node of
8 80 GB GPUs). What makes it fit, per device:
- each device holds 131,072 tokens of the sequence;
- the loss projects 2,048 tokens at a time onto the vocabulary (train.loss_chunk), never
  the 131,072 x 32,000 float32 logits (16 GiB per copy);
- remat 'offload' keeps each layer's input (32 x 131,072 x 4,096 bf16 = 32 GiB) in pinned
  host memory instead of on the device (256 GiB of the node's host memory in all), and
  recomputes the rest of the layer;
- parameters and AdamW state are sharded over all 8 devices (ZeRO-3 over the ring).
The planner's figures for it (H100s, 8 and 16 devices, offload and full) are in docs/planning.md
and results/bench_plan.jsonl; they need XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the
Dockerfile's; JAX's default 0.75 would not hold this config).
"""

import importlib

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = importlib.import_module("configs.7b_256k_striped").get_config(arg)
  config.mesh.sequence = 8
  config.data.seq_len = 1_048_576
  config.model.rope_theta = 50_000_000.0  # Raised base for 1M positions.
  config.train.remat = "offload"
  config.train.loss_chunk = 2048
  config.train.eval_every = 100
  config.checkpoint.every_steps = 50
  return config
