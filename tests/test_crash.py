"""Crash matrix: a real SIGKILL of a training process at four moments of an async save.

Each case trains 12 steps (a save every 4, keep 1) in a subprocess (tests/crash_driver.py)
that kills itself with SIGKILL during the save of step 8:

- start:  the step's temporary directory was just created;
- write:  TensorStore has written some arrays of the step, not all;
- commit: everything is written and finalized, the temporary directory not yet renamed;
- delete: Orbax's removal of step 4 is half done (at the save of step 12: step 4 stays
          until a finite step has followed step 8);

and once more at `commit` of the first save (step 4), where there is nothing to resume from.

The files on disk are checked to show the kill hit that moment. Then the same run is started
again in a fresh process: it must resume from the newest committed step (4, or 12 once the
kill comes after its commit, or start afresh), finish, leave no temporary directory behind, and end with the same losses,
bitwise, as an uninterrupted run.

The subprocesses use the session's JAX compilation cache (tests/conftest.py): the tiny
config's step, compiled once by whichever test trains it first, is loaded by the rest.
"""

import json
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "crash_driver.py")
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step or item not yet committed.
STEPS, EVERY, KEEP, KILL_STEP = 12, 4, 1, 8


def _last_losses(workdir) -> dict[int, float]:
  """Loss per step from metrics.jsonl; a step logged again after a resume counts last."""
  losses = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for record in map(json.loads, f):  # A torn line would raise here.
      if "loss" in record:
        losses[record["step"]] = record["loss"]
  return losses


def _files(path) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), path)
                for d, _, names in os.walk(path) for f in names)


def _array_data(path) -> list[str]:
  """TensorStore's chunk files (OCDBT keeps them in `d/` folders)."""
  return [f for f in _files(path) if "/d/" in f"/{f}"]


def _leftovers(checkpoints) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, name), checkpoints)
                for d, dirs, files in os.walk(checkpoints) for name in dirs + files
                if TMP_SUFFIX in name)


@pytest.fixture(scope="module")
def driver(tmp_path_factory, shared_data_dir):
  """Runs tests/crash_driver.py; `reference` holds the losses of an uninterrupted run."""
  base = tmp_path_factory.mktemp("crash")
  # The session's compilation cache (tests/conftest.py), which the environment hands on.
  env = {**os.environ, "WANDB_MODE": "disabled"}

  def run(workdir, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, DRIVER, f"--workdir={workdir}", f"--data_dir={shared_data_dir}",
         f"--steps={STEPS}", f"--every_steps={EVERY}", f"--keep={KEEP}", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300)

  straight = run(base / "straight")
  assert straight.returncode == 0, straight.stdout[-4000:]
  reference = _last_losses(base / "straight")
  assert sorted(reference) == list(range(1, STEPS + 1))
  return SimpleNamespace(run=run, reference=reference)


def _at_start(checkpoints, step, output):
  del output
  pending = os.path.join(checkpoints, f"{step}{TMP_SUFFIX}")
  assert os.path.isdir(pending)
  assert not _array_data(pending), _files(pending)  # Nothing of the state written yet.


def _during_write(checkpoints, step, output):
  del output
  pending = os.path.join(checkpoints, f"{step}{TMP_SUFFIX}")
  state = os.path.join(pending, f"state{TMP_SUFFIX}")
  assert os.path.isdir(state)  # The state item is not finalized ...
  assert _array_data(state), _files(pending)  # ... but some of its arrays are on disk,
  assert not os.path.exists(os.path.join(state, "_METADATA"))  # the tree's metadata not yet.
  assert not os.path.exists(os.path.join(pending, "commit_success.txt"))


def _before_commit(checkpoints, step, output):
  del output
  pending = os.path.join(checkpoints, f"{step}{TMP_SUFFIX}")
  # Every item is finalized and the commit file written: only the rename is missing.
  assert os.path.exists(os.path.join(pending, "commit_success.txt")), _files(pending)
  for item in ("state", "data", "meta"):
    assert os.path.exists(os.path.join(pending, item, "commit_success.txt")), item
  assert os.path.exists(os.path.join(pending, "state", "_METADATA"))


def _while_deleting(checkpoints, step, output):
  assert os.path.exists(os.path.join(checkpoints, str(step), "commit_success.txt"))
  old = os.path.join(checkpoints, str(step - EVERY))
  total = int(re.search(rf"deleting step {step - EVERY} \((\d+) files\)", output)[1])
  assert 0 < len(_files(old)) < total, _files(old)  # Partly deleted.


# id: (phase, step whose save is killed, check of the files at the kill, step to resume from)
CASES = {
    "start": ("start", KILL_STEP, _at_start, KILL_STEP - EVERY),
    "write": ("write", KILL_STEP, _during_write, KILL_STEP - EVERY),
    "commit": ("commit", KILL_STEP, _before_commit, KILL_STEP - EVERY),
    "delete": ("delete", KILL_STEP, _while_deleting, KILL_STEP + EVERY),
    # The first save, complete but for its rename, is no checkpoint: start again from 0.
    "commit_first": ("commit", EVERY, _before_commit, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_during_save_resumes_from_newest_committed_step(driver, tmp_path, case):
  phase, kill_step, check_files, resume_step = CASES[case]
  workdir = tmp_path / "run"
  checkpoints = workdir / "checkpoints"

  crashed = driver.run(workdir, f"--kill={phase}", f"--kill_step={kill_step}")
  assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-4000:]
  assert f"crash_driver: SIGKILL {phase}" in crashed.stdout
  check_files(str(checkpoints), kill_step, crashed.stdout)
  steps_on_disk = [int(name) for name in os.listdir(checkpoints) if name.isdigit()]
  assert max(steps_on_disk, default=None) == resume_step  # The newest committed step.

  resumed = driver.run(workdir)
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  assert re.findall(r"resuming from step (\d+)", resumed.stdout) == (
      [str(resume_step)] if resume_step else [])
  assert "unusable" not in resumed.stdout  # No damaged checkpoint was even tried.
  assert _last_losses(workdir) == driver.reference  # Bitwise, every step.
  assert _leftovers(checkpoints) == []
  assert sorted(os.listdir(checkpoints)) == [str(STEPS)]  # keep=1: the partial old step too.
