"""Which code, command and machine trained a run.

`run_provenance`: the git commit, whether the checkout had uncommitted changes, and the
command line with secrets redacted. W&B's own git and command-line capture stays off (it
would record the unscrubbed command and more); this is the small, scrubbed record instead.
`run_resolved`: what the config's automatic choices became here (devices, the mesh's -1,
the `auto` attention kernel). `run_records` holds both, computed once per run, for
`config.json` and the W&B run alike; they are not config fields (`trainer.config.stored.config_of` drops them).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from typing import Any

import jax
import ml_collections

import parallelism
from model import dense_kernel
from trainer.config.config_check import block_kernels
from trainer.core.training import model_config
from trainer.track.tracking import REDACTED, is_secret_field, scrub

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FLAG = re.compile(r"^(--?[^=]+)=(.*)$", re.DOTALL)


def _git(*args: str) -> str | None:
  try:
    result = subprocess.run(["git", "-C", _REPO, *args], capture_output=True, text=True,
                            timeout=10, check=False)
  except (OSError, subprocess.SubprocessError):  # No git, or a hung filesystem.
    return None
  return result.stdout.strip() if result.returncode == 0 else None


def _is_secret_flag(flag: str) -> bool:
  return flag.startswith("-") and is_secret_field(flag.lstrip("-").rsplit(".", 1)[-1])


def _scrub_argument(argument: str, previous: str) -> str:
  """`--x.api_key=v` loses its value, and so does the `v` of `--api_key v`; any secret
  environment value is redacted anywhere."""
  match = _FLAG.match(argument)
  if match and _is_secret_flag(match.group(1)):
    return f"{match.group(1)}={REDACTED}"
  if "=" not in previous and _is_secret_flag(previous) and not argument.startswith("-"):
    return REDACTED
  return scrub(argument)


def scrubbed_command(argv: list[str]) -> str:
  """A command line as a shell would take it, secrets redacted: the one form in which any
  command (the trainer, a tool) records its own on disk or in W&B."""
  return " ".join(shlex.quote(_scrub_argument(arg, previous))
                  for previous, arg in zip([""] + argv[:-1], argv))


def run_provenance(argv: list[str] | None = None) -> dict[str, Any]:
  """{"commit": sha or None, "dirty": bool or None, "command": str} of this process."""
  argv = list(sys.argv if argv is None else argv)
  if argv and argv[0].endswith(os.path.join("trainer", "__main__.py")):
    argv[:1] = ["python", "-m", "trainer"]
  commit = _git("rev-parse", "HEAD")
  status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
  return {"commit": commit, "dirty": None if status is None else bool(status),
          "command": scrubbed_command(argv)}


def run_resolved(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Devices, the mesh with its -1 filled, and the attention kernel: the block kernel that
  runs for `model.kernel` on the config's blocks (a stage may name another; where local and
  global layers differ, each kind's: 'pallas for L layers; cudnn for G layers'), or for
  dense attention `cudnn` where cuDNN computes it, else `xla` (the plain masked softmax)."""
  model_cfg = model_config(config)
  shape = parallelism.resolve_mesh_shape(config.mesh.to_dict(), jax.device_count())
  return {"num_devices": jax.device_count(), "num_processes": jax.process_count(),
          "device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
          "mesh": dict(zip(parallelism.MESH_AXES, shape)),
          "attention_kernel": (dense_kernel(model_cfg) if model_cfg.attention == "dense"
                               else block_kernels(config, jax.device_count())[0])}


def run_records(config: ml_collections.ConfigDict) -> dict[str, dict[str, Any]]:
  """{name: record} for every name in `RUN_RECORDS` (trainer/config/stored.py)."""
  return {"provenance": run_provenance(), "resolved": run_resolved(config)}
