"""The embedded default: a tiny decoder on the bundled synthetic corpus, 8 simulated CPU devices.

    python -m trainer --config configs/tiny_cpu.py                # dense attention
    python -m trainer --config configs/tiny_cpu.py:striped        # ring, striped or zigzag

Runs 100 steps in 1-2 minutes on 2 cores; the loss falls from ~6.2 (uniform over the
512-token vocabulary) to about 1.7. The mesh splits the batch over 2 fsdp shards and the
sequence over 4 ring shards.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = base.get_config()
  config.cpu_devices = 8
  config.model.num_kv_heads = 2  # GQA: two query heads per key/value head.
  config.model.attention = arg or "dense"
  config.model.attention_tile = 32  # 64-token ring blocks in 32-token tiles.
  config.mesh.fsdp = 2
  config.mesh.sequence = 4
  config.data.seq_len = 256
  config.train.steps = 100
  config.train.batch_size = 8
  config.train.log_every = 10
  config.train.eval_every = 50
  return config
