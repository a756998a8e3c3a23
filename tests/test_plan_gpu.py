"""`--dry_run` for described GPUs: the train step compiled by XLA's GPU compiler on this CPU
machine (`trainer/plan/plan_target.py`; `make test` installs the compiler with `make plan_gpu`)."""

import importlib
import os
import subprocess
import sys

import jax
import pytest

from conftest import tiny_cpu_config
from trainer.config.config_check import ConfigError
from parallelism import overlap
from trainer.core import xla_options
from trainer.plan import dry_run, plan_target, ring_links

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON = "__gpu$xla.gpu.triton"  # Pallas's kernels, lowered for CUDA


@pytest.fixture(scope="module")
def h100_plan(shared_data_dir):
  """The tiny striped config (bf16 compute, remat 'none') compiled for 8 described H100s:
  (plan, compiled program's text)."""
  config = tiny_cpu_config(shared_data_dir, "striped")
  plan, compiled = dry_run.memory_plan(config, 80.0, target="h100")
  return plan, compiled.as_text()


def test_the_gpu_plan_runs_the_fused_kernel_and_keeps_bf16(tiny_config, h100_plan):
  on_gpu, text = h100_plan
  assert on_gpu["compiled_for"] == "NVIDIA H100 80GB HBM3" and on_gpu["devices"] == 8
  # `auto` is planned as the Pallas kernel there (cuDNN's compiles only on an attached GPU),
  # compiled to Triton, not interpreted: forward, dK/dV and dQ.
  assert text.count(f'custom_call_target="{TRITON}"') >= 3
  assert on_gpu["floor_total_bytes"] == on_gpu["total_bytes"] and on_gpu["fits"]
  # The GPU keeps bf16 activations bf16: its temporaries are below its own float32 compile's.
  # (Not below the CPU's: XLA:CPU from JAX 0.11 computes bf16 matmuls natively too, and on
  # this tiny config its plan holds less, 8.2 against the GPU's 10.3 MB.)
  as_float32, _ = dry_run.memory_plan(tiny_config("striped", **{"model.dtype": "float32"}),
                                      80.0, target="h100")
  assert on_gpu["temp_bytes"] < as_float32["temp_bytes"]
  # The same state and arguments either way (float32 parameters and moments in both; the
  # CPU plan's state is checked against a real step in tests/test_dry_run.py).
  for key in ("params", "param_bytes", "opt_state_bytes", "argument_bytes"):
    assert on_gpu[key] == as_float32[key], key


def test_the_gpu_plan_says_whether_every_ring_step_overlaps(h100_plan):
  """The train step's own schedule (tests/test_overlap.py checks attention alone at a real
  block size, every layout): the dry run's line, and the dK/dV's last hop found apart."""
  plan, text = h100_plan
  assert plan["ring_overlap"].startswith("ring transfers: every ring step's"), plan
  found = overlap.transfers(text)
  assert not overlap.exposed(found) and sum(t.home for t in found) == 1  # in the layer scan


def test_the_plan_says_which_link_each_ring_step_needs():
  """7B at 256k on 8 GPUs: each forward step sends a 512 MiB K/V block (32,768 tokens, 32
  KV heads of 128, bf16, plus segment ids), hidden behind its compute even between nodes;
  a ring of 16 spans two nodes, and its half-length blocks' backward waits on their link
  (768 MiB in 16 ms at 50 GB/s against 11 ms of compute); at 1M it is hidden again."""
  config = importlib.import_module("configs.7b_256k_striped").get_config()
  shape = dict.fromkeys(("data", "fsdp", "ulysses", "tensor"), 1)
  lines = ring_links.lines(config, {**shape, "sequence": 8}, 989e12, 0.4)
  assert "forward  sends 512.12 MiB" in lines[1] and "link-bound" not in lines[1], lines
  assert lines[-1].endswith("stays inside one node (8 of 8 devices): NVLink")
  step = ring_links.ring_step(config, {**shape, "sequence": 8}, 989e12, 0.4)
  assert step["backward_bytes"] == step["forward_bytes"] + 2 * 32768 * 32 * 128 * 4
  assert step["backward_s"] == pytest.approx(2 * step["forward_s"])
  across = ring_links.lines(config, {**shape, "sequence": 16}, 989e12, 0.4)
  assert "backward sends 768.06 MiB" in across[2] and "link-bound" in across[2], across
  assert "spans nodes (16 devices" in across[-1] and "waits on the 400 Gb/s link" in across[-1]
  config = importlib.import_module("configs.7b_1m_striped").get_config()
  across = ring_links.lines(config, {**shape, "sequence": 16}, 989e12, 0.4)[-1]
  assert "spans nodes (16 devices" in across and "still hidden behind compute" in across


def test_offload_on_gpus_puts_exactly_the_layer_inputs_in_host_memory(tiny_config, h100_plan):
  """The CPU plan estimates what 'offload' moves (`dry_run.offloaded_bytes`); the GPU
  compiler places it: the two agree to the byte, and the device keeps less than with no
  remat (the shared plan's 'none')."""
  offload, _ = dry_run.memory_plan(tiny_config("striped", **{"train.remat": "offload"}), 80.0,
                                   target="h100")
  none, _ = h100_plan
  # 2 layers x 2 rows x 64 tokens x 128 wide, bf16 (as the CPU test's estimate).
  assert offload["host_temp_bytes"] == offload["offloaded_bytes"] == 2 * 2 * 64 * 128 * 2
  assert none["host_temp_bytes"] == none["offloaded_bytes"] == 0
  assert offload["temp_bytes"] < none["temp_bytes"]


def test_more_than_8_gpus_are_hosts_of_8():
  devices = plan_target.devices("h200", 16)
  assert len(devices) == 16 and {d.process_index for d in devices} == {0, 1}
  assert devices[0].device_kind == "NVIDIA H200 141GB HBM3e"
  with pytest.raises(ConfigError, match="12 GPUs are not whole hosts of 8"):
    plan_target.devices("h100", 12)
  with pytest.raises(ConfigError, match="no GPU description for 'tpu_v4'"):
    plan_target.devices("tpu_v4", 8)


def test_described_gpus_compile_without_autotuning_and_attached_devices_as_they_are():
  """A described GPU has nothing to time autotuning candidates on (XLA's defaults either
  way): the planner turns it off, which halves a GPU plan's compile; CPUs are left alone."""
  assert plan_target.compiler_options(plan_target.devices("h100", 8)) == {
      "xla_gpu_autotune_level": 0, **xla_options.GPU_OPTIONS}
  assert plan_target.compiler_options(jax.devices()) == {}


def test_a_cudnn_plan_for_described_gpus_is_one_config_error(tiny_config):
  with pytest.raises(ConfigError, match="'cudnn' cannot be planned for described GPUs"):
    dry_run.memory_plan(tiny_config("striped", **{"model.kernel": "cudnn"}), 80.0, target="h100")


def test_auto_compiles_for_the_accelerator_when_it_is_a_gpu():
  assert plan_target.described_target("auto", "a100") == "a100"
  assert plan_target.described_target("cpu", "h100") is None
  with pytest.raises(ConfigError, match="--plan_accelerator='tpu_v5p' is none of them"):
    plan_target.described_target("gpu", "tpu_v5p")


def _dry_run(*flags, **env):
  environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  return subprocess.run(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py", "--dry_run", *flags],
      cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=300,
      check=False)


def test_the_command_line_plans_for_h100s_by_default_and_says_when_it_cannot():
  # One layer, the cheaper compile: this tests the command line, not the plan (the tests above).
  result = _dry_run("--config.model.num_layers=1")
  assert result.returncode == 0, result.stderr[-2000:]
  assert ("8 devices (NVIDIA H100 80GB HBM3, described to XLA's GPU compiler, none attached"
          in result.stdout), result.stdout
  # Judged against what JAX may allocate: 0.95 of an H100's 79.11 GiB (the Dockerfile's).
  assert "fits in 75.15 GiB per device (" in result.stdout
  # The plugin's C++ lines about the missing CUDA driver (expected here) are not shown.
  assert "cuda drivers" not in result.stderr and "absl::InitializeLog" not in result.stderr, (
      result.stderr)
  # Without the compiler, asking for it is one line naming the fix.
  missing = _dry_run("--plan_compiler=gpu", PLAN_GPU_DIR=os.path.join(ROOT, "no-such-dir"))
  assert missing.returncode != 0
  last = missing.stderr.strip().splitlines()[-1]
  assert last.startswith("error: compiling the plan for GPUs needs XLA's GPU compiler")
  assert "make plan_gpu" in last


def test_the_plugin_load_filter_drops_two_lines_and_keeps_an_abort_message():
  """While the plugin loads, fd 2 goes through a filter process: the missing-driver lines
  are dropped, any other line kept, even when the process aborts right after writing it (one
  process: a block that returns, then one that aborts)."""
  script = ("import os, sys\n"
            "from trainer.plan import plan_target\n"
            "for how in ('return', 'abort'):\n"
            "  with plan_target._without_missing_driver_lines():\n"
            "    os.write(2, b'I0000 cudart_stub.cc:31] Could not find cuda drivers on your "
            "machine\\n')\n"
            "    os.write(2, b'F0000 the plugin failed\\n')\n"
            "    if how == 'abort':\n"
            "      os.abort()\n"
            "  print('after', file=sys.stderr)\n")
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
  assert result.stderr.endswith("F0000 the plugin failed\nafter\nF0000 the plugin failed\n"), (
      result.stderr)
  assert "cuda drivers" not in result.stderr, result.stderr
