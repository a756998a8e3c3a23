"""Hugging Face LLaMA checkpoints: imported weights compute the logits `transformers` recorded
(tests/hf_fixtures, made by scripts/make_hf_fixture.py), and a bad checkpoint stops in one line."""

import json
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import parallelism
from configs import base
from model import Decoder
from model.hf_format import HFFormatError
from trainer.ckpt import hf_import
from trainer.core.optimizer import make_optimizer
from trainer.core.state import abstract_state
from trainer.core.training import model_config
from trainer.run.loop import train
from trainer.tools import hf_export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(ROOT, "tests", "hf_fixtures")
FIXTURES = sorted(name for name in os.listdir(FIXTURE_DIR)
                  if os.path.isdir(os.path.join(FIXTURE_DIR, name)))
MESHES = {"dense": dict(fsdp=8, sequence=1), "striped": dict(fsdp=1, sequence=8)}


def imported_config(directory: str, attention: str = "dense"):
  config = base.get_config()
  config.init.from_hf = directory
  config.model.attention = attention
  config.model.attention_tile = 8
  config.model.dtype = "float32"
  for axis, size in MESHES[attention].items():
    config.mesh[axis] = size
  summary = hf_import.apply_to_config(config)
  return config, summary


def imported_logits(directory: str, attention: str) -> tuple[np.ndarray, np.ndarray]:
  """(our logits, the recorded ones) for the fixture's recorded input."""
  config, _ = imported_config(directory, attention)
  expected = load_file(os.path.join(directory, "expected.safetensors"))
  tokens = expected["input_ids"][None]
  seq_len = tokens.shape[1]
  mesh = parallelism.make_mesh(config.mesh)
  cfg = model_config(config)
  model = Decoder(cfg)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    state = abstract_state(model, make_optimizer(config.train), mesh, config.mesh.rules)
    params = hf_import.load_params(directory, cfg, state.params, log=lambda line: None)
    index = np.arange(seq_len, dtype=np.int32)[None]
    shards = mesh.shape["sequence"]
    inputs = [parallelism.permute(x, cfg.layout, shards)
              for x in (tokens.astype(np.int32), index, np.ones_like(index))]
    logits = jax.jit(model.apply)({"params": params}, *map(jnp.asarray, inputs))
  return parallelism.unpermute(np.asarray(logits), cfg.layout, shards)[0], expected["logits"]


# Every checkpoint under dense attention; under striped (the sequence over 8 devices) the
# two whose attention differs there: llama3_rope (GQA 4:1, RoPE of permuted positions) and
# mistral_window (a window in the ring). The others differ in what the import reads (tied
# or sharded weights, another RoPE rule), which the layout does not touch.
STRIPED = ("llama3_rope", "mistral_window")


@pytest.mark.parametrize("fixture, attention", [
    *((fixture, "dense") for fixture in FIXTURES), *((f, "striped") for f in STRIPED)])
def test_imported_weights_give_the_recorded_logits(fixture, attention):
  ours, recorded = imported_logits(os.path.join(FIXTURE_DIR, fixture), attention)
  relative = np.max(np.abs(ours - recorded)) / np.max(np.abs(recorded))
  assert relative < 1e-4, f"{fixture} {attention}: max relative logit error {relative:.2e}"


def test_the_config_comes_from_the_checkpoint():
  config, summary = imported_config(os.path.join(FIXTURE_DIR, "llama3_rope"))
  m = config.model
  assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.d_ff,
          m.vocab_size) == (2, 64, 4, 1, 32, 160, 384)
  assert m.rope_theta == 500000.0 and m.rope_scaling.type == "llama3"
  assert m.rope_scaling.original_max_len == 32 and m.rope_scaling.factor == 8.0
  assert config.data.tokenizer.endswith("llama3_rope/tokenizer.model")
  assert "llama3 x8" in summary


def _copy(fixture: str, tmp_path) -> str:
  directory = str(tmp_path / fixture)
  shutil.copytree(os.path.join(FIXTURE_DIR, fixture), directory)
  return directory


def _edit_config(directory: str, **changes) -> None:
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    hf_config = json.load(f)
  hf_config.update(changes)
  with open(path, "w") as f:
    json.dump(hf_config, f)


def _rewrite_tensors(directory: str, edit) -> None:
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    (lambda d: _edit_config(d, model_type="gpt2"), "model_type='gpt2' is not a LLaMA-family"),
    (lambda d: _edit_config(d, attention_bias=True), "attention_bias=true"),
    (lambda d: _edit_config(d, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     "rope type 'longrope' is not supported"),
    (lambda d: _edit_config(d, intermediate_size=128),
     "tensor model.layers.0.mlp.gate_proj.weight has shape (160, 64), but config.json implies "
     "(128, 64)"),
    (lambda d: _rewrite_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")),
     "tensor model.layers.1.self_attn.k_proj.weight is missing"),
    (lambda d: os.remove(os.path.join(d, "tokenizer.model")), "has no tokenizer.model"),
    (lambda d: os.remove(os.path.join(d, "model.safetensors")),
     "holds neither model.safetensors nor model.safetensors.index.json"),
    (lambda d: open(os.path.join(d, "model.safetensors"), "r+b").truncate(5),  # Was a traceback.
     "model.safetensors: cannot read ("),
    (lambda d: _edit_config(d, num_hidden_layers=1),  # Layer 1 was dropped without a word.
     "config.json has num_hidden_layers=1, but the checkpoint holds tensors of layer 1"),
    (lambda d: _edit_config(d, vocab_size=300),  # Sampling clamped ids past the embedding.
     "tokenizer.model has 320 pieces, more than init.from_hf="),
    (lambda d: open(os.path.join(d, "tokenizer.model"), "wb").write(b"junk"),
     "tokenizer.model cannot be read as a SentencePiece model"),
], ids=["not_llama", "bias", "rope_type", "shape", "missing_tensor", "no_tokenizer",
        "no_weights", "truncated_single_file", "more_layers_than_config", "tokenizer_too_big",
        "tokenizer_not_sentencepiece"])
def test_a_bad_checkpoint_stops_in_one_line_naming_it(tmp_path, damage, message):
  directory = _copy("llama_tied_linear", tmp_path)
  damage(directory)
  with pytest.raises(HFFormatError, match="^[^\n]*$") as error:
    imported_config(directory)
  assert message in str(error.value)


def test_command_line_rope_survives_the_import_and_a_shape_that_differs_stops():
  """Overrides (ml_collections' flat names) of RoPE are kept: they extend the context; one of
  the shape would be dropped, so it stops. The config file's own model fields are replaced."""
  directory = os.path.join(FIXTURE_DIR, "llama_gqa_sharded")
  config = base.get_config()
  config.init.from_hf = directory
  config.model.num_layers = 7  # The config file's: the checkpoint's wins.
  config.model.rope_theta, config.model.rope_scaling.type = 5e5, "yarn"
  config.model.rope_scaling.factor, config.model.rope_scaling.original_max_len = 2.0, 128
  summary = hf_import.apply_to_config(config, {
      "model.rope_theta": 5e5, "model.rope_scaling.type": "yarn",
      "model.rope_scaling.factor": 2.0, "model.rope_scaling.original_max_len": 128,
      "model.num_kv_heads": 2})  # The checkpoint's value: no conflict.
  assert config.model.num_layers == 2 and config.model.rope_theta == 5e5
  assert config.model.rope_scaling.type == "yarn" and config.model.rope_scaling.factor == 2.0
  assert "(set on the command line; the checkpoint's: rope_theta=10000.0, " in summary
  with pytest.raises(HFFormatError, match="^--config.model.num_kv_heads=4, but .* has 2: "):
    hf_import.apply_to_config(config, {"model.num_kv_heads": 4})
  # Training past the checkpoint's length with its RoPE as it was is said, not refused.
  plain = base.get_config()
  plain.init.from_hf, plain.data.seq_len = directory, 256
  assert hf_import.apply_to_config(plain).splitlines()[1] == (
      "note: data.seq_len=256 is past the checkpoint's max_position_embeddings (128) with its "
      "RoPE unscaled; set model.rope_scaling.* on the command line to extend its context")


def test_a_run_starts_from_the_checkpoint_and_exports_it_back_tensor_for_tensor(
    tmp_path, tiny_config):
  """Step 1 at learning rate 0 (the warmup's first) keeps the imported weights: the exported
  files equal the checkpoint's, name for name and bit for bit, in bf16 shards."""
  source = os.path.join(FIXTURE_DIR, "llama_tied_linear")
  config = tiny_config(**{"init.from_hf": source, "train.steps": 1, "train.warmup_steps": 1})
  hf_import.apply_to_config(config)
  workdir, out = str(tmp_path / "run"), str(tmp_path / "exported")
  summary = train(config, workdir)
  assert summary["steps"] == 1 and np.isfinite(summary["last_loss"])
  lines = []
  hf_export.export(workdir, out, dtype="bfloat16", max_shard_bytes=100_000, log=lines.append)
  original = load_file(os.path.join(source, "model.safetensors"))
  written = {}
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    files = set(json.load(f)["weight_map"].values())
  assert len(files) > 1 and sum(line.startswith("  wrote") for line in lines) == len(files)
  for file in files:
    written.update(load_file(os.path.join(out, file)))
    # Readable by whoever may read config.json beside it (safetensors itself writes 0600).
    assert os.stat(os.path.join(out, file)).st_mode & 0o777 == os.stat(
        os.path.join(out, "config.json")).st_mode & 0o777
  assert written.keys() == original.keys()  # Tied: no lm_head.weight in either.
  for name, tensor in original.items():
    assert written[name].dtype == tensor.dtype and np.array_equal(written[name], tensor), name
  with open(os.path.join(out, "config.json")) as f:
    hf_config = json.load(f)
  with open(os.path.join(source, "config.json")) as f:
    source_config = json.load(f)
  for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_parameters"):
    assert hf_config[key] == source_config[key], key
  assert hf_config["max_position_embeddings"] == config.data.seq_len

  # Refused in one line before the arrays are read, leaving nothing behind: a tokenizer the
  # vocabulary cannot hold (the tiny corpus's 512 pieces for 384 rows), one that is not a
  # SentencePiece model (both were written, or a traceback), an --out in no folder, no shards.
  import data  # pylint: disable=g-import-not-at-top
  from trainer.core.training import data_config  # pylint: disable=g-import-not-at-top
  garbage = tmp_path / "garbage.model"
  garbage.write_bytes(b"not a model")
  data.prepare(data_config(tiny_config()))
  for kwargs, message in [
      (dict(tokenizer=data.tokenizer_path(data_config(tiny_config()))),
       "has 512 pieces, more than the model's vocabulary (384)"),
      (dict(tokenizer=str(garbage)), "is not a SentencePiece model"),
      (dict(tokenizer=str(tmp_path / "missing.model")), "missing.model does not exist"),
      (dict(out=str(tmp_path / "nowhere" / "out")), "/nowhere does not exist"),
      (dict(max_shard_bytes=0), "--max_shard_gib must be positive")]:
    kwargs.setdefault("out", str(tmp_path / "refused"))
    with pytest.raises(hf_export.ExportError, match="^[^\n]*$") as error:
      hf_export.export(workdir, log=lines.append, **kwargs)
    assert message in str(error.value)
    assert not os.path.exists(kwargs["out"]) and not [
        p for p in os.listdir(tmp_path) if ".partial-" in p]


@pytest.mark.parametrize("signal_name, raised", [("SIGTERM", hf_export.Terminated),
                                                  ("SIGINT", KeyboardInterrupt)])
def test_an_interrupted_export_leaves_no_partial_directory(tmp_path, monkeypatch, signal_name,
                                                           raised):
  """SIGTERM or Ctrl-C while writing removes `<out>.partial-<pid>` (SIGTERM's default action
  left it behind, gigabytes of it; the command line's Ctrl-C, which exits at once while it
  reads, raises while it writes); the next export removes those of processes that are gone
  (SIGKILL), not a live one's."""
  import signal  # pylint: disable=g-import-not-at-top
  signum = getattr(signal, signal_name)
  gone = subprocess.Popen(["true"])
  gone.wait()
  stale, live = tmp_path / f"hf.partial-{gone.pid}", tmp_path / f"hf.partial-{os.getppid()}"
  stale.mkdir()
  live.mkdir()
  (tmp_path / "tokenizer.model").write_bytes(b"pieces")
  monkeypatch.setattr(hf_export, "save_file", lambda *a, **k: os.kill(os.getpid(), signum))

  def outside(signum, frame):  # What the command line runs outside the write (never here).
    raise AssertionError("the handler from before the write ran inside it")

  previous = signal.signal(signum, outside)
  try:
    with pytest.raises(raised):
      hf_export.write_directory(str(tmp_path / "hf"), iter([("w", np.zeros(4, np.float32))]),
                                {"w": "model.safetensors"}, {}, str(tmp_path / "tokenizer.model"))
    assert signal.getsignal(signum) is outside  # Put back as it was.
  finally:
    signal.signal(signum, previous)
  assert [p for p in os.listdir(tmp_path) if ".partial-" in p] == [live.name]
  assert not os.path.exists(tmp_path / "hf")


def test_export_refuses_a_missing_step_in_one_line(tmp_path):
  os.makedirs(tmp_path / "run" / "checkpoints")
  result = subprocess.run(
      [sys.executable, "-m", "trainer.export", f"--workdir={tmp_path / 'run'}",
       f"--out={tmp_path / 'out'}"], capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      f"error: --workdir={tmp_path / 'run'} holds no committed checkpoint"]
  assert not os.path.exists(tmp_path / "out")


def test_a_sliding_window_round_trips_as_mistral_and_a_local_global_pattern_does_not_export():
  """Every layer local is Mistral's config.json (`sliding_window` is our window, the query
  included); read back, it is the same model. Local and global layers have no form there."""
  from model import ModelConfig
  from model.hf_format import export_problem, hf_config_of, model_fields
  shape = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=160,
               vocab_size=384)
  local = ModelConfig(**shape, window=16)
  hf_config = hf_config_of(local, 128, 1, 2, "bfloat16")
  assert (hf_config["model_type"], hf_config["architectures"], hf_config["sliding_window"]) == (
      "mistral", ["MistralForCausalLM"], 16)
  fields = model_fields(hf_config, "config.json")
  assert (fields["window"], fields["layer_pattern"]) == (16, "")
  assert ModelConfig(**{**shape, **fields}).layer_kinds == "LL"
  assert hf_config_of(ModelConfig(**shape), 128, 1, 2, "bfloat16")["model_type"] == "llama"
  mixed = ModelConfig(**shape, window=16, layer_pattern="LG")
  assert "has no LLaMA or Mistral config.json" in export_problem(mixed)
  with pytest.raises(HFFormatError, match="has no LLaMA or Mistral"):
    hf_config_of(mixed, 128, 1, 2, "bfloat16")
  assert "capped attention logits" in export_problem(ModelConfig(**shape, attention_softcap=50.0))
  with pytest.raises(HFFormatError, match="sliding_window=0 must be a positive integer"):
    model_fields({**hf_config, "sliding_window": 0}, "config.json")
