"""Configs load and validate; bad values stop the run with one line naming the field."""

import importlib
import os
import subprocess
import sys

import jax
import pytest

from trainer.config.config_check import ConfigError, check_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["base", "tiny_cpu", "1b_32k_striped", "7b_256k_striped", "7b_1m_striped"]


def _load(name, arg=None):
  return importlib.import_module(f"configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_loads_and_validates_on_8_devices(name):
  check_config(_load(name), num_devices=8)


@pytest.mark.parametrize("attention", ["dense", "ring", "striped", "zigzag"])
def test_tiny_config_variants_validate(attention):
  config = _load("tiny_cpu", attention)
  assert config.model.attention == attention
  check_config(config, num_devices=jax.device_count())


def test_paper_models_have_the_paper_shapes():
  one_b, seven_b = _load("1b_32k_striped").model, _load("7b_256k_striped").model
  assert (one_b.d_model, one_b.d_ff, one_b.num_layers, one_b.num_heads) == (2048, 5504, 22, 16)
  assert (seven_b.d_model, seven_b.d_ff, seven_b.num_layers, seven_b.num_heads) == (
      4096, 11008, 32, 32)
  assert one_b.vocab_size == seven_b.vocab_size == 32000
  # One file per model, the layout its argument (striped by default).
  for name in ("1b_32k_striped", "7b_256k_striped", "7b_1m_striped"):
    assert _load(name).model.attention == "striped"
    assert _load(name, "ring").model.attention == "ring"
  assert _load("7b_256k_striped", "ring").data.seq_len == 262144


@pytest.mark.parametrize("overrides, field", [
    ({"model.num_kv_heads": 3}, "model.num_kv_heads"),
    ({"train.batch_size": 7}, "train.batch_size"),
    ({"mesh.fsdp": 3}, "mesh"),
    ({"mesh.sequence": -1, "mesh.fsdp": -1}, "mesh"),
    ({"model.attention": "sparse"}, "model.attention"),
    ({"model.dtype": "int8"}, "model.dtype"),
    ({"data.seq_len": 250}, "data.seq_len"),
    ({"model.attention": "zigzag", "data.seq_len": 260}, "data.seq_len"),
    ({"model.num_heads": 6, "model.num_kv_heads": 6}, "model.d_model"),
    ({"train.remat": "some"}, "train.remat"),
    ({"train.warmup_steps": 1000}, "train.warmup_steps"),
    ({"wandb.mode": "maybe"}, "wandb.mode"),
    ({"model.sequence_parallel": "fast"}, "model.sequence_parallel"),
    # Sequence-parallel (striped): a Ulysses axis with a strategy that has none; Ulysses
    # beside a ring; heads that do not split; a sequence that does not split over
    # sequence x ulysses.
    ({"model.attention": "striped", "mesh.fsdp": 1, "mesh.ulysses": 2}, "mesh.ulysses=2"),
    ({"model.attention": "striped", "model.sequence_parallel": "ulysses", "mesh.fsdp": 1,
      "mesh.ulysses": 2}, "mesh.sequence=4"),
    ({"model.attention": "striped", "model.sequence_parallel": "hybrid", "mesh.fsdp": 1,
      "mesh.sequence": 1, "mesh.ulysses": 8}, "model.num_heads=4"),
    ({"model.attention": "striped", "model.sequence_parallel": "hybrid", "mesh.fsdp": 1,
      "mesh.sequence": 2, "mesh.ulysses": 4, "data.seq_len": 36, "model.attention_tile": 2},
     "data.seq_len=36"),
    # Ranges, each refused before anything runs, with the allowed range in the line.
    ({"train.b1": 1.0}, "train.b1=1.0 must be in [0, 1)"),
    ({"train.b2": 1.5}, "train.b2=1.5 must be in [0, 1)"),
    ({"train.b2": -0.1}, "train.b2=-0.1 must be in [0, 1)"),
    ({"train.weight_decay": -0.1}, "train.weight_decay=-0.1 must be >= 0"),
    ({"train.eval_steps": 0}, "train.eval_steps=0 must be >= 1"),
    ({"train.eval_every": -1}, "train.eval_every=-1 must be >= 0"),
    ({"model.head_dim": -8}, "model.head_dim=-8 must be >= 0"),
    ({"model.rope_theta": 0.0}, "model.rope_theta=0.0 must be positive"),
    ({"model.norm_eps": 0.0}, "model.norm_eps=0.0 must be positive"),
    ({"model.init_std": -0.02}, "model.init_std=-0.02 must be positive"),
    ({"data.num_documents": 0}, "data.num_documents=0 must be >= 1"),
    ({"data.num_eval_documents": 0}, "data.num_eval_documents=0 must be >= 1"),
    ({"data.max_document_tokens": 0}, "data.max_document_tokens=0 must be >= 1"),
    ({"data.corpus_seed": -1}, "data.corpus_seed=-1 must be >= 0"),
    ({"data.tokenizer_vocab_size": 100}, "data.tokenizer_vocab_size=100 must exceed 260"),
    ({"data.prefetch": -1}, "data.prefetch=-1 must be >= 0"),
    ({"cpu_devices": -1}, "cpu_devices=-1 must be >= 0"),
    # NaN passes `x < 0` and infinity `x > 0`: every float field is refused first.
    ({"model.attention_softcap": float("nan")}, "model.attention_softcap=nan must be a finite"),
    ({"model.local_rope_theta": float("inf")}, "model.local_rope_theta=inf must be a finite"),
    ({"model.rope_scaling.factor": float("nan")}, "model.rope_scaling.factor=nan must be a"),
    ({"train.lr": float("inf")}, "train.lr=inf must be a finite number"),
    ({"train.grad_clip": -float("inf")}, "train.grad_clip=-inf must be a finite number"),
    ({"peak_flops_per_device": float("nan")}, "peak_flops_per_device=nan must be a finite"),
])
def test_impossible_values_name_the_field(overrides, field):
  config = _load("tiny_cpu")
  for path, value in overrides.items():
    *groups, key = path.split(".")
    group = config
    for name in groups:
      group = group[name]
    group[key] = value
  with pytest.raises(ConfigError) as error:
    check_config(config, num_devices=8)
  message = str(error.value)
  assert field in message and "\n" not in message


def test_a_span_plan_alone_makes_its_layers_local(tmp_path):
  """`model.head_spans` decides the local layers: no `model.window` or pattern with it (the
  check asked for a window and stopped every run with a plan)."""
  import json
  plan = tmp_path / "spans.json"
  plan.write_text(json.dumps({"alpha": [[16, 48, 32, 256], [256] * 4],
                              "beta": [[0, 0, 0.0625, 0], [0] * 4]}))
  config = _load("tiny_cpu", "zigzag")
  config.model.head_spans = str(plan)
  check_config(config, num_devices=8)
  config.model.window = 32
  with pytest.raises(ConfigError, match="leave model.window at 0"):
    check_config(config, num_devices=8)


def test_evals_off_need_no_eval_steps():
  """train.eval_steps counts only when evals run; the synthetic corpus's validation split is
  built at preparation whether or not evals run, so data.num_eval_documents counts always."""
  config = _load("tiny_cpu")
  config.train.eval_every, config.train.eval_steps = 0, 0
  check_config(config, num_devices=8)


def _run_cli(tmp_path, *overrides):
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py",
       f"--workdir={workdir}", *overrides],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  return result, workdir


@pytest.mark.parametrize("override, expected", [
    ("--config.train.stepz=3", "'stepz'"),
    ("--config.train.steps=many", "config.train.steps"),
    ("--config.model.num_kv_heads=3", "model.num_kv_heads"),
    ("--config.data.cross_document_attention=yes", "=yes: must be true or false"),
    ("--config.cpu_devices=4", "but there are 4 devices; mesh.fsdp=1 or mesh.sequence=2 would "
     "fit; or config.cpu_devices=8 simulates that many CPU devices"),
])
def test_cli_reports_bad_overrides_in_one_line(tmp_path, override, expected):
  result, workdir = _run_cli(tmp_path, override)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  last_line = result.stderr.strip().splitlines()[-1]
  assert last_line.startswith("error:") and expected in last_line
  assert not workdir.exists()  # Stopped before any work: nothing written, nothing allocated.


@pytest.mark.parametrize("body, expected", [
    ("def get_config(arg=None):\n  raise ValueError('no such size')\n",
     ", line 2: ValueError: no such size"),
    ("import no_such_module\n", ", line 1: ModuleNotFoundError: No module named 'no_such_module'"),
    ("def get_config(arg=None):\n  return {}['model']\n", ", line 2: KeyError: 'model'"),
    ("def get_config(arg=None):\n  return open('/no/such/file').read()\n",
     ", line 2: FileNotFoundError: [Errno 2] No such file or directory: '/no/such/file'"),
    ("SIZE = 1 / 0\n", ", line 1: ZeroDivisionError: division by zero"),
    ("def get_config(:\n", ", line 1: invalid syntax"),
    ("import ml_collections\n", " defines no get_config(arg=None)"),
    ("def get_config(arg=None):\n  pass\n", ": get_config returned NoneType, not an "
     "ml_collections.ConfigDict (a missing return?)"),
])
def test_a_config_file_that_fails_is_one_line_naming_file_and_line(tmp_path, body, expected):
  """Before absl parses the flags: ml_collections said 'Error whilst parsing config file' and
  a traceback, let import errors through whole, and called a KeyError an unknown field."""
  from trainer.config import cli
  path = tmp_path / "broken.py"
  path.write_text(body)
  with pytest.raises(SystemExit) as stopped:
    cli.parse_flags(["trainer", f"--config={path}", "--config.train.steps=3"])
  message = str(stopped.value.code)
  assert "\n" not in message and message.startswith("error: ") and message.endswith(expected)
  assert str(path) in message


@pytest.mark.parametrize("rule", [("activation_seq", "fsdp"), ("activation_kv_heads", None),
                                  ("activation_seq", ("sequence", "tensor"))])
def test_rules_the_ring_cannot_use_are_refused(rule):
  """The ring runs on the axis the data layout was permuted for, with each device's query
  heads next to their kv heads; rules that break either stop the run in one line."""
  config = _load("tiny_cpu")
  config.model.attention = "striped"
  config.mesh.rules = tuple(rule if name == rule[0] else (name, target)
                            for name, target in config.mesh.rules)
  with pytest.raises(ConfigError, match=rf"mesh.rules maps .*{rule[0]}") as error:
    check_config(config, num_devices=8)
  assert "\n" not in str(error.value)


def test_ulysses_says_when_it_repeats_kv_heads(capsys):
  """GQA with fewer K/V heads than the Ulysses degree is exact, but costs memory and bytes:
  start-up says so (tiny_cpu has 2 K/V heads for 4 query heads)."""
  from trainer.config import config_check
  config_check._SAID.clear()  # pylint: disable=protected-access  (once per process)
  config = _load("tiny_cpu")
  config.model.attention, config.model.sequence_parallel = "striped", "ulysses"
  config.mesh.fsdp, config.mesh.sequence, config.mesh.ulysses = 2, 1, 4
  check_config(config, num_devices=8)
  assert "Ulysses repeats each 2 times" in capsys.readouterr().out
  config.mesh.fsdp, config.mesh.ulysses = 4, 2
  check_config(config, num_devices=8)
  assert capsys.readouterr().out == ""


def test_config_files_import_no_trainer_and_no_jax():
  """Configs are data: every configs/*.py loads with ml_collections and other configs only."""
  import glob
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(root, "configs", "*.py"))
                 if not p.endswith("__init__.py"))
  code = ("import importlib, sys\n"
          f"for name in {names!r}:\n"
          "  module = importlib.import_module('configs.' + name)\n"
          "  if hasattr(module, 'get_config'):  # configs.stages is a helper of configs\n"
          "    module.get_config()\n"
          "print(sorted(m for m in ('jax', 'optax', 'flax', 'trainer', 'model', 'data',\n"
          "                         'parallelism') if m in sys.modules))\n")
  done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == "[]", done.stdout


def test_a_layouts_old_config_file_names_its_new_place():
  done = subprocess.run([sys.executable, "-m", "trainer", "--config", "configs/7b_256k_ring.py"],
                        cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1] == (
      "error: config file configs/7b_256k_ring.py does not exist (--config); the layout is "
      "the model config's argument now: --config configs/7b_256k_striped.py:ring")
