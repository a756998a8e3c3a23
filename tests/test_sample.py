"""Sampling (trainer/tools/sampling.py): a ring prefill plus decoding over a KV cache sharded along
the ring gives, token for token, the greedy tokens of the dense model recomputing the whole
row at every step; bad input stops in one line."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_cpu_config
import flax.linen as nn

import data
import parallelism
from model import Decoder
from trainer.core.training import data_config, model_config
from trainer.tools import needle, run_flags, sampling

NEW_TOKENS = 8
REFERENCE_LENGTH = 128  # Every reference forward pads to this: one compile for all steps.


def _float32(config):
  config.model.dtype = "float32"  # Greedy ties must not hinge on bf16 rounding.
  return config


def _random_params(config):
  model = Decoder(dataclasses.replace(model_config(config), attention="dense"))
  tokens_BS = jnp.zeros((1, 16), jnp.int32)
  positions_BS = jnp.arange(16)[None]
  boxed = jax.jit(model.init)(jax.random.key(1), tokens_BS, positions_BS,  # not op by op
                              jnp.ones_like(tokens_BS))["params"]
  return nn.meta.unbox(boxed)


_DENSE_FORWARDS = {}


def _dense_forward(config):
  """Logits of a row padded to REFERENCE_LENGTH, dense attention, jitted once per model."""
  model_cfg = dataclasses.replace(model_config(config), attention="dense", remat="none")
  if repr(model_cfg) not in _DENSE_FORWARDS:
    model = Decoder(model_cfg)
    positions_BS = jnp.arange(REFERENCE_LENGTH)[None]
    _DENSE_FORWARDS[repr(model_cfg)] = jax.jit(lambda params, tokens_BS: model.apply(
        {"params": params}, tokens_BS, positions_BS, jnp.ones_like(tokens_BS)))
  return _DENSE_FORWARDS[repr(model_cfg)]


def _dense_greedy(config, params, prompt, count, tokenizer):
  """The reference: the whole row through dense attention at every step, no cache; the
  argmax over the ids the tokenizer has, as the sampler chooses."""
  forward = _dense_forward(config)
  ids = list(prompt)
  for _ in range(count):
    tokens = np.zeros((1, REFERENCE_LENGTH), np.int32)
    tokens[0, :len(ids)] = ids
    token = int(jnp.argmax(forward(params, tokens)[0, len(ids) - 1, :tokenizer.vocab_size]))
    if token == tokenizer.eos_id:
      break
    ids.append(token)
  return ids[len(prompt):]


@pytest.fixture
def tokenizer(tiny_config):
  config = tiny_config()
  data.prepare(data_config(config))
  return data.Tokenizer(data.tokenizer_path(data_config(config)))


# Two cases hold every path of the plain striped ring (it was a third case): the zigzag one
# prefills by the ring strategy and decodes its global layer over a cache on 4 sequence
# devices, the hybrid one permutes striped and decodes with no window anywhere; the striped
# ring's own permutation on 4 devices is checked against dense attention from a checkpoint
# below.
@pytest.mark.parametrize("attention,prompt_length,strategy,window", [
    ("zigzag", 37, "ring", 8), ("striped", 11, "hybrid", 0)])
def test_sharded_decoding_gives_the_dense_greedy_tokens(tiny_config, tokenizer, attention,
                                                        prompt_length, strategy, window):
  """With a window (local:global layers, 'LG', logits soft-capped), the prefill's ring is
  cut short and each decode step of a local layer sees the 8 positions up to its own."""
  config = _float32(tiny_config(attention, **{"model.sequence_parallel": strategy,
                                              "model.window": window,
                                              "model.layer_pattern": "LG" if window else "",
                                              "model.attention_softcap": 1.5 * bool(window)}))
  if strategy == "hybrid":  # Prefill by Ulysses inside a ring of 2; the cache over both.
    config.mesh.sequence, config.mesh.ulysses = 2, 2
  params = _random_params(config)
  prompt = list(np.random.default_rng(prompt_length).integers(4, 500, prompt_length))
  sampler = sampling.Sampler(config, parallelism.make_mesh(config.mesh), params, tokenizer)
  ours, stats = sampler.generate(prompt, NEW_TOKENS)
  assert ours == _dense_greedy(config, params, prompt, NEW_TOKENS, tokenizer)
  # The prompt is padded at the end to a multiple of what the layout needs (striped and
  # ring: the 4 shards, or 2 x 2 under hybrid; zigzag: 8), prompt plus new tokens included.
  assert stats["capacity"] % (8 if attention == "zigzag" else 4) == 0
  assert stats["capacity"] >= prompt_length + NEW_TOKENS
  layers, rows, capacity, kv_heads, head_dim = stats["cache_shape"]
  assert capacity == stats["capacity"] and rows == 2  # One row per fsdp shard.
  # Each device holds 1/4 of the cache's positions (and 1/2 of the rows).
  assert stats["cache_shard_shape"] == (layers, rows // 2, capacity // 4, kv_heads, head_dim)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, shared_data_dir):
  """A tiny striped run of 2 steps, trained by the trainer, with its checkpoint."""
  from trainer.run.loop import train
  config = tiny_cpu_config(shared_data_dir, "striped")  # The step other tests compile too.
  config.train.steps = config.checkpoint.every_steps = config.train.eval_every = 2
  config.train.eval_needle_lengths = "64"  # The periodic eval's needle grid, sampled too.
  config.train.eval_needle_depths = "0,1"
  workdir = str(tmp_path_factory.mktemp("sample_run"))
  train(config, workdir, periodic_evals=(needle.periodic_eval,))
  return workdir


def test_the_periodic_eval_scores_needles(trained_run):
  import json
  with open(f"{trained_run}/metrics.jsonl") as f:
    evals = [r for r in map(json.loads, f) if "eval_loss" in r]
  assert len(evals) == 1 and 0 <= evals[0]["eval_needle_accuracy"] <= 1
  assert evals[0]["eval_needle_accuracy_64"] == evals[0]["eval_needle_accuracy"]



def test_a_needle_eval_that_cannot_run_says_why_once(tiny_config, monkeypatch, capsys):
  """The training loop's needle eval is optional: where it cannot run (here: more than one
  process) it warns once and gives no metrics, and the run goes on."""
  monkeypatch.setattr(needle.jax, "process_count", lambda: 2)
  evaluate = needle.PeriodicEval(tiny_config(**{"train.eval_needle_lengths": "64"}), mesh=None)
  assert evaluate(params=None) == {} and evaluate(params=None) == {}
  warnings = [line for line in capsys.readouterr().out.splitlines() if "needle eval" in line]
  assert len(warnings) == 1 and "off for this run: it samples in one process" in warnings[0]

def test_a_needle_prompt_hides_the_fact_at_its_depth(tokenizer, tiny_config):
  from trainer.config import needle_grid
  config = tiny_config()
  fmt = needle.format_of(config.data.dataset)
  sentences = needle.filler_sentences(data_config(config), tokenizer, fmt, 600)
  filler = " ".join(s for s, _ in sentences)
  assert max(count for _, count in sentences) < 32  # None is cut: the prompts are as they were.
  assert not {w for w in filler.split()} & set(fmt.keys + fmt.values)  # Nothing competes.
  fact, question = "the code of mira is amber .", "what is the code of mira ? it is"
  for depth in (0, 0.5, 1):
    ids = needle.build_prompt(sentences, tokenizer, fact, question, 512, depth)
    text = tokenizer.decode(ids)
    assert 480 <= len(ids) <= 512 and text.endswith(question)
    where = text.index(fact) / (len(text) - len(question))
    assert abs(where - depth) < 0.05, (depth, where)
  # Text without sentence ends is cut at words: the prompt still nearly reaches its length
  # (it took 90 tokens of a 256 one).
  unpunctuated = [(" ".join(s.rstrip(" .?!") for s, _ in sentences), 0)]
  pieces = [(p, len(tokenizer.encode(p))) for p in needle._pieces(
      unpunctuated[0][0], len(tokenizer.encode(unpunctuated[0][0])), 16)]
  assert len(pieces) > 20 and max(count for _, count in pieces) <= 24
  assert len(needle.build_prompt(pieces, tokenizer, fact, question, 256, 0.5)) >= 256 - 24
  assert needle_grid.parse_lengths("128, 1k,4K") == [128, 1024, 4096]
  for bad in ("12", "abc", ""):
    with pytest.raises(needle_grid.NeedleError):
      needle_grid.parse_lengths(bad)
  with pytest.raises(needle_grid.NeedleError):
    needle_grid.parse_depths("0,1.5")
  # A repeated cell counted its needles twice ("0% of 4 needles" for 2 per cell).
  with pytest.raises(needle_grid.NeedleError, match="lengths '64,64' name 64 more than once"):
    needle_grid.parse_lengths("64,64")
  with pytest.raises(needle_grid.NeedleError, match="depths '0,0.5,0' name 0 more than once"):
    needle_grid.parse_depths("0,0.5,0")


def test_a_checkpoint_samples_alike_under_striped_and_dense(trained_run):
  """The CLI's path in-process: the run's config, overridden to dense attention, samples the
  same greedy tokens; a prompt past the trained length is said once and proceeds."""
  logged = []
  striped_config, dense_config = (_float32(run_flags.run_config(trained_run)) for _ in range(2))
  dense_config.model.attention = "dense"
  striped, step = sampling.load(trained_run, striped_config, log=logged.append)
  dense, _ = sampling.load(trained_run, dense_config, log=logged.append)
  assert step == 2 and striped.model_cfg.attention == "striped"
  prompt = sampling.prompt_ids(striped.tokenizer, "the code of mira is amber . " * 25)
  assert len(prompt) + NEW_TOKENS > striped.config.data.seq_len  # Past the trained length.
  ours, _ = striped.generate(prompt, NEW_TOKENS)
  striped.generate(prompt, NEW_TOKENS)
  assert ours == dense.generate(prompt, NEW_TOKENS)[0]
  assert sum("trained sequence length" in line for line in logged) == 2  # Once per sampler.


def _cli(*args, check=False):
  import subprocess
  import sys
  result = subprocess.run([sys.executable, "-m", "trainer.sample", *args],
                          capture_output=True, text=True, timeout=300)
  return result


def test_ctrl_c_stops_sampling_in_one_line(trained_run):
  """Was a KeyboardInterrupt traceback of 40-55 lines; the tools that read have nothing to
  save, so they stop with a line and a shell's Ctrl-C code."""
  import signal
  import subprocess
  import sys
  # The tool gets SIGINT as a terminal's Ctrl-C finds it: a suite started as a background job
  # of a non-interactive shell inherits SIGINT ignored, a disposition that survives exec and
  # that Python keeps (the signal would be lost), while a handler resets to the default.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.sample", f"--workdir={trained_run}",
         "--prompt=the code", "--max_new_tokens=200"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
  finally:
    signal.signal(signal.SIGINT, previous)
  before = []
  for line in process.stderr:  # Up to "reading ...": the tool's work has begun.
    before.append(line)
    if line.startswith("reading "):
      break
  process.send_signal(signal.SIGINT)
  _, err = process.communicate(timeout=120)
  assert before[-1].startswith("reading ") and process.returncode == 130, "".join(before) + err
  assert "stopped by Ctrl-C" in err.splitlines() and "Traceback" not in err, err


def test_the_needle_eval_checks_its_output_folder_before_it_runs(trained_run, tmp_path):
  """A workdir whose needle/ cannot be made stopped with a traceback only after the whole
  eval (hours on a large model), its results lost."""
  import shutil
  import subprocess
  import sys
  workdir = tmp_path / "run"
  shutil.copytree(trained_run, workdir)
  (workdir / "needle").write_text("a file where the folder goes")
  result = subprocess.run([sys.executable, "scripts/eval_needle.py", f"--workdir={workdir}",
                           "--lengths=64"], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      f"error: cannot create {workdir}/needle: File exists"], result.stderr
  assert "needles in" not in result.stdout  # Stopped before the eval.


def test_help_lists_the_flags_without_a_run():
  result = _cli("--help")
  assert "--prompt" in result.stdout and "--workdir" in result.stdout, result.stderr


def test_the_command_line_prints_json_and_stops_bad_input_in_one_line(trained_run, tmp_path):
  import json
  import os
  result = _cli(f"--workdir={trained_run}", "--prompt=the code of mira is", "--json",
                "--max_new_tokens=3")
  assert result.returncode == 0, result.stderr
  printed = json.loads(result.stdout)
  sampler, _ = sampling.load(trained_run, run_flags.run_config(trained_run))
  assert printed["prompt_ids"] == sampling.prompt_ids(sampler.tokenizer, "the code of mira is")
  assert printed["generated_ids"] == sampler.generate(printed["prompt_ids"], 3)[0]
  assert printed["text"] == sampler.tokenizer.decode(printed["generated_ids"])

  for args, message in [
      ((f"--workdir={trained_run}", "--prompt=  "), "error: the prompt is empty"),
      ((f"--workdir={trained_run}", "--prompt=x", "--step=7"),
       "error: --step=7 is not a checkpoint of"),
      ((f"--workdir={tmp_path}", "--prompt=x"), "holds no run (no config.json)"),
      # Before the checkpoint is read (no "reading ..." line): minutes on a large model.
      ((f"--workdir={trained_run}", "--prompt=x", "--temperature=nan"),
       "error: --temperature=nan must be a finite number")]:
    result = _cli(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and message in lines[0], result.stderr

  # A Hugging Face directory whose model vocabulary (384) is padded past its tokenizer's.
  # Its RoPE may be set on the command line (to sample past its trained length); its shape
  # may not. Both were dropped without a word.
  fixture = os.path.join(os.path.dirname(__file__), "hf_fixtures", "llama3_rope")
  result = _cli(f"--from_hf={fixture}", "--prompt=hello world", "--json", "--max_new_tokens=3",
                "--ignore_eos", "--config.model.rope_theta=100")
  assert result.returncode == 0, result.stderr
  printed = json.loads(result.stdout)
  assert len(printed["generated_ids"]) == 3 and max(printed["generated_ids"]) < 320
  assert "RoPE theta 100 llama3 x8 (set on the command line; the checkpoint's: " \
      "rope_theta=500000.0)" in result.stderr, result.stderr
  result = _cli(f"--from_hf={fixture}", "--prompt=x", "--config.model.d_model=32")
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      f"error: --config.model.d_model=32, but init.from_hf={fixture} has 64: the checkpoint "
      f"sets the model's shape (only its RoPE and local attention may be overridden); drop "
      f"the override"]

  (tmp_path / "config.json").write_text(open(f"{trained_run}/config.json").read())
  with pytest.raises(sampling.SampleError, match="has no checkpoints/ directory"):
    sampling.load(str(tmp_path), run_flags.run_config(str(tmp_path)))


def test_a_hugging_face_checkpoint_samples_what_transformers_predicts():
  """`--from_hf`: greedy first tokens under striped attention and the sharded cache are the
  argmax of the logits `transformers` recorded for the same prefix (tests/hf_fixtures)."""
  import os
  from safetensors.numpy import load_file
  from trainer.ckpt import hf_import
  directory = os.path.join(os.path.dirname(__file__), "hf_fixtures", "llama3_rope")
  config = run_flags.hf_config(directory)
  config.model.attention, config.model.dtype = "striped", "float32"
  config.mesh.update(fsdp=2, sequence=4)
  hf_import.apply_to_config(config)
  sampler = sampling.from_hf(config, log=lambda line: None)
  recorded = load_file(os.path.join(directory, "expected.safetensors"))
  ids = [int(i) for i in recorded["input_ids"]]
  for length in (37, 90, 128):  # One capacity, one compile.
    first, _ = sampler.generate(ids[:length], 1, capacity=132, ignore_eos=True)
    assert first == [int(np.argmax(recorded["logits"][length - 1]))], length


def test_the_untrained_baseline_of_an_imported_run_is_its_checkpoint():
  """eval_needle's --untrained scores the model step 0 starts from: for a run that starts
  from a Hugging Face checkpoint, that checkpoint (it was random weights from the seed)."""
  import os
  from trainer.ckpt import hf_import
  directory = os.path.join(os.path.dirname(__file__), "hf_fixtures", "llama_gqa_sharded")
  config = run_flags.hf_config(directory)
  hf_import.apply_to_config(config)
  baseline = sampling.untrained(config, log=lambda line: None)
  imported = sampling.from_hf(config, log=lambda line: None)
  same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                      baseline.params, imported.params)
  assert all(jax.tree.leaves(same))


def test_top_p_keeps_the_smallest_set_reaching_its_mass():
  logits_BV = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  draws = lambda top_p: {int(sampling._choose(logits_BV, jax.random.key(seed), temperature=1.0,
                                            top_p=top_p)[0]) for seed in range(60)}
  assert draws(0.4) == {0} and draws(0.7) == {0, 1} and draws(1.0) == {0, 1, 2, 3}
  assert int(sampling._choose(logits_BV, jax.random.key(0), temperature=0.0, top_p=1.0)[0]) == 0
  # A model vocabulary padded past the tokenizer's: the padding ids are never chosen.
  assert draws(1.0) == {0, 1, 2, 3}
  assert {int(sampling._choose(logits_BV, jax.random.key(seed), temperature=1.0, top_p=1.0,
                             vocab=2)[0]) for seed in range(60)} == {0, 1}


def test_bad_sampling_settings_stop_before_any_compile(tiny_config, tokenizer):
  config = tiny_config()
  sampler = sampling.Sampler(config, parallelism.make_mesh(config.mesh), {}, tokenizer)
  for kwargs, named in (({"top_p": 0.0}, "--top_p=0.0"), ({"top_p": 1.5}, "--top_p=1.5"),
                        ({"temperature": -1.0}, "--temperature=-1.0"),
                        ({"temperature": float("inf")}, "--temperature=inf"),
                        ({"temperature": float("nan")}, "--temperature=nan"),
                        ({"max_new_tokens": 0}, "--max_new_tokens=0")):
    with pytest.raises(sampling.SampleError) as error:
      sampler.generate([1, 2, 3], **{"max_new_tokens": 4, "top_p": 0.9, **kwargs})
    assert str(error.value).startswith(named) and str(error.value).count("--") == 1
  with pytest.raises(sampling.SampleError, match="empty"):
    sampler.generate([], 4)
