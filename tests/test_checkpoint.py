"""Checkpoints: exact continuation, signals, corruption, resharding, NaN, a full disk."""

import asyncio
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
from flax import linen as nn
import numpy as np
import pytest
import tensorstore
from orbax.checkpoint._src import asyncio_utils

import data
import parallelism
from conftest import SHARED_FLAGS, mounted_tmpfs, tiny_cpu_config
from trainer.ckpt.checkpointing import CheckpointError, Checkpointer, _first_line
from trainer.ckpt.tool_reads import open_step, read_step
from trainer.core.state import TrainState
from trainer.core.optimizer import make_schedule
from trainer.run import loop
from trainer.run.loop import NonFiniteError, train
from trainer.run.stop_signals import StopSignals, StoppedBeforeTraining

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _config(tiny_config, **overrides):
  # The fixture's one schedule for every run, so runs of different lengths stay comparable.
  return tiny_config(**{"train.log_every": 1, "checkpoint.every_steps": 10, **overrides})


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, shared_data_dir):
  """20 uninterrupted steps of `_config` (saves at 10 and 20): the losses every resumed run
  must give, and a run to damage (copy it first)."""
  config = tiny_cpu_config(shared_data_dir)
  config.train.log_every, config.train.steps, config.checkpoint.every_steps = 1, 20, 10
  workdir = tmp_path_factory.mktemp("straight")
  train(config, str(workdir))
  return workdir, _losses(workdir)


def test_resume_continues_exactly(tmp_path, tiny_config, straight_run):
  every = {"checkpoint.every_steps": 5}
  train(_config(tiny_config, **{"train.steps": 10, **every}), str(tmp_path / "resumed"))
  assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["10", "5"]
  train(_config(tiny_config, **{"train.steps": 20, **every}), str(tmp_path / "resumed"))
  resumed = _losses(tmp_path / "resumed")
  assert sorted(resumed) == list(range(1, 21))  # One file, appended, no step twice.
  assert resumed == straight_run[1]  # Bitwise on CPU: same batches, same state.


def test_incompatible_change_is_refused(tmp_path, tiny_config):
  train(_config(tiny_config, **{"train.steps": 2}), str(tmp_path))
  from trainer.config.config_check import ConfigError
  with pytest.raises(ConfigError, match="model.d_ff"):
    train(_config(tiny_config, **{"train.steps": 4, "model.d_ff": 128}), str(tmp_path))


def test_no_checkpoints_when_every_steps_is_zero(tmp_path, tiny_config, capsys):
  """Benchmarks (`make gpu_check`) train without writing a 13 GB final checkpoint per run."""
  train(_config(tiny_config, **{"train.steps": 2, "checkpoint.every_steps": 0}), str(tmp_path))
  assert not os.listdir(tmp_path / "checkpoints")
  assert "checkpoint.every_steps=0: this run saves no checkpoint" in capsys.readouterr().out
  assert sorted(_losses(tmp_path)) == [1, 2]


def _checkpoint_values(workdir, config, mesh_sizes, step=None):
  """Restores the newest checkpoint onto a mesh of the given sizes; returns host arrays."""
  (config.mesh.data, config.mesh.fsdp, config.mesh.sequence, config.mesh.ulysses,
   config.mesh.tensor) = mesh_sizes
  mesh = parallelism.make_mesh(config.mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    checkpointer = Checkpointer(workdir, 10, 3, False)
    restored = checkpointer.restore(loop.build_training(config, mesh).abstract_state)
    checkpointer.close()
  return restored[0], jax.device_get(restored[1]), restored[1]


def test_restore_onto_other_meshes_is_exact(tmp_path, tiny_config):
  config = _config(tiny_config, **{"train.steps": 3, "checkpoint.every_steps": 3})
  config.mesh.data, config.mesh.fsdp, config.mesh.sequence, config.mesh.tensor = 1, 2, 4, 1
  train(config, str(tmp_path))
  step, saved, _ = _checkpoint_values(str(tmp_path), config, (1, 2, 4, 1, 1))
  # (data, fsdp, sequence, ulysses, tensor); the last also shards parameters over ulysses.
  for sizes in [(1, 1, 8, 1, 1), (2, 2, 2, 1, 1), (1, 2, 1, 2, 2)]:
    other_step, values, arrays = _checkpoint_values(str(tmp_path), config, sizes)
    assert other_step == step == 3
    jax.tree.map(np.testing.assert_array_equal, values, saved)
    embedding = arrays.params["embedding"]
    assert embedding.sharding.mesh.devices.shape == sizes  # Really on the new mesh.


def _corrupt_newest(workdir, how):
  newest = os.path.join(workdir, "checkpoints", "20")
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(newest, "state")) for f in fs]
  if how == "delete_metadata":
    os.remove(os.path.join(newest, "state", "_METADATA"))
  else:
    target = max(files, key=os.path.getsize)  # The array data.
    with open(target, "r+b") as f:
      if how == "truncate":
        f.truncate(os.path.getsize(target) // 2)
      else:
        f.seek(os.path.getsize(target) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


# A checkpoint write that fails (a full disk) stops at its first error; pytest reports the
# callback of the failed save's closed event loop as "exception ignored". It is the expected
# failure, not a second one.
_CLOSED_SAVE_LOOP = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. None\\s+Traceback[^$]*Event loop is closed"
    ":pytest.PytestUnraisableExceptionWarning")


@_CLOSED_SAVE_LOOP
@pytest.mark.parametrize("how", ["delete_metadata", "truncate", "flip_bit"])
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, tiny_config, capsys, how,
                                                         straight_run):
  shutil.copytree(straight_run[0], tmp_path, dirs_exist_ok=True)
  _corrupt_newest(str(tmp_path), how)
  summary = train(_config(tiny_config, **{"train.steps": 22}), str(tmp_path))
  out = capsys.readouterr().out
  assert "checkpoints/20 is unusable" in out and "resuming from step 10" in out
  assert summary["steps"] == 22


def test_checkpoints_that_all_fail_never_start_from_scratch(tmp_path, tiny_config):
  train(_config(tiny_config, **{"train.steps": 10}), str(tmp_path))
  os.remove(os.path.join(tmp_path, "checkpoints", "10", "state", "_METADATA"))
  with pytest.raises(CheckpointError, match="refusing to start from step 0"):
    train(_config(tiny_config, **{"train.steps": 12}), str(tmp_path))


def test_a_flipped_bit_is_caught_by_the_fingerprint(tmp_path, tiny_config):
  """Orbax itself would restore a flipped value silently; our fingerprints name it."""
  config = _config(tiny_config, **{"train.steps": 2, "checkpoint.every_steps": 2})
  train(config, str(tmp_path))
  _, _, arrays = _checkpoint_values(str(tmp_path), config, (1, 2, 4, 1, 1))
  with open(tmp_path / "checkpoints" / "2" / "meta" / "metadata") as f:
    meta = json.load(f)
  tampered = jax.tree.map(lambda x: x, arrays)
  bits = np.asarray(tampered.params["final_norm"]["scale"]).view(np.uint32).copy()
  bits[5] ^= 1
  tampered.params["final_norm"]["scale"] = jax.numpy.asarray(bits.view(np.float32))
  with pytest.raises(CheckpointError, match="final_norm"):
    Checkpointer._verify(2, tampered, meta)
  # Export and sampling read the parameters alone, and verify them alike.
  checkpointer, step = open_step(str(tmp_path), None, CheckpointError)
  mesh = parallelism.make_mesh(config.mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    abstract = loop.build_training(config, mesh).abstract_state
    params, _ = checkpointer.read_params(step, lambda meta: abstract)
  checkpointer.close()
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params),
               jax.device_get(arrays.params))
  with pytest.raises(CheckpointError, match="final_norm"):
    Checkpointer._verify(2, tampered.replace(step=None, opt_state=None), meta, only=".params")


def _poison_step(monkeypatch, bad_step):
  """Makes the loss of one step NaN by giving its batch a NaN loss mask."""
  calls = {"n": 0}
  real = data.to_global_batch

  def poisoned(batch, *args):
    calls["n"] += 1
    if calls["n"] == bad_step:
      batch = {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}
    return real(batch, *args)

  monkeypatch.setattr(data, "to_global_batch", poisoned)


def _all_finite(workdir, config):
  checkpointer = Checkpointer(str(workdir), 10, 3, False)
  steps = checkpointer._manager.all_steps()
  checkpointer.close()
  for step in steps:
    restored = _checkpoint_values(str(workdir), config, (1, 2, 4, 1, 1))[1]
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(restored)
               if np.issubdtype(np.asarray(x).dtype, np.floating)), step
  return steps


def test_nan_stops_the_run_naming_step_and_checkpoint(tmp_path, tiny_config, monkeypatch):
  """The checkpoint the failing step started from goes aside (a finite update can leave
  weights that overflow next), and the one named is the newest a finite step followed: kept
  beside `keep=1` until a newer one is followed."""
  _poison_step(monkeypatch, 11)
  config = _config(tiny_config, **{"train.steps": 20, "checkpoint.every_steps": 5,
                                   "checkpoint.keep": 1})
  with pytest.raises(NonFiniteError, match=r"step 11;.*checkpoint was moved to .*"
                     r"checkpoints_unusable/10-.*; the last good checkpoint is step 5"):
    train(config, str(tmp_path))
  assert _all_finite(tmp_path, config) == [5]


def test_nan_skip_policy_skips_the_update(tmp_path, tiny_config, monkeypatch):
  _poison_step(monkeypatch, 5)
  config = _config(tiny_config, **{"train.steps": 10, "train.on_nonfinite": "skip"})
  summary = train(config, str(tmp_path))
  assert summary["skipped_steps"] == 1 and summary["steps"] == 10
  assert _all_finite(tmp_path, config) == [10]
  # The logged lr is the applied one: step 6 runs AdamW's 5th update (count 4), as step 5 did.
  schedule = make_schedule(config.train)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    lr = {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}
  assert lr[4] == pytest.approx(float(schedule(3))) and lr[5] == lr[6] == pytest.approx(
      float(schedule(4))) and lr[7] == pytest.approx(float(schedule(5)))


def _cli(workdir, *overrides, **popen):
  return subprocess.Popen(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py",
       f"--workdir={workdir}", "--config.train.log_every=1", "--config.train.eval_every=0",
       *overrides], cwd=ROOT, text=True, **popen)


@pytest.mark.slow(45)
def test_sigterm_saves_at_the_signal_step_and_resumes_exactly(tmp_path, shared_data_dir,
                                                              straight_run, tiny_config, capsys):
  common = (f"--config.data.data_dir={shared_data_dir}", "--config.checkpoint.every_steps=1000",
            *SHARED_FLAGS)
  process = _cli(tmp_path / "stopped", "--config.train.steps=20", *common,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  for line in process.stdout:
    if line.startswith("step") and line.split()[1].startswith("8/"):
      process.send_signal(signal.SIGTERM)
      break
  output = process.communicate(timeout=120)[0]
  assert process.returncode == 0, output
  stopped_at = int(output.split("stopping at step ")[1].split()[0])
  assert f"stopped: step {stopped_at}, loss " in output  # The summary names the same step.
  assert os.listdir(tmp_path / "stopped" / "checkpoints") == [str(stopped_at)]
  # The same config, resumed in this process (the signal's part is the command line's).
  capsys.readouterr()
  train(_config(tiny_config, **{"train.steps": 20, "checkpoint.every_steps": 1000}),
        str(tmp_path / "stopped"))
  assert f"resuming from step {stopped_at}" in capsys.readouterr().out
  assert _losses(tmp_path / "stopped") == straight_run[1]


def test_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path, tiny_config,
                                                                   shared_data_dir):
  """`python -m trainer` on a disk that holds one checkpoint: the failed async save of step 20
  stops the run at the next step with one error line (exit 1), Orbax's echoes folded."""
  # One checkpoint of the tiny model is ~6 MB; the second cannot fit.
  with mounted_tmpfs(tmp_path / "small_disk", "size=9M") as mount_point:
    workdir = str(mount_point / "run")
    process = _cli(workdir, "--config.train.steps=30", "--config.checkpoint.every_steps=10",
                   *SHARED_FLAGS, f"--config.data.data_dir={shared_data_dir}",
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 1, err[-3000:]
    # One error line (Orbax's background threads may still log around it, so not the last).
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: saving step 20 failed \(.*No space left on device.*\); the newest committed "
        r"checkpoint is step 10 in .*/run/checkpoints", errors[0]), (errors, err[-3000:])
    assert (out + err).count("Traceback") <= 1  # Orbax's first log of the failure only.
    # Noticed within a step or two of the failure, not at the next save (step 30).
    assert max(_losses(workdir)) <= 23, max(_losses(workdir))
    checkpointer = Checkpointer(workdir, 10, 3, False)
    assert checkpointer._manager.all_steps() == [10]
    checkpointer.close()
    assert _checkpoint_values(workdir, _config(tiny_config), (1, 2, 4, 1, 1))[0] == 10


def test_an_error_line_keeps_the_os_reason_tensorstore_puts_before_its_spec(tmp_path):
  """TensorStore writes its spec (hundreds of characters) between the OS's reason and the error
  code; shortening the line in the middle cut the reason out ("No space left on device" in CI)."""
  (tmp_path / "a_file").touch()
  spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "a_file" / "x")}}
  with pytest.raises(ValueError) as raised:
    tensorstore.open(spec, create=True, dtype=tensorstore.float32, shape=[8]).result()
  assert "tensorstore_spec" in str(raised.value) and len(str(raised.value)) > 300
  line = _first_line(raised.value)
  assert "Not a directory" in line and "tensorstore_spec" not in line, line


def _tiny_state(value: float) -> TrainState:
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return TrainState(step=jax.device_put(np.int32(0), sharding),
                    params={"w": jax.device_put(np.full(8, value, np.float32), sharding)},
                    opt_state={"mu": jax.device_put(np.zeros(8, np.float32), sharding)})


def test_a_step_the_run_removes_while_a_tool_reads_it_is_no_damage(tmp_path):
  """A run saving every step with keep=1 deletes the step a tool beside it (sample, export,
  needle) is reading: the tool reads the newest step instead, and says so if that goes too."""
  run = Checkpointer(str(tmp_path), 1, 1, use_async=False)
  run.save(1, _tiny_state(1.0), {}, {})
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          _tiny_state(0.0))

  def read_while_the_run_saves(checkpointer, step):
    run.save(step + 1, _tiny_state(step + 1.0), {}, {})  # keep=1: deletes `step`.
    return checkpointer.read_params(step, lambda meta: abstract)[0]

  def read(checkpointer, step):
    return checkpointer.read_params(step, lambda meta: abstract)[0]

  with pytest.raises(CheckpointError, match=r"checkpoints/1 was removed by the running job "
                     r"while it was read; pick a newer --step"):
    read_step(str(tmp_path), 1, read_while_the_run_saves, CheckpointError)
  params, step = read_step(str(tmp_path), None, lambda c, s: (
      read_while_the_run_saves if s == 2 else read)(c, s), CheckpointError)
  assert step == 3 and float(params["w"][0]) == 3.0
  with pytest.raises(CheckpointError, match=r"checkpoints/4 was removed .*, twice"):
    read_step(str(tmp_path), None, read_while_the_run_saves, CheckpointError)
  run.close()


def test_a_failed_read_leaves_no_orbax_read_behind(monkeypatch):
  """Orbax gathers an array's shard reads: the first that fails (a damaged file) must not leave
  the others pending on a closed loop, each to print a traceback with its TensorStore spec."""
  dropped = []
  monkeypatch.setattr(sys, "unraisablehook", dropped.append)

  async def shard_read(fails: bool):
    try:  # As Orbax's read does: whatever ends it, a GeneratorExit at collection included.
      await asyncio.sleep(0 if fails else 60)
      raise OSError("truncated")
    except BaseException as error:
      raise Exception("Encountered error while reading array index") from error

  async def read_array():
    await asyncio.gather(shard_read(True), shard_read(False))

  with pytest.raises(Exception, match="Encountered error"):
    asyncio_utils.run_sync(read_array())  # What Orbax's restore runs its reads with.
  gc.collect()
  assert not dropped


def test_a_signal_lost_in_a_gc_callback_still_stops_before_the_first_step(monkeypatch):
  """A handler runs wherever the main thread is: SIGINT as the loop starts landed in JAX's
  garbage-collector callback, where Python prints what it raises (a traceback) and carries on,
  and the run trained a step. The hand-over to the loop stops it instead, with no traceback."""
  dropped = []
  monkeypatch.setattr(sys, "unraisablehook", dropped.append)

  def interrupted_callback(phase, info):
    del info
    if phase == "start":
      os.kill(os.getpid(), signal.SIGINT)  # Its handler runs at this function's next line.
      sum(range(10))

  with StopSignals() as signals:
    gc.callbacks.append(interrupted_callback)
    try:
      gc.collect()
    finally:
      gc.callbacks.remove(interrupted_callback)
    with pytest.raises(StoppedBeforeTraining, match="stopped by SIGINT before the first step"):
      signals.enter_loop()
  assert not dropped and sys.unraisablehook == dropped.append

