"""The paper's 1B model at 32k tokens on 8 devices (one ring); the layout is the argument.

    python -m trainer --config configs/1b_32k_striped.py --workdir runs/1b_32k_striped
    python -m trainer --config configs/1b_32k_striped.py:ring --workdir runs/1b_32k_ring
    python -m trainer --config configs/1b_32k_striped.py --dry_run

Striped (the default) against ring by tokens/sec: the paper reports striped ahead.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.num_layers = 22
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.num_kv_heads = 16
  config.model.d_ff = 5504
  config.model.vocab_size = 32000
  config.model.rope_theta = 500000.0  # Raised base for 32k positions.
  config.model.attention = arg or "striped"
  config.model.attention_tile = 512
  config.mesh.data = 1
  config.mesh.fsdp = 1
  config.mesh.sequence = 8
  config.mesh.tensor = 1
  config.data.dataset = "pg19"  # Needs a machine that can download and prepare it.
  config.data.seq_len = 32768
  config.data.tokenizer_vocab_size = 32000
  config.train.steps = 1000
  config.train.batch_size = 1
  config.train.lr = 3e-4
  config.train.warmup_steps = 100
  config.train.remat = "full"
  config.train.log_every = 10
  config.train.eval_every = 200
  config.checkpoint.every_steps = 200
  return config
