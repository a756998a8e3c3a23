"""The tiny default with local:global layers: a sliding window of 32 keys in every other layer.

    python -m trainer --config configs/tiny_local.py              # zigzag (the default here)
    python -m trainer --config configs/tiny_local.py:striped      # ring, striped, zigzag or dense

The local layers see the 32 tokens up to themselves (half a ring block), so under `ring` and
`zigzag` their ring is cut short (`python -m parallelism --layout zigzag --seq_len 256
--shards 4 --tile 32 --window 32` prints it); their RoPE base is 10k, the global layers'
100k (as Gemma 3 splits them).
"""

import ml_collections

from configs import tiny_cpu


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = tiny_cpu.get_config(arg or "zigzag")
  config.model.window = 32
  config.model.layer_pattern = "LG"
  config.model.local_rope_theta = 10_000.0
  config.model.rope_theta = 100_000.0
  return config
