"""The 7B 1M config with Ring Attention: the baseline that striped is compared against.

    python -m trainer --config configs/7b_1m_ring.py --workdir runs/7b_1m_ring

Identical to configs/7b_1m_striped.py except for the attention layout.
"""

import importlib

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = importlib.import_module("configs.7b_1m_striped").get_config()
  config.model.attention = "ring"
  return config
