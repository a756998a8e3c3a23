"""The 7B 256k config with Ring Attention: the baseline that striped is compared against.

    python -m trainer --config configs/7b_256k_ring.py --workdir runs/7b_256k_ring

Identical to configs/7b_256k_striped.py except for the attention layout.
"""

import importlib

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = importlib.import_module("configs.7b_256k_striped").get_config()
  config.model.attention = "ring"
  return config
