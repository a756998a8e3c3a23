"""What every bench script records: the commit it measured and its JSON lines in results/."""

import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
  """`git describe --always --dirty`: rows before and after a change sit side by side."""
  return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                        capture_output=True, text=True, check=False).stdout.strip()


def append(name: str, records: list[dict]) -> None:
  """Appends `records` as JSON lines to results/<name>."""
  path = os.path.join(ROOT, "results", name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
