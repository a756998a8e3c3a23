"""The 7B shape with Gemma 3's local:global layers at 256k tokens on 8 devices.

    python -m trainer --config configs/7b_local_global_256k.py --dry_run
    python -m trainer --config configs/7b_local_global_256k.py:striped --dry_run

Five local layers (1,024-token sliding window, RoPE base 10k) per global one (base 1M), as
Gemma 3. With windows the layouts trade places: a local layer's ring is cut short under
`zigzag` and `ring` (3 and 2 of 8 steps), while `striped` runs every step; the dry run
prints each layout's critical path for this pattern and names the shortest.
"""

import importlib

import ml_collections

_BASE = importlib.import_module("configs.7b_256k_striped")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = _BASE.get_config(arg or "zigzag")
  config.model.window = 1024
  config.model.layer_pattern = "LLLLLG"
  config.model.local_rope_theta = 10_000.0
  config.model.rope_theta = 1_000_000.0
  return config
