"""The context-extension recipe on the embedded default: 64 -> 256 tokens in two stages.

    python -m trainer --config configs/tiny_extend.py

Stage 1 trains the tiny model at 64 tokens per row; stage 2 starts from its final weights,
rescales RoPE by YaRN x4 (original length 64) and trains at 256 tokens with striped
attention over the 4-device ring, keeping AdamW's moments. Runs in about a minute on 2 cores;
metrics.jsonl tags every line with its stage. configs/llama_extend_32k_to_256k_striped.py is
the same recipe at full size from a Hugging Face checkpoint.
"""

import ml_collections

from configs import tiny_cpu
from configs.stages import stage


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = tiny_cpu.get_config("striped")
  config.stages = (
      stage("64", steps=30, seq_len=64, lr=3e-3, warmup_steps=5),
      stage("256", steps=30, seq_len=256, lr=1e-3, warmup_steps=5, keep_optimizer=True,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_len": 64}),
  )
  config.train.log_every = 5
  config.train.eval_every = 30
  config.checkpoint.every_steps = 10
  return config
