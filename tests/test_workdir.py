"""The workdir never loses or mixes a run: config changes on resume, damage, the lock,
metrics.jsonl after a crash or a full disk, and the one-line errors around them."""

import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import mounted_tmpfs, tiny_cpu_config

import data
from data import sources
from trainer.ckpt.checkpointing import CheckpointError
from trainer.ckpt.resume import checkpoint_meta, compatibility_check, file_sha256
from trainer.config import workdir
from trainer.config.config_check import ConfigError
from trainer.core.training import data_config
from trainer.run import loop
from trainer.run.loop import train
from trainer.run.stop_signals import StoppedBeforeTraining
from trainer.tools.hf_export import ExportError, export
from trainer.tools.run_flags import run_config
from trainer.track import console, tracking

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tiny_config, **overrides):
  return tiny_config(**{"train.log_every": 1, "checkpoint.every_steps": 2, **overrides})


def _state_of(run) -> dict[str, list[str]]:
  """Every file under the checkpoint folders, to show that nothing was moved."""
  return {folder: sorted(os.path.relpath(os.path.join(d, f), run)
                         for d, _, files in os.walk(os.path.join(run, folder)) for f in files)
          for folder in ("checkpoints", "checkpoints_unusable")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data_dir):
  """A 4-step run with checkpoints at steps 2 and 4, copied fresh for each test."""
  config = tiny_cpu_config(shared_data_dir)
  config.train.log_every, config.checkpoint.every_steps = 1, 2
  config.train.steps = 4
  run = str(tmp_path_factory.mktemp("trained") / "run")
  train(config, run)
  return run


@pytest.fixture
def run(trained, tmp_path):
  copy = str(tmp_path / "run")
  shutil.copytree(trained, copy)
  return copy


# --- A config change is not damage -------------------------------------------------------

def test_a_change_of_state_structure_stops_and_moves_nothing(run, tiny_config):
  """grad_clip=0 drops the clipping state from the optimizer: same config fields allowed,
  other arrays. Before, this moved every checkpoint aside and restarted at step 1."""
  before = _state_of(run)
  with pytest.raises(CheckpointError, match=r"another config's state .*nothing was moved"):
    train(_config(tiny_config, **{"train.steps": 6, "train.grad_clip": 0.0}), run)
  assert _state_of(run) == before and not before["checkpoints_unusable"]


@pytest.mark.parametrize("field,value", [
    ("model.d_ff", 128),  # A shape.
    ("data.corpus_seed", 7),  # Other documents under the same embeddings.
    ("data.tokenizer_type", "unigram"),  # Another tokenizer.
])
def test_a_field_off_the_allow_list_is_refused_from_the_checkpoint_alone(run, tiny_config,
                                                                        field, value):
  os.remove(os.path.join(run, "config.json"))  # The checkpoint carries its own config.
  before = _state_of(run)
  with pytest.raises(ConfigError, match=rf"cannot resume with {field}=.*checkpoint of step 4"):
    train(_config(tiny_config, **{"train.steps": 6, field: value}), run)
  assert _state_of(run) == before


def test_another_tokenizer_file_is_refused(run, tiny_config, tmp_path):
  config = _config(tiny_config)
  tokenizer = tmp_path / "sp.model"
  tokenizer.write_bytes(b"not the tokenizer the run was trained with")
  meta = json.loads(open(os.path.join(run, "checkpoints", "4", "meta", "metadata")).read())
  assert meta["config"]["model"]["d_ff"] == config.model.d_ff and meta["tokenizer_sha256"]
  check = compatibility_check(config, run, str(tokenizer), file_sha256(str(tokenizer)),
                              meta["corpus"], [])
  with pytest.raises(ConfigError, match="tokenizer file .* SHA-256 differs"):
    check(4, meta)


def test_a_span_plan_travels_with_its_run(tiny_config, tmp_path, capsys):
  """A run keeps its span plan's bytes in its workdir and their SHA-256 in each checkpoint
  (issue #57: only the path was kept, so a plan edited between runs was trained on, sampled
  and exported silently). Edited, it is refused on resume in one line; deleted, the copy
  resumes, and the tools read the copy. Every span Infinity is causal: the plain tiny
  model's program, which the persistent cache holds."""
  plan, run = tmp_path / "plan.json", str(tmp_path / "run")
  causal = {"alpha": [[math.inf] * 4] * 2, "beta": [[0] * 4] * 2}
  plan.write_text(json.dumps(causal))
  config = lambda steps: _config(tiny_config, **{"train.steps": steps,
                                                 "model.head_spans": str(plan)})
  first = config(2)
  train(first, run)
  copy = os.path.join(run, "head_spans.json")
  assert os.path.isfile(copy) and open(copy).read() == plan.read_text()
  assert first.model.head_spans == copy  # What the run built from then on (the needle eval).
  plan.write_text(json.dumps({"alpha": [[8, 16, 256, 256]] * 2, "beta": [[0] * 4] * 2}))
  before = _state_of(run)
  with pytest.raises(ConfigError, match=rf"cannot resume with model.head_spans='{plan}': the "
                                        rf"checkpoint of step 2 was trained with another plan"
                                        ) as error:
    train(config(4), run)
  assert "\n" not in str(error.value) and _state_of(run) == before
  assert json.loads(open(copy).read()) == causal
  plan.unlink()  # The original gone: the run's copy resumes (as `python -m trainer` says).
  from trainer.config import span_plan  # pylint: disable=g-import-not-at-top
  resumed = config(2)
  assert span_plan.prefer_copy(resumed, run).endswith(f"reading the run's copy, {copy}")
  capsys.readouterr()
  train(resumed, run)
  assert "resuming from step 2" in capsys.readouterr().out
  assert run_config(run).model.head_spans == copy  # Sampling and the needle eval read it.
  with pytest.raises(ExportError, match=f"^model.head_spans='{copy}': per-head spans have no"):
    export(run, str(tmp_path / "out"), log=lambda line: None)


@pytest.mark.parametrize("recorded,stored,named,expected", [
    ("", "", "plan.json", "trained with no span plan; resume with model.head_spans=''"),
    ("abc", "plan.json", "", "trained with another plan (other bytes), kept in run/"),
    (None, "old.json", "plan.json", "trained with 'old.json'; resume with model.head_spans="),
    (None, "plan.json", "plan.json", None),  # Before plans were hashed: the path alone.
])
def test_a_span_plan_added_removed_or_of_an_older_checkpoint(recorded, stored, named,
                                                             expected, tiny_config):
  from trainer.config import span_plan  # pylint: disable=g-import-not-at-top
  config = tiny_config(**{"model.head_spans": named})
  problem = span_plan.resume_problem(config, "def" if named else "", recorded, stored, "run",
                                     "the checkpoint of step 4")
  assert problem == expected or expected in problem and "\n" not in problem


def test_a_corpus_whose_files_changed_is_refused(tiny_config, tmp_path):
  """A resumed run's data position indexes the documents it was trained on: `text_files`
  whose files changed since (here one edited, one added) are another corpus."""
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(3):
    (docs / f"{i}.txt").write_text(f"document {i} " * 50)
  config = _config(tiny_config, **{"data.dataset": "text_files", "data.path": str(docs),
                                   "data.data_dir": str(tmp_path / "prepared")})

  def corpus():
    sources.prepare_dataset(data_config(config))
    return data.corpus_id(data_config(config))

  trained_on = corpus()
  meta = checkpoint_meta(config, "sha", trained_on)
  for file in docs.iterdir():  # Times alone (a copy without -p, a checkout): the same corpus.
    os.utime(file, (1, 1))
  assert corpus() == trained_on == "text_files 1.2.0: train 2 documents " + trained_on.split(
      "train 2 documents ")[1]
  compatibility_check(config, str(tmp_path), "sp.model", "sha", trained_on, [])(4, meta)
  (docs / "1.txt").write_text("edited")
  (docs / "3.txt").write_text("added")
  now = corpus()
  check = compatibility_check(config, str(tmp_path), "sp.model", "sha", now, [])
  with pytest.raises(ConfigError, match=r"corpus is not the one the checkpoint of step 4 was "
                     r"trained on .*data.path's files changed since") as error:
    check(4, meta)
  assert "\n" not in str(error.value)


def test_a_start_says_what_it_does_not_do(run, tiny_config, capsys):
  """--start_over_from_step_0 beside a usable checkpoint is said to do nothing; a start from
  step 0 after logged steps (checkpoints/ deleted) warns that metrics.jsonl gets a second
  series."""
  train(_config(tiny_config, **{"train.steps": 4}), run, start_over=True)
  out = capsys.readouterr().out
  assert "resuming from step 4" in out and "--start_over_from_step_0 does nothing here" in out
  shutil.rmtree(os.path.join(run, "checkpoints"))
  train(_config(tiny_config, **{"train.steps": 1}), run)
  assert ("holds no checkpoint, but its metrics.jsonl logs steps up to 4: training from "
          "step 0") in capsys.readouterr().out


# --- Damage -------------------------------------------------------------------------------

def test_an_edited_data_position_is_damage_and_the_previous_checkpoint_resumes(
    run, tiny_config, capsys):
  path = os.path.join(run, "checkpoints", "4", "data", "metadata")
  with open(path) as f:
    text = f.read()
  edited = text.replace("4", "5", 1)
  assert edited != text and json.loads(edited)  # Still valid JSON: only the value changed.
  with open(path, "w") as f:
    f.write(edited)
  # With an allowed change too (one the compiled step does not read, so the fixture's
  # step serves it): it resumes and reports it.
  summary = train(_config(tiny_config, **{"train.steps": 3, "train.log_every": 2}), run)
  out = capsys.readouterr().out
  assert "checkpoints/4 is unusable" in out and "data position" in out
  assert "resuming from step 2" in out and "train.log_every: 1 -> 2" in out
  assert summary["steps"] == 3


def test_a_permission_error_is_not_damage(run, tiny_config, monkeypatch):
  """A read that fails for a reason outside the checkpoint's files moves nothing."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  real = ocp.CheckpointManager.restore

  def denied(self, step, *args, **kwargs):
    if step == 4:
      raise PermissionError(13, "Permission denied", "checkpoints/4/state")
    return real(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", denied)
  before = _state_of(run)
  with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*/4 .*not damage"):
    train(_config(tiny_config, **{"train.steps": 6}), run)
  assert _state_of(run) == before


def test_a_write_that_fails_mid_run_names_the_step_a_rerun_resumes_from(run, tiny_config,
                                                                         monkeypatch):
  """A full disk under wandb/run.json (or metrics.jsonl) at step 5 of a run resumed from step
  4: the one error line says where a re-run resumes, as a failed checkpoint save's does."""
  real = tracking.JsonlTracker.log

  def full_disk_at_step_5(self, record):
    if record.get("step") == 5:
      raise workdir.WorkdirError(f"cannot write {run}/wandb/run.json: No space left on device")
    real(self, record)

  monkeypatch.setattr(tracking.JsonlTracker, "log", full_disk_at_step_5)
  with pytest.raises(workdir.WorkdirError) as error:
    train(_config(tiny_config, **{"train.steps": 6}), run)
  assert str(error.value) == (
      f"cannot write {run}/wandb/run.json: No space left on device; the newest committed "
      f"checkpoint is step 4 in {run}/checkpoints, where a re-run resumes")


def test_no_fresh_start_beside_set_aside_checkpoints_unless_asked(tmp_path, tiny_config):
  run = str(tmp_path / "run")
  os.makedirs(os.path.join(run, "checkpoints_unusable", "8-1700000000"))
  config = _config(tiny_config, **{"train.steps": 1})
  with pytest.raises(CheckpointError, match="refusing to start from step 0.*start_over_from_step_0"):
    train(config, run)
  assert train(config, run, start_over=True)["steps"] == 1
  assert os.listdir(os.path.join(run, "checkpoints_unusable")) == ["8-1700000000"]


# --- One run per workdir ------------------------------------------------------------------

def test_a_second_run_on_a_held_workdir_stops_naming_the_holder(tmp_path):
  """The test process holds the lock; a trainer process on the same workdir stops at once."""
  run = str(tmp_path / "run")
  workdir.claim(run)
  try:
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py", f"--workdir={run}",
         "--config.checkpoint.async_save=False"],  # The renamed field parses.
        cwd=ROOT, capture_output=True, text=True, timeout=120)
  finally:
    workdir.release(run)
  assert result.returncode == 1
  assert re.fullmatch(
      rf"error: --workdir {re.escape(run)} is in use by PID {os.getpid()} on host "
      rf"{re.escape(os.uname().nodename)} \(started [-+:T0-9]+\); wait for that run to end or "
      rf"pass another --workdir\n", result.stderr), result.stderr
  assert sorted(os.listdir(run)) == [".lock"]  # Nothing of the second run was written.


def test_the_lock_dies_with_its_process(tmp_path):
  run = str(tmp_path / "run")
  holder = subprocess.Popen([sys.executable, "-c", (
      "import sys, time; sys.path.insert(0, '.'); from trainer.config import workdir; "
      f"workdir.claim({run!r}); print('held', flush=True); time.sleep(60)")],
      cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  with pytest.raises(workdir.WorkdirError, match=f"in use by PID {holder.pid}"):
    workdir.claim(run)
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  workdir.claim(run)  # kill -9 leaves no stale lock.
  workdir.release(run)


# --- metrics.jsonl ------------------------------------------------------------------------

def test_a_torn_last_line_is_cut_and_a_whole_one_is_ended(tmp_path, capsys):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2, "lo')
  tracking.JsonlTracker(str(path)).close()
  assert "torn by a crash (15 bytes); removed it" in capsys.readouterr().out
  path.write_text('{"step": 1}\n{"step": 2}')
  tracker = tracking.JsonlTracker(str(path))
  tracker.log({"step": 3})
  tracker.close()
  assert "ended its last line" in capsys.readouterr().out
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_non_finite_values_are_written_as_null(tmp_path):
  path = tmp_path / "metrics.jsonl"
  tracker = tracking.JsonlTracker(str(path))
  tracker.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.5})
  tracker.close()
  text = path.read_text()
  assert json.loads(text, parse_constant=lambda name: pytest.fail(name)) == {
      "step": 1, "loss": None, "grad_norm": None, "lr": 0.5}


@pytest.fixture
def small_disk(tmp_path):
  """A 1 MiB tmpfs (needs root, as in CI's container)."""
  with mounted_tmpfs(tmp_path / "small_disk", "size=1M") as mount_point:
    yield mount_point


def _fill(disk) -> None:
  with open(disk / "filler", "wb", buffering=0) as f:
    try:
      while True:
        f.write(b"x" * 4096)
    except OSError:
      pass


def test_a_full_disk_never_leaves_a_partial_metrics_line(small_disk):
  path = small_disk / "metrics.jsonl"
  tracker = tracking.JsonlTracker(str(path))
  try:
    tracker.log({"step": 1})
    _fill(small_disk)
    with pytest.raises(tracking.TrackingError, match="No space left on device"):
      for step in range(2, 10_000):  # Until the page the file holds is used up.
        tracker.log({"step": step, "padding": "y" * 300})
  finally:
    tracker.close()
  lines = path.read_text().splitlines()
  assert all(json.loads(line) for line in lines) and json.loads(lines[0]) == {"step": 1}


def test_a_full_disk_at_start_leaves_no_empty_config(small_disk):
  (small_disk / "config.json").write_text('{"old": true}')
  _fill(small_disk)
  with pytest.raises(workdir.WorkdirError, match="No space left on device"):
    workdir.write_atomically(str(small_disk / "config.json"), json.dumps({"x": "y" * 8192}))
  assert json.loads((small_disk / "config.json").read_text()) == {"old": True}
  assert sorted(os.listdir(small_disk)) == ["config.json", "filler"]


# --- One line, not a traceback ------------------------------------------------------------

def _cli(*args, timeout=120, **popen):
  return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, **popen)


# A config file that fails to load: tests/test_config.py, in-process.
@pytest.mark.parametrize("case", ["missing_config", "workdir_is_a_file", "read_only_workdir",
                                  "data_error"])
def test_bad_input_is_one_line(case, tmp_path):
  config, extra, mounts = "configs/tiny_cpu.py", [], contextlib.ExitStack()
  if case == "missing_config":
    config, expected = str(tmp_path / "nope.py"), "does not exist"
  elif case == "workdir_is_a_file":
    (tmp_path / "file").write_text("")
    extra, expected = [f"--workdir={tmp_path / 'file'}"], "is not a directory"
  elif case == "read_only_workdir":
    mounts.enter_context(mounted_tmpfs(tmp_path / "ro", "ro,size=1M"))
    extra, expected = [f"--workdir={tmp_path / 'ro' / 'run'}"], "Read-only file system"
  else:  # A data error after Orbax would have started: no background-thread traceback.
    extra = [f"--workdir={tmp_path / 'run'}", "--config.data.dataset=text_files",
             f"--config.data.path={tmp_path / 'no_such_corpus'}"]
    expected = "no_such_corpus"
  with mounts:
    result = _cli("--config", config, *extra)
  assert result.returncode == 1, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def _wait_for_handler(pid: int, signum: int) -> None:
  """Until the process catches `signum` (its SigCgt mask in /proc)."""
  for _ in range(1000):
    with open(f"/proc/{pid}/status") as f:
      caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    if caught >> (signum - 1) & 1:
      return
    time.sleep(0.01)
  pytest.fail(f"process {pid} never installed a handler for signal {signum}")


def test_a_signal_while_importing_exits_cleanly(tmp_path, shared_data_dir):
  process = subprocess.Popen(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py",
       f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={shared_data_dir}"], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _wait_for_handler(process.pid, signal.SIGTERM)  # Installed before JAX is imported.
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 0, err
  assert "stopped by SIGTERM before the first step" in out and "Traceback" not in err, err


def test_a_signal_after_start_but_before_the_first_step_stops_at_once(tmp_path, tiny_config,
                                                                      monkeypatch):
  real = loop.build_training

  def signalled(*args):  # SIGINT arrives while the step compiles.
    os.kill(os.getpid(), signal.SIGINT)
    return real(*args)

  monkeypatch.setattr(loop, "build_training", signalled)
  # Python's own handler, or SIG_IGN when the suite was started in the background of a
  # non-interactive shell (which ignores SIGINT for its background jobs).
  before = signal.getsignal(signal.SIGINT)
  with pytest.raises(StoppedBeforeTraining, match="stopped by SIGINT before the first"):
    train(_config(tiny_config, **{"train.steps": 2}), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
  assert signal.getsignal(signal.SIGINT) is before  # Handlers restored.


def test_an_export_of_a_damaged_step_says_so_in_one_line_and_names_the_others(run, tmp_path):
  """The reads Orbax abandons with the failed one echo it hundreds of lines long (asyncio's
  never-retrieved tasks, unraisable coroutines, TensorStore's spec): none reach the user."""
  chunks = os.path.join(run, "checkpoints", "4", "state", "ocdbt.process_0", "d")
  for name in os.listdir(chunks):
    os.remove(os.path.join(chunks, name))
  result = subprocess.run([sys.executable, "-m", "trainer.export", f"--workdir={run}",
                           f"--out={tmp_path / 'out'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 1 and len(errors) == 1, result.stderr
  assert "checkpoints/4 is damaged" in errors[0] and errors[0].endswith(
      "nothing was moved; --step picks another (2)"), result.stderr
  assert len(result.stderr.splitlines()) <= 3 and "TensorStore" not in result.stderr, (
      result.stderr)
  assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "out")


def test_closed_loop_echoes_are_one_line_and_other_errors_pass(capsys):
  """After a failed Orbax read or write, its dropped I/O raises 'Event loop is closed' once
  per completion (36 tracebacks on a damaged OCDBT index, measured through the CLI)."""
  passed = []
  echoes = console.ClosedLoopEchoes(orbax_unraisable=True)
  echoes._excepthook = lambda *args: passed.append(args[1])  # pylint: disable=protected-access
  echoes._unraisablehook = lambda u: passed.append(u.exc_value)  # pylint: disable=protected-access
  for _ in range(3):
    echoes.unraisablehook(SimpleNamespace(exc_value=RuntimeError("Event loop is closed")))
    echoes.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
  other = RuntimeError("something else")
  echoes.unraisablehook(SimpleNamespace(exc_value=other))
  # A read abandoned with a failed one ("Exception ignored in: <coroutine object
  # _read_array_index_and_device_put>"): an echo when unraisable, not when raised.
  abandoned = _orbax_failure()[1]
  echoes.unraisablehook(SimpleNamespace(exc_value=abandoned))
  echoes.excepthook(ValueError, abandoned, abandoned.__traceback__)
  assert passed == [other, abandoned] and echoes.count == 7
  assert capsys.readouterr().err.count("'Event loop is closed' and other echoes are not "
                                       "shown") == 1
  trainer_echoes = console.ClosedLoopEchoes()  # The trainer's: only closed loops are echoes.
  trainer_echoes._unraisablehook = passed.append  # pylint: disable=protected-access
  trainer_echoes.unraisablehook(SimpleNamespace(exc_value=abandoned))
  assert passed[-1].exc_value is abandoned and trainer_echoes.count == 0


def _orbax_failure():
  try:
    exec(compile("raise ValueError('No space left on device')",  # pylint: disable=exec-used
                 os.path.join(os.sep, "site-packages", "orbax", "serialization.py"), "exec"))
  except ValueError:
    return sys.exc_info()


def test_orbax_writes_logged_by_asyncio_keep_one_traceback():
  """A full disk on a busy machine: asyncio logs each abandoned Orbax write ('exception was
  never retrieved', traceback through Orbax's code); only the first Orbax traceback stays."""
  def record(pathname, exc_info):
    return logging.LogRecord("asyncio", logging.ERROR, pathname, 1, "Future exception was never "
                             "retrieved", None, exc_info)

  once = console.OrbaxTracebackOnce()
  records = [record("/usr/lib/python3.11/asyncio/base_events.py", _orbax_failure())
             for _ in range(3)]
  unrelated = record("/usr/lib/python3.11/asyncio/base_events.py",
                     (ValueError, ValueError("mine"), None))
  assert all(once.filter(r) for r in [*records, unrelated])  # Records are kept, as lines.
  assert [r.exc_info is not None for r in records] == [True, False, False]
  assert unrelated.exc_info is not None


def test_a_checkpoint_of_an_older_trainer_resumes_without_the_fields_added_since(tiny_config):
  """A field the checkpoint does not record (added to the trainer after it was written)
  changes nothing at its default: every new field stopped every older run's resume."""
  from trainer.ckpt import resume
  config = tiny_config()
  stored = resume.config_dict(config)
  del stored["model"]["sparse"], stored["model"]["hash_buckets"]
  assert resume.compare(stored, config) == []
  config.model.sparse, config.model.hash_buckets = "hash", 4
  with pytest.raises(ConfigError, match=r"model.hash_buckets=4 \(and model.sparse\): the "
                                        r"checkpoint was trained with '<absent>'"):
    resume.compare(stored, config)
