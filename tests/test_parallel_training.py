"""Training on meshes, layouts and micro-batches gives the losses of one reference.

The model computes in float32 here (`model.dtype`): then every variant differs from the
reference only by float32 summation order, so the tolerances are float32 rounding grown
over a few optimizer steps (1e-5 relative for meshes, 1e-4 for layouts over 20 steps, as
the issues state). In bf16 the same comparisons would be limited by bf16 rounding instead.

Two processes train the losses of one, and a SIGTERM to both saves one agreed step, in
tests/test_slurm.py (a real `jax.distributed` runtime started by Slurm's srun); the one
multi-process test here covers what only the explicit coordinator flags do.
"""

import functools
import json
import os
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import parallelism
from conftest import tiny_cpu_config
from model import Decoder
from trainer.core.optimizer import make_optimizer
from trainer.core.state import abstract_state, shardings_of
from trainer.run import loop
from trainer.run.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(workdir) -> list[float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _config(tiny_config, attention="striped", mesh=(1, 2, 4, 1), **overrides):
  # One 20-step schedule for every run, so 10-step runs match the first 10 of 20; the
  # config's own batch of 8 rows, one per device when fsdp has all 8 (not the tests' 4).
  config = tiny_config(attention, **{"train.log_every": 1, "train.steps": 10,
                                     "train.schedule_steps": 20, "model.dtype": "float32",
                                     "train.batch_size": 8, "checkpoint.every_steps": 1000,
                                     **overrides})
  config.mesh.data, config.mesh.fsdp, config.mesh.sequence, config.mesh.tensor = mesh
  return config


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, shared_data_dir):
  """20 steps of striped attention on the tiny config's own mesh (1, 2, 4, 1)."""
  config = _config(functools.partial(tiny_cpu_config, shared_data_dir), **{"train.steps": 20})
  workdir = str(tmp_path_factory.mktemp("reference"))
  train(config, workdir)
  return _losses(workdir)


def test_fsdp_alone_with_dense_attention_gives_the_same_losses(tmp_path, tiny_config,
                                                              reference_losses):
  """Parameters and batch over 8 fsdp shards, the sequence whole: dense attention on
  unpermuted rows trains the striped reference's losses (float32 order only)."""
  train(_config(tiny_config, "dense", (1, 8, 1, 1), **{"train.steps": 20}), str(tmp_path))
  losses = _losses(tmp_path)
  assert len(losses) == 20
  np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


def test_data_sequence_and_tensor_under_other_rules_give_the_same_losses(tmp_path, tiny_config,
                                                                        reference_losses):
  """Batch over `data`, the ring over `sequence`, parameters over `tensor` (data alone adds
  nothing: the batch splits over `data` in every run), under a rules table whose
  activation heads are not over `tensor` and batch is over `data` only: the ring's
  shard_map follows the rules table like the activations around it, and training is
  unchanged. The default table's heads over `tensor` inside the ring (the same spec code,
  other values) are checked against dense in tests/test_strategies.py and in the compiled
  program in tests/test_attention_sharding.py."""
  config = _config(tiny_config, "striped", (2, 1, 2, 2))
  other = {"activation_batch": "data", "activation_heads": None, "activation_kv_heads": None}
  config.mesh.rules = tuple((name, other.get(name, target)) for name, target in config.mesh.rules)
  train(config, str(tmp_path))
  np.testing.assert_allclose(_losses(tmp_path), reference_losses[:10], rtol=1e-5)


def test_the_ring_layout_in_micro_batches_under_allgather_trains_the_same_losses(
    tmp_path, tiny_config, reference_losses):
  """The ring layout (rows not permuted), the reference's batch of 8 as 4 micro-batches of 2
  (one row per fsdp shard) and the all-gather strategy, together: each changes the step,
  none the losses. One run for the three, as none of them changes another's code path: the
  layout is the data pipeline's permutation and the ring's static schedule, micro-batches
  the step's loop around the model, the strategy how attention's devices exchange K/V.
  (Zigzag trains under hybrid in the resume test below; every layout under every strategy
  is checked against dense in tests/test_ring_attention.py and tests/test_strategies.py.)"""
  train(_config(tiny_config, "ring", **{"train.steps": 20, "train.micro_batches": 4,
                                        "model.sequence_parallel": "allgather"}),
        str(tmp_path))
  losses = _losses(tmp_path)
  assert len(losses) == 20
  np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


def test_a_ring_run_resumes_under_hybrid(tmp_path, tiny_config, reference_losses):
  """10 steps of a striped ring saved, 10 more resumed as Ulysses x ring (4 x 2) on another
  mesh: the checkpoint does not depend on the strategy, and the losses are the reference's.
  Ulysses 4 over the tiny config's 2 K/V heads repeats each twice, so this is also the
  training run of the Ulysses path: `ulysses` runs the same code (`Strategy` with a
  Ulysses axis) around a ring of one, which tests/test_strategies.py checks against dense."""
  config = _config(tiny_config, "striped", **{"checkpoint.every_steps": 10})
  train(config, str(tmp_path))
  config = _config(tiny_config, "zigzag", (1, 1, 2, 1), **{
      "train.steps": 20, "checkpoint.every_steps": 10, "model.sequence_parallel": "hybrid"})
  config.mesh.ulysses = 4
  train(config, str(tmp_path))
  np.testing.assert_allclose(_losses(tmp_path), reference_losses, rtol=1e-4)


def test_every_parameter_is_sharded_as_the_rules_say(tiny_config):
  config = _config(tiny_config, mesh=(1, 2, 2, 2))
  mesh = parallelism.make_mesh(config.mesh)
  model = Decoder(loop.model_config(config))
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    shardings = shardings_of(abstract_state(model, make_optimizer(config.train), mesh,
                                            config.mesh.rules))
  rules = dict(config.mesh.rules)
  embed = tuple(rules["embed"])
  expected = {  # name -> spec, from the rules table: embed over (fsdp, sequence), rest tensor.
      "embedding": P("tensor", embed),
      "query/kernel": P(None, embed, "tensor", None),
      "key/kernel": P(None, embed, "tensor", None),
      "out/kernel": P(None, "tensor", None, embed),
      "gate/kernel": P(None, embed, "tensor"),
      "down/kernel": P(None, "tensor", embed),
      "lm_head/kernel": P(embed, "tensor"),
      "scale": None,  # Norm gains: replicated by the rules (norm -> None).
  }
  checked = 0
  for path, sharding in jax.tree_util.tree_leaves_with_path(shardings.params):
    name = "/".join(getattr(k, "key", str(k)) for k in path)
    for suffix, spec in expected.items():
      if name.endswith(suffix):
        if spec is None:
          assert all(axis is None for axis in sharding.spec), (name, sharding.spec)
        else:
          assert sharding.spec == spec, (name, sharding.spec)
        checked += 1
  assert checked >= 10
  # Optimizer moments follow their parameters.
  mu = shardings.opt_state[1][0].mu
  assert mu["embedding"].spec == P("tensor", embed)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow(15)
def test_processes_that_do_not_run_the_same_settings_all_stop_in_one_line(tmp_path):
  """A process given another data.seq_len trained a different model in step with the other
  (exit 0), and one given another workdir hung at the first save: now every process stops
  before any work, naming what differs. A --process_id out of range is one line too."""
  address = f"127.0.0.1:{_free_port()}"
  xla_flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled", "XLA_FLAGS": xla_flags}
  procs = [subprocess.Popen(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py",
       f"--workdir={tmp_path / f'run{pid}'}", f"--coordinator_address={address}",
       "--num_processes=2", f"--process_id={pid}", "--config.cpu_devices=4",
       f"--config.data.seq_len={256 * (pid + 1)}"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for pid in range(2)]
  try:
    for pid, proc in enumerate(procs):
      _, err = proc.communicate(timeout=300)
      assert proc.returncode == 1, err[-3000:]
      errors = [line for line in err.splitlines() if line.startswith("error: ")]
      assert errors == [
          f"error: the processes do not run with the same --workdir, data.seq_len (process "
          f"{pid} has --workdir={tmp_path / f'run{pid}'}, data.seq_len={256 * (pid + 1)}): "
          f"give every process the same command"], err[-3000:]
      assert not (tmp_path / f"run{pid}").exists()
  finally:
    for proc in procs:
      proc.kill()
  result = subprocess.run(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py",
       f"--coordinator_address={address}", "--num_processes=2", "--process_id=2"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
      "error: --process_id=2 must be in 0..1 (--num_processes=2)"), result.stderr
