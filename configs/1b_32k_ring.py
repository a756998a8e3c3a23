"""The 1B 32k config with Ring Attention: the baseline that striped is compared against.

    python -m trainer --config configs/1b_32k_ring.py --workdir runs/1b_32k_ring

Identical to configs/1b_32k_striped.py except for the attention layout.
"""

import importlib

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = importlib.import_module("configs.1b_32k_striped").get_config()
  config.model.attention = "ring"
  return config
