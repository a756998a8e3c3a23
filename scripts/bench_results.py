"""What every bench script records: the commit it measured and its JSON lines in results/."""

import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
  """`git describe --always`, `-dirty` when a tracked file outside results/ differs from it:
  rows before and after a change sit side by side. The rows a bench appends to results/
  are not the code measured (a second run of `git describe --dirty` called it dirty)."""
  def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()
  changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                ":(exclude)results")
  return git("describe", "--always") + ("-dirty" if changed else "")


def append(name: str, records: list[dict]) -> None:
  """Appends `records` as JSON lines to results/<name>."""
  path = os.path.join(ROOT, "results", name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
