"""The paper's 7B model at 1M (2^20) tokens per sequence with Striped Attention: 8 GPUs.

    python -m trainer --config configs/7b_1m_striped.py --workdir runs/7b_1m_striped
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

The planner's figures per device, compiled for H100s by XLA's GPU compiler (`make plan_gpu`,
then `--dry_run`; results/bench_plan.jsonl, rows with `compiled_for`):

    devices  remat     device    host     verdict at 75.15 GiB (0.95 of an H100's 79.11)
     8       offload   51.6 GiB  32 GiB   fits (this config)
     8       full      73.0 GiB   0       fits, 2 GiB to spare
    16       offload   27.9 GiB  16 GiB   fits (--config.mesh.sequence=16)
    16       full      43.4 GiB   0       fits

The budget is what JAX may allocate with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the
Dockerfile's; JAX's default 0.75 would not hold this config); the CUDA context, cuBLAS/cuDNN
workspaces and NCCL buffers (about 0.5-2 GiB) live in the rest. On fake CPU devices
(`--plan_compiler=cpu`) the same step reads 130.9 GiB on 8 devices with offload (floor 61.7),
because the CPU compiler keeps the bf16 saved activations as float32.
"""

import importlib

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = importlib.import_module("configs.7b_256k_striped").get_config()
  config.mesh.sequence = 8
  config.data.seq_len = 1_048_576
  config.model.rope_theta = 50_000_000.0  # Raised base for 1M positions.
  config.train.remat = "offload"
  config.train.loss_chunk = 2048
  config.train.eval_every = 100
  config.checkpoint.every_steps = 50
  return config
