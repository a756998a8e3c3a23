"""Crash matrix: a real SIGKILL of a training process at four moments of an async save.

One workdir trains 12 steps (a save every 4, keep 1) in subprocesses (tests/crash_driver.py),
each killing itself with SIGKILL at one moment of a save and each resuming what the one
before it left:

- at `commit` of the first save (step 4): complete but for its rename, so no checkpoint;
- start:  step 8's temporary directory was just created;
- write:  TensorStore has written some arrays of step 8, not all;
- commit: everything of step 8 is written and finalized, the temporary directory not yet
          renamed;
- delete: Orbax's removal of step 4 is half done (at the save of step 12: step 4 stays
          until a finite step has followed step 8).

The files on disk are checked to show each kill hit its moment. Each next process must
resume from the newest committed step (none, then 4, then 12 once the kill comes after its
commit) without trying a damaged one; the last finishes and leaves no temporary directory
behind; and every loss any of them logged equals, bitwise, an uninterrupted run's at its
step. (One chain rather than one run per moment: every process but the first is also the
resume of the crash before it.)

The subprocesses use the session's JAX compilation cache (tests/conftest.py): the tiny
config's step, compiled once by whichever test trains it first, is loaded by the rest.
"""

import json
import os
import re
import signal
import subprocess
import sys

from trainer.run.loop import train

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


def _run_driver(workdir, data_dir, *extra) -> subprocess.CompletedProcess:
  return subprocess.run(  # The session's compilation cache comes with the environment.
      [sys.executable, DRIVER, f"--workdir={workdir}", f"--data_dir={data_dir}",
       f"--steps={STEPS}", f"--every_steps={EVERY}", f"--keep={KEEP}", *extra],
      cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=300)


def _reference_losses(tiny_config, workdir) -> dict[int, float]:
  """An uninterrupted run of the driver's config, in this process (the same compiled step)."""
  config = tiny_config(**{"train.steps": STEPS, "train.log_every": 1,
                          "checkpoint.every_steps": EVERY, "checkpoint.keep": KEEP})
  train(config, str(workdir))
  return _last_losses(workdir)


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


# (phase, step whose save is killed, check of the files at the kill, step to resume from)
CHAIN = [
    ("commit", EVERY, _before_commit, None),  # The first save is no checkpoint yet.
    ("start", KILL_STEP, _at_start, KILL_STEP - EVERY),
    ("write", KILL_STEP, _during_write, KILL_STEP - EVERY),
    ("commit", KILL_STEP, _before_commit, KILL_STEP - EVERY),
    ("delete", KILL_STEP, _while_deleting, KILL_STEP + EVERY),
]


def test_sigkill_at_each_moment_of_a_save_resumes_from_the_newest_committed_step(
    tiny_config, shared_data_dir, tmp_path):
  reference = _reference_losses(tiny_config, tmp_path / "straight")
  assert sorted(reference) == list(range(1, STEPS + 1))
  workdir = tmp_path / "run"
  checkpoints = workdir / "checkpoints"
  resumed_from = None  # What the next process must resume from.
  for phase, kill_step, check_files, newest in CHAIN + [(None, None, None, None)]:
    run = _run_driver(workdir, shared_data_dir,
                      *([f"--kill={phase}", f"--kill_step={kill_step}"] if phase else []))
    where = f"the run killed at {phase} of step {kill_step}" if phase else "the last run"
    assert re.findall(r"resuming from step (\d+)", run.stdout) == (
        [str(resumed_from)] if resumed_from else []), (where, run.stdout[-4000:])
    assert "unusable" not in run.stdout, where  # No damaged checkpoint was even tried.
    if phase is None:
      assert run.returncode == 0, run.stdout[-4000:]
      break
    assert run.returncode == -signal.SIGKILL, (where, run.stdout[-4000:])
    assert f"crash_driver: SIGKILL {phase}" in run.stdout, where
    check_files(str(checkpoints), kill_step, run.stdout)
    steps_on_disk = [int(name) for name in os.listdir(checkpoints) if name.isdigit()]
    assert max(steps_on_disk, default=None) == newest, where  # The newest committed step.
    resumed_from = newest
  assert _leftovers(checkpoints) == []
  assert sorted(os.listdir(checkpoints)) == [str(STEPS)]  # keep=1: the partial old step too.
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    logged = [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]
  assert {step for step, _ in logged} == set(reference)
  assert all(loss == reference[step] for step, loss in logged), logged  # Bitwise, every one.
