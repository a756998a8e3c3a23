"""`--dry_run` on fake CPU devices: the plan's memory matches a real compiled step, and it
allocates no parameter (the plan for described GPUs: tests/test_plan_gpu.py)."""

import contextlib
import io
import os
import subprocess
import sys

import flax.linen as nn
import jax
from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

import data
import parallelism
from conftest import SHARED_FLAGS, tiny_cpu_config
from trainer.config import flops
from trainer.config.config_check import ConfigError
from trainer.core.state import init_state
from trainer.core.training import build_training
from trainer.plan import command, dry_run, plan_report, plan_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _real_step_peak(config) -> tuple[int, list[tuple[int, ...]]]:
  """Peak bytes per device of the step compiled as the trainer does, on allocated state."""
  mesh = parallelism.make_mesh(config.mesh)
  seq_len = config.data.seq_len
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    parts = build_training(config, mesh)
    state = init_state(parts.model, parts.optimizer, parts.shardings, config.seed)
    batch = {name: jax.device_put(np.zeros((config.train.batch_size, seq_len), dtype),
                                  parts.batch_sharding)
             for name, dtype in dry_run.BATCH_DTYPES.items()}
    memory = parts.step_fn.lower(state, batch).compile().memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
          + memory.output_size_in_bytes - memory.alias_size_in_bytes)
  return peak, [tuple(x.shape) for x in jax.tree.leaves(state.params)]


@pytest.fixture(scope="module")
def offload_plan(shared_data_dir):
  """The tiny striped config with remat 'offload', planned on the CPU with the floor's float32
  compile (one plan for the tests of the CPU's figures): (config, plan, what it printed, the
  arrays it left alive)."""
  config = tiny_cpu_config(shared_data_dir, "striped")
  config.train.remat = "offload"
  assert jax.device_count() == 8  # the backend is up with the 8 test devices: plan reuses them
  before = {id(x) for x in jax.live_arrays()}
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    plan = dry_run.plan(config, device_memory_gib=80.0, mfu=0.4, accelerator="h100",
                        compiler="cpu")
  new = [x for x in jax.live_arrays() if id(x) not in before]
  return config, plan, printed.getvalue(), new


@pytest.mark.slow(40)
def test_plan_matches_real_step_and_allocates_nothing(offload_plan):
  config, plan, printed, new = offload_plan
  assert "fits in 80 GiB per device" in printed and plan["compiled_for"] == "cpu"

  real_peak, param_shapes = _real_step_peak(config)  # 'offload' runs as 'full' on the CPU
  assert real_peak / 2 <= plan["peak_bytes"] <= real_peak * 2, (plan["peak_bytes"], real_peak)
  # Nothing parameter-like was left allocated by the plan (a stray RNG key at most).
  assert not [x.shape for x in new if tuple(x.shape) in param_shapes]
  assert sum(x.nbytes for x in new) < 1024, [(x.shape, x.dtype) for x in new]
  # The state's per-device bytes: the tiny model's float32 parameters over fsdp x sequence.
  params = sum(int(np.prod(s)) for s in param_shapes)
  assert plan["params"] == params
  assert params * 4 / 8 <= plan["param_bytes"] < params * 4 / 4
  assert plan["opt_state_bytes"] >= 2 * plan["param_bytes"]  # Adam's two moments
  assert plan["analytic_flops"] > 0 and plan["step_time_s"] > 0


def test_cli_dry_run_prints_verdict():
  # A fresh process: the planner itself must set up the config's 8 CPU devices (the XLA flag
  # that gives this one 8 is not passed on; the suite's others are). float32 compute: one
  # compile, without the floor's (tested below), of the program `offload_plan` compiled as
  # its floor, which the session's compilation cache then serves.
  xla_flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
               if not flag.startswith("--xla_force_host_platform_device_count")]
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  result = subprocess.run(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py:striped", "--dry_run",
       "--plan_compiler=cpu", "--plan_accelerator=tpu_v5e", "--config.model.dtype=float32",
       "--config.train.remat=offload", *SHARED_FLAGS],
      cwd=ROOT, env={**env, "XLA_FLAGS": " ".join(xla_flags)}, capture_output=True, text=True,
      timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "mesh: data=1 x fsdp=2 x sequence=4 x ulysses=1 x tensor=1 = 8 devices" in result.stdout
  assert "fits in 16 GiB per device (" in result.stdout, result.stdout


@pytest.mark.parametrize("args, message", [
    (("--dry_run", "--device_memory_gib=-5"), "--device_memory_gib=-5 must be positive"),
    (("--dry_run", "--compare_strategies", "--intra_node_gbps=nan"),
     "--intra_node_gbps=nan must be positive"),
    (("--plan_compiler=cpu",), "--plan_compiler plans: pass it with --dry_run"),  # Trained.
    (("--find_max_seq_len",), "--find_max_seq_len plans: pass it with --dry_run"),
    (("--dry_run", "--find_max_seq_len", "--plan_mfu=0.5"),
     "--plan_mfu is read by a plain --dry_run and --compare_strategies only"),  # Was ignored.
    (("--dry_run", "--node_size=4"), "--node_size is read by --compare_strategies only"),
    (("--dry_run", "--find_max_seq_len", "--compare_strategies"),
     "pass one of --find_max_seq_len and --compare_strategies"),
])
def test_plan_flags_out_of_place_or_range_are_named(args, message):
  """What `python -m trainer` prints as its one error line for the planner's flags (the
  command line's own test is below, with one of these)."""
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["trainer", *args])
    assert command.flags_problem() == message


@pytest.mark.parametrize("args, wandb_mode, message", [
    (("--dry_run", "--plan_mfu=0"), "", "--plan_mfu=0 must be in (0, 1]"),  # Was a ZeroDivision.
    (("--dry_run", "--plan_accelerator=tpu_v6"), "", "--plan_accelerator='tpu_v6' is not one "
     "of h100, h100_pcie, h200, a100, or a TPU kind (v4, v5e, v5p, v6e) or slice (v5p-16)"),
    (("--config.init.from_hf=tests/hf_fixtures/llama_gqa_sharded", "--config.model.num_layers=4"),
     "", "--config.model.num_layers=4, but init.from_hf=tests/hf_fixtures/llama_gqa_sharded has "
     "2: the checkpoint sets the model's shape (only its RoPE and local attention may be "
     "overridden); drop the override"),  # Was dropped without a word.
    ((), "bogus", "W&B mode 'bogus' (from WANDB_MODE or config.wandb.mode) is not one of "
                  "auto, online, offline, disabled"),  # Was a traceback, after the workdir.
])
def test_flags_out_of_place_or_range_stop_in_one_line(tmp_path, args, wandb_mode, message):
  env = {**os.environ, "WANDB_MODE": wandb_mode}
  result = subprocess.run(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py",
       f"--workdir={tmp_path / 'run'}", *args], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=120, check=False)
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [f"error: {message}"]
  assert not (tmp_path / "run").exists()


def test_a_cpu_compile_is_checked_against_the_accelerators_memory(tiny_config, monkeypatch):
  """Not 80 GiB for every kind: a TPU v5e has 16, and a described GPU the same figure whether
  the plan compiles for it or for CPUs; the search for the longest length uses it too."""
  # One figure per accelerator: a GPU's description, a TPU chip's HBM.
  assert {key for key in flops.PEAK_FLOPS if not plan_target.tpu_target.parse(key)} == set(
      plan_target.GPUS)
  assert dry_run.default_memory_gib(None, "tpu_v5e") == 16.0
  assert dry_run.default_memory_gib(None, "v5p-16") == 95.0
  assert dry_run.default_memory_gib(None, "h100") == plan_target.memory_gib("h100") < 80
  judged = []
  monkeypatch.setattr(dry_run, "memory_plan", lambda config, memory_gib, floor=True, target=None: (
      judged.append(memory_gib) or {"total_bytes": 0, "fits": False}, None))
  dry_run.find_max_seq_len(tiny_config("striped"), log=lambda line: None,
                           accelerator="tpu_v5e")
  assert judged and set(judged) == {16.0}


def test_abstract_batch_is_what_the_loop_sends():
  assert set(dry_run.BATCH_DTYPES) == set(data.TRAIN_FIELDS)


def test_plan_names_a_device_count_it_cannot_have(tiny_config):
  config = tiny_config("striped", **{"mesh.data": 2})  # 16 devices; the test process has 8
  assert jax.device_count() == 8
  with pytest.raises(ConfigError, match="needs 16 CPU devices .* already started with 8"):
    dry_run.plan(config, compiler="cpu")


def test_plan_bounds_the_cpu_promotion_and_accounts_for_offload(offload_plan):
  _, plan, out, _ = offload_plan
  # Offload: the layer inputs of the tests' tiny config (2 layers x 2 rows x 64 tokens x 128
  # bf16: a batch of 4 over 2 fsdp shards).
  assert plan["offloaded_bytes"] == 2 * 2 * 64 * 128 * 2
  assert plan["total_bytes"] == plan["peak_bytes"] + plan["code_bytes"] - plan["offloaded_bytes"]
  assert "offloaded layer inputs" in out and "float32 compile temps" in out
  # The float32 compile's temporaries, halved, lie below the CPU's: a floor, and a verdict
  # between the two for a memory between them.
  assert plan["float32_temp_bytes"] // 2 < plan["temp_bytes"]
  floor, total = plan["floor_total_bytes"], plan["total_bytes"]
  assert floor < total
  memory_gib = (floor + total) / 2 / plan_report.GIB  # The same figures, judged for less memory.
  between = dry_run.with_verdict(plan, memory_gib)
  assert not between["fits"] and between["may_fit"]
  line = plan_report.verdict_line(between, memory_gib)
  assert f"between {floor / plan_report.GIB:.1f} GiB (floor)" in line


@pytest.mark.parametrize("start, largest", [(256, 6144), (65536, 6144), (256, 100)])
def test_find_max_seq_len_doubles_then_bisects(tiny_config, monkeypatch, start, largest):
  # The search alone: a plan that fits up to `largest` tokens (compiles are tested above).
  probes = []

  def memory_plan(config, memory_gib, floor=True, target=None):
    del memory_gib, floor, target
    probes.append(config.data.seq_len)
    fits = config.data.seq_len <= largest
    return {"total_bytes": 0, "fits": fits}, None

  monkeypatch.setattr(dry_run, "memory_plan", memory_plan)
  config = tiny_config("striped", **{"data.seq_len": start})
  unit = dry_run.seq_len_unit(config)  # 4 ring devices x 32-token tiles.
  assert unit == 128
  found = dry_run.find_max_seq_len(config, 1.0, log=lambda line: None)
  if largest < unit:
    assert found == 0
    return
  assert found % unit == 0 and found <= largest
  assert largest - found <= max(unit, found // 16)
  assert len(probes) <= 12


def test_compare_strategies_plans_every_split_of_the_sequence_devices(tiny_config):
  """fsdp 4 x sequence 2: ring, all-gather and Ulysses over the 2 sequence devices, each
  from its own compiled step; the table names the fastest that fits."""
  from trainer.plan import strategy_plan
  # One layer in float32, the cheaper compiles: the rows' balances depend on neither, and
  # their bytes and times only scale.
  config = tiny_config("ring", **{"mesh.fsdp": 4, "mesh.sequence": 2, "model.num_layers": 1,
                                  "model.dtype": "float32"})
  lines = []
  rows = strategy_plan.compare(config, log=lines.append)
  by_choice = {(r["strategy"], r["ring"], r["ulysses"], r["layout"]): r for r in rows}
  assert list(by_choice) == [(strategy, 2, 1, layout) for strategy in ("ring", "allgather")
                             for layout in ("ring", "striped", "zigzag")] + [
                                 ("ulysses", 1, 2, "any")]
  assert all(r["fits"] and r["total_bytes"] > 0 for r in rows)
  # The contiguous ring leaves device 0 idle half the time; zigzag and Ulysses (a ring of
  # one) are balanced (up to the diagonal tiles' masked halves).
  ring, zigzag = by_choice["ring", 2, 1, "ring"], by_choice["ring", 2, 1, "zigzag"]
  assert ring["balance"] < zigzag["balance"] <= 1.0
  assert ring["balance"] < by_choice["ulysses", 1, 2, "any"]["balance"] <= 1.0
  # The ring sends one dK/dV block more (its last hop home, `parallelism.traffic.formula`)
  # but overlaps its hops with attention; the all-gather overlaps nothing.
  allgather = by_choice["allgather", 2, 1, "ring"]
  assert ring["ring_s"] > allgather["ring_s"] > 0
  assert ring["step_s"] - ring["compute_s"] < ring["ring_s"]
  assert allgather["step_s"] - allgather["compute_s"] == pytest.approx(allgather["ring_s"])
  assert lines[-1].startswith("fastest that fits: ")


def test_compare_strategies_refuses_dense(tiny_config):
  from trainer.plan import strategy_plan
  with pytest.raises(ConfigError, match="dense"):
    strategy_plan.compare(tiny_config("dense"), log=lambda line: None)
