"""The paper's 7B model at 256k tokens on 8 devices (one ring); the layout is the argument.

    python -m trainer --config configs/7b_256k_striped.py --workdir runs/7b_256k_striped
    python -m trainer --config configs/7b_256k_striped.py:ring --workdir runs/7b_256k_ring
    python -m trainer --config configs/7b_256k_striped.py --dry_run

Parameters and optimizer state are sharded over all 8 devices (ZeRO-3 over the ring, see
mesh.rules in configs/base.py); activations are fully rematerialised. The paper reports
1.45x end-to-end over ring attention at 256k tokens on 8 A100s.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.num_layers = 32
  config.model.d_model = 4096
  config.model.num_heads = 32
  config.model.num_kv_heads = 32
  config.model.d_ff = 11008
  config.model.vocab_size = 32000
  config.model.rope_theta = 10_000_000.0  # Raised base for 256k positions.
  config.model.attention = arg or "striped"
  config.model.attention_tile = 512
  config.mesh.data = 1
  config.mesh.fsdp = 1
  config.mesh.sequence = 8
  config.mesh.tensor = 1
  config.data.dataset = "pg19"  # Needs a machine that can download and prepare it.
  config.data.seq_len = 262144
  config.data.tokenizer_vocab_size = 32000
  config.train.steps = 1000
  config.train.batch_size = 1
  config.train.lr = 1.5e-4
  config.train.warmup_steps = 100
  config.train.remat = "full"
  config.train.log_every = 1
  config.train.eval_every = 200
  config.train.eval_steps = 1
  config.checkpoint.every_steps = 100
  return config
