"""The config a run keeps in its workdir: `config.json`, the config with its run records
beside it (trainer/track/provenance.py writes those). Here, apart from the code that writes
it, because the tools' command lines read it before they import JAX."""

from __future__ import annotations

import os
from typing import Any

RUN_RECORDS = ("provenance", "resolved")  # Beside the config in config.json.


def config_path(workdir: str) -> str:
  return os.path.join(workdir, "config.json")


def config_of(written: dict[str, Any]) -> dict[str, Any]:
  """A `config.json`'s config: what the loop wrote, less the run records."""
  return {key: value for key, value in written.items() if key not in RUN_RECORDS}
