"""Gives JAX 8 simulated CPU devices before it starts, for every test."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import jax  # noqa: E402  (must come after the flags above)

jax.config.update("jax_num_cpu_devices", 8)


import importlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory):
  """One prepared-data cache (dataset + tokenizer) for every test that trains."""
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture
def tiny_config(shared_data_dir):
  """Returns a fresh tiny_cpu config (optionally a layout variant) on the shared data cache."""

  def make(attention: str | None = None, **overrides):
    config = importlib.import_module("configs.tiny_cpu").get_config(attention)
    config.data.data_dir = shared_data_dir
    config.train.eval_every = 0
    for path, value in overrides.items():
      group, key = path.split(".")
      config[group][key] = value
    return config

  return make
