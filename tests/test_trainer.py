"""The train loop end to end on the tiny config: determinism, learning, outputs."""

import ast
import gzip
import json
import os
import subprocess

import numpy as np
import pytest

import data
from trainer.run.loop import train
from trainer.tools import run_flags
from trainer.track import profiling
from trainer.track.provenance import run_provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def test_same_seed_same_losses_and_the_loss_falls(tmp_path, tiny_config):
  config = tiny_config(**{"train.steps": 15, "train.log_every": 1})
  train(config, str(tmp_path / "a"))
  train(config, str(tmp_path / "b"))
  first, second = _losses(tmp_path / "a"), _losses(tmp_path / "b")
  assert len(first) == 15
  assert first == second  # Bitwise: same seed, same data, same program.
  assert np.mean(first[-5:]) < first[0] - 0.5, first


def test_a_run_with_the_same_step_settings_reuses_the_traced_step(tiny_config):
  """Within a process, a second run whose model, optimizer, shardings and rules are the
  same gets the step already traced (trainer.core.training); anything the step's program
  reads that differs gets its own."""
  import flax.linen as nn
  import jax

  import parallelism
  from trainer.core.training import build_training

  def step_fn(config):
    mesh = parallelism.make_mesh(config.mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
      return build_training(config, mesh).step_fn

  first = step_fn(tiny_config(**{"train.steps": 4, "train.log_every": 1}))
  # Steps, logging and evaluation are not the step's: the same traced step.
  assert step_fn(tiny_config(**{"train.steps": 30, "train.eval_every": 10})) is first
  assert step_fn(tiny_config(**{"train.lr": 1e-3})) is not first  # The optimizer's.
  assert step_fn(tiny_config("striped")) is not first  # The model's.
  config = tiny_config()
  config.mesh.rules = tuple((name, None if name == "activation_heads" else target)
                            for name, target in config.mesh.rules)
  assert step_fn(config) is not first  # The rules read while tracing.


def test_run_writes_config_metrics_and_profile(tmp_path, tiny_config, monkeypatch, capsys):
  config = tiny_config(**{"train.steps": 4, "train.log_every": 2, "train.eval_every": 4,
                          "train.eval_steps": 1})
  sent = []  # The fields of every batch that reaches the devices.
  real = data.to_global_batch
  monkeypatch.setattr(data, "to_global_batch",
                      lambda batch, *args: sent.append(set(batch)) or real(batch, *args))
  summary = train(config, str(tmp_path), profile_steps=(2, 3))
  # The trace of steps 2-3, for Perfetto: it holds the train step's kernels.
  said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profile")]
  assert len(said) == 1 and said[0].startswith("profile of steps 2-3: "), said
  traces = list(tmp_path.glob("profile/process_0/plugins/profile/*/perfetto_trace.json.gz"))
  assert len(traces) == 1 and str(traces[0]) in said[0]
  assert b"train_step" in gzip.decompress(traces[0].read_bytes())
  shares = profiling.summarise(str(traces[0]))
  assert set(shares) == {"attention", "matmuls", "collectives", "other", "idle"}
  assert sum(shares.values()) == pytest.approx(1.0) and shares["matmuls"] > 0
  assert said[0].endswith(", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
  # Training gets what it needs; only eval batches carry the retrieval evaluator's field.
  assert sent == [set(data.TRAIN_FIELDS)] * 4 + [{*data.TRAIN_FIELDS, "answer_distance"}]
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["model"]["attention"] == "dense"
  head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
  assert written["provenance"]["commit"] == (head or None)  # None outside a git checkout.
  assert isinstance(written["provenance"]["dirty"], (bool, type(None)))
  assert written["resolved"]["num_devices"] == 8 and written["resolved"]["backend"] == "cpu"
  # Tools that read the run's config (sampling, the needle eval) get the config alone.
  read_back = run_flags.run_config(str(tmp_path))
  assert "resolved" not in read_back and "provenance" not in read_back
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [2, 4]
  for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "tokens_per_sec_per_device",
              "step_time_s", "mfu", "attention"):
    assert key in steps[0], key
  assert steps[0]["mfu"] is None  # No known peak FLOP/s for a CPU.
  assert steps[0]["warmup"] and not steps[1]["warmup"]
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in evals] == [4] and np.isfinite(evals[0]["eval_loss"])
  # Retrieval accuracy overall and by distance to the fact (the synthetic corpus's answers).
  buckets = [key for key in evals[0] if key.startswith("eval_retrieval_accuracy_")]
  assert 0 <= evals[0]["eval_retrieval_accuracy"] <= 1 and len(buckets) >= 2, evals[0]
  assert all(0 <= evals[0][key] <= 1 for key in buckets)
  assert summary["steps"] == 4


def test_profile_steps_are_first_colon_last():
  assert profiling.parse_steps("") is None
  assert profiling.parse_steps("5:7") == (5, 7) and profiling.parse_steps("3") == (3, 3)
  for bad in ("3:x", "0:2", "4:2", "2-3"):
    with pytest.raises(ValueError, match="--profile_steps"):
      profiling.parse_steps(bad)


def test_provenance_redacts_secrets_from_the_command_line(monkeypatch):
  monkeypatch.setenv("MY_SECRET_TOKEN", "planted-secret-value-5678")
  provenance = run_provenance([os.path.join(ROOT, "trainer", "__main__.py"), "--config",
                               "configs/tiny_cpu.py", "--config.wandb.api_key=abc123",
                               "--note=x planted-secret-value-5678 y"])
  assert provenance["command"] == ("python -m trainer --config configs/tiny_cpu.py "
                                   "'--config.wandb.api_key=<redacted>' "
                                   "'--note=x <redacted> y'")


def _imports_of(path: str) -> set[str]:
  """The trainer modules a file imports anywhere in it (a lazy import inside a function too),
  as 'package.module' below trainer/ ('sample' for trainer/sample.py)."""
  names = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return {name.split(".", 1)[1] for name in names if name.startswith("trainer.")}


def test_no_two_trainer_modules_import_each_other():
  folder = os.path.join(ROOT, "trainer")
  graph = {}
  for parent, _, files in os.walk(folder):
    package = os.path.relpath(parent, folder).replace(os.sep, ".")
    for name in files:
      if name.endswith(".py") and name != "__init__.py":
        module = name[:-3] if package == "." else f"{package}.{name[:-3]}"
        graph[module] = _imports_of(os.path.join(parent, name))
  assert "run.loop" in graph and "sample" in graph
  graph = {module: {m for m in imported if m in graph and m != module}
           for module, imported in graph.items()}

  def cycle_from(module, path):
    if module in path:
      return path[path.index(module):] + [module]
    for imported in graph[module]:
      found = cycle_from(imported, path + [module])
      if found:
        return found
    return None

  for module in graph:
    assert cycle_from(module, []) is None, " -> ".join(cycle_from(module, []))


def test_offload_remat_trains_as_full_on_the_cpu_and_says_so_once(tmp_path, tiny_config,
                                                                   capsys):
  losses = {}
  for remat in ("full", "offload"):
    train(tiny_config(**{"train.steps": 3, "train.log_every": 1, "train.remat": remat}),
          str(tmp_path / remat))
    losses[remat] = _losses(tmp_path / remat)
  assert losses["offload"] == losses["full"]  # Naming the block input changes no value.
  assert capsys.readouterr().out.count("train.remat='offload' on the CPU") == 1


def test_a_profile_says_where_the_gpu_time_went(tmp_path):
  """A GPU trace's kernels by kind, nested ops counted once, a side stream's ops in the GPU's
  time (not a stream of its own that is mostly idle), the host's events left out."""
  def op(ts, dur, name, hlo_op, pid=2, tid=7):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": hlo_op}}
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            op(0, 40, "block_fwd", "custom-call.3"), op(40, 30, "nvjet_tst_128x256", "dot.1"),
            op(70, 20, "while", "while.2"), op(72, 10, "ncclDevKernel_AllGather", "all-gather.1"),
            op(95, 5, "loop_add_fusion", "fusion.4"), op(0, 500, "host thing", "x", pid=1),
            op(90, 5, "cudnn_sdpa_fprop", "custom-call.5", tid=9)]
  trace = tmp_path / "perfetto_trace.json.gz"
  trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
  shares = profiling.summarise(str(trace))
  assert shares == pytest.approx({"attention": 0.45, "matmuls": 0.30, "collectives": 0.10,
                                  "other": 0.15, "idle": 0.0})
  # On the CPU a device's ops run on several threads: one that overlaps another without
  # nesting in it counts the shared time once (this trace once gave shares summing to 1.04).
  cpu = [op(0, 10, "while", "while.1", tid=1), op(1, 2, "dot", "dot.1", tid=2),
         op(2, 6, "all-gather", "all-gather.1", tid=3)]
  for event in cpu:
    event["args"]["device_ordinal"] = 0
  trace.write_bytes(gzip.compress(json.dumps({"traceEvents": cpu}).encode()))
  assert profiling.summarise(str(trace)) == pytest.approx(
      {"attention": 0.0, "matmuls": 0.1, "collectives": 0.6, "other": 0.3, "idle": 0.0})
