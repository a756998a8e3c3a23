"""Gives JAX 8 simulated CPU devices before it starts, for every test."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import jax  # noqa: E402  (must come after the flags above)

jax.config.update("jax_num_cpu_devices", 8)
