"""MoA's profile and search (issue 58): the estimator against masking a value, the integer
program against a case with an obvious answer, the command's plan against the trainer's own
config check, and its bad inputs in one line each."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.moa_profile import influence_by_distance, pair_effects
from tests.conftest import tiny_cpu_config
from trainer.tools import moa_search
from trainer.tools.moa_search import Rule

B, S, H, K, D = 2, 6, 4, 2, 8


def _toy():
  """Roped q, k, v of a row of two documents, the pairs each query sees, and the attention
  output of `dropped` (a [B, H, S, S] mask of pairs masked out, the row renormalised)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
             for shape in [(B, S, H, D), (B, S, K, D), (B, S, K, D)])
  segments = jnp.asarray([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1]])
  index = jnp.arange(S)
  visible = (index[:, None] >= index[None, :])[None] & (segments[:, :, None] == segments[:, None])

  def attend(dropped=None, mix=None):
    """The output; with `mix` = (t, dropped) the probabilities (1 - t) A + t A_dropped."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, H // K, 2)) * D ** -0.5
    def probs(drop):
      seen = visible[:, None] & ~drop
      return jnp.where(seen, jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), -1), 0.0)
    none = jnp.zeros((B, H, S, S), bool)
    a = probs(none if dropped is None else dropped)
    if mix is not None:
      a = (1 - mix[0]) * a + mix[0] * probs(mix[1])
    return jnp.einsum("bhqk,bkhd->bqhd", a, jnp.repeat(v, H // K, 2))

  return q, k, v, segments, visible, attend


def test_the_estimator_is_the_loss_change_of_masking_a_value_to_first_order():
  """MoA's effect of (query i, key j) is the loss change of masking that value and
  renormalising the row: exactly for a loss linear in the output (masking is then linear in
  A), and the derivative along that change for any loss; summed per distance, chunked."""
  q, k, v, segments, visible, attend = _toy()
  weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, S, H, D)), jnp.float32)
  # The last: a document's first token, whose only key masked leaves it nothing (-A G).
  pairs = [(0, 0, 2, 0), (0, 3, 5, 4), (1, 1, 4, 1), (1, 2, 5, 5), (0, 1, 3, 3), (0, 2, 3, 3)]
  masked = lambda b, h, i, j: jnp.zeros((B, H, S, S), bool).at[b, h, i, j].set(True)
  linear = lambda out: jnp.sum(out * weights)
  effect = pair_effects(q, k, v, jax.grad(linear)(attend()), visible)
  for pair in pairs:
    np.testing.assert_allclose(linear(attend(masked(*pair))) - linear(attend()),
                               effect[pair], rtol=1e-4, atol=1e-6)
  nonlinear = lambda out: jnp.sum(jnp.tanh(out * weights))
  dout = jax.grad(nonlinear)(attend())
  effect = pair_effects(q, k, v, dout, visible)
  for pair in pairs:
    along = jax.jvp(lambda t, pair=pair: nonlinear(attend(mix=(t, masked(*pair)))), (0.0,),
                    (1.0,))[1]
    np.testing.assert_allclose(effect[pair], along, rtol=1e-4, atol=1e-6)
  assert not np.asarray(effect)[~np.broadcast_to(visible[:, None], effect.shape)].any()
  by_distance = np.zeros((H, S))
  for i in range(S):
    for j in range(i + 1):
      by_distance[:, i - j] += np.abs(np.asarray(effect))[:, :, i, j].sum(0)
  for chunk in (2, 3, 6):
    index = jnp.broadcast_to(jnp.arange(S), (B, S))
    np.testing.assert_allclose(influence_by_distance(q, k, v, dout, segments, index, chunk),
                               by_distance, rtol=1e-5, atol=1e-7)
  # Any order of the row (a ring layout's), told by each token's original index: the same.
  order = jnp.asarray([3, 0, 5, 1, 4, 2])
  permuted = lambda x: x[:, order]
  np.testing.assert_allclose(influence_by_distance(
      *map(permuted, (q, k, v, dout, segments, jnp.broadcast_to(jnp.arange(S), (B, S)))), 3),
      by_distance, rtol=1e-5, atol=1e-7)


def test_the_integer_program_keeps_the_budget_and_the_head_that_looks_far():
  """Two layers of two heads at two lengths: one head's influence lies far back, the
  others' on the last 4 keys; at a budget for one causal head (density 0.42 at 32), that
  head is kept whole and the others take the 4-key window, the cheapest rule losing nothing."""
  lengths = (32, 64)
  rules = moa_search.candidates([4, 8], [0.0, 0.25], lengths)
  assert Rule(0.0, 1.0) in rules and len(rules) == 5  # Causal added once.
  profiles = {}
  for n in lengths:
    influence = np.zeros((2, 2, n))
    influence[..., :4] = 1.0
    influence[1, 0, n // 2:] = 1.0  # Layer 1 head 0 reads the first half of the row.
    profiles[n] = influence
  choice = moa_search.choose(profiles, rules, budget=0.45)
  assert choice.rules == [[Rule(4, 0.0)] * 2, [Rule(0.0, 1.0), Rule(4, 0.0)]]
  assert all(d <= 0.45 for d in choice.density.values()) and choice.lost == {32: 0.0, 64: 0.0}
  narrow = moa_search.choose(profiles, rules, budget=0.3)  # No head can be whole now.
  assert all(d <= 0.3 for d in narrow.density.values())
  assert all(x > 0 for x in narrow.lost.values())
  with pytest.raises(ValueError, match="no plan of these candidate rules meets the density"):
    moa_search.choose(profiles, rules, budget=0.1)
  assert json.loads(json.dumps(moa_search.plan_json(choice))) == {
      "alpha": [[4, 4], [0.0, 4]], "beta": [[0.0, 0.0], [1.0, 0.0]]}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, shared_data_dir):
  """A tiny dense run of 2 steps with its checkpoint (the step other tests compile too)."""
  from trainer.run.loop import train  # pylint: disable=g-import-not-at-top
  config = tiny_cpu_config(shared_data_dir)
  config.train.steps = config.checkpoint.every_steps = 2
  workdir = str(tmp_path_factory.mktemp("moa_run"))
  train(config, workdir)
  return workdir


@pytest.mark.slow(35)
def test_the_command_writes_a_plan_the_trainer_accepts(trained_run, tmp_path):
  """The search over a checkpoint writes a plan that the trainer's config check takes, at
  the budget at every profiled length, with a record of what it came from; the profile's
  forward is the model's (same loss)."""
  from model import Decoder  # pylint: disable=g-import-not-at-top
  from model.moa_profile import all_global, profile_batch  # pylint: disable=g-import-not-at-top
  from trainer.config.config_check import check_config  # pylint: disable=g-import-not-at-top
  from trainer.tools import moa_calibrate, run_flags  # pylint: disable=g-import-not-at-top
  config = run_flags.run_config(trained_run)
  request = moa_search.Request(0.25, (128, 256), rows=4, rules=tuple(moa_search.candidates(
      [8, 16, 32], [0.0, 0.125], [128, 256])), chunk=64)
  out, lines = str(tmp_path / "plan.json"), []
  sampler, origin = moa_calibrate.load_run(trained_run, config, None, lines.append)
  record = moa_calibrate.search(sampler, origin, request, out, lines.append)
  assert [line.split(":")[0] for line in lines if line.startswith("profile")] == [
      "profile at 128", "profile at 256"] and lines[-1].startswith(f"wrote {out} (step 2")
  assert record["checkpoint_step"] == 2 and record["lengths"] == [128, 256]
  assert record["density_budget"] == 0.25 and record["calibration"]["rows"] == 4
  assert record["calibration"]["loss_on"] == "answers"  # The synthetic corpus marks them.
  assert all(d <= 0.25 for d in record["density"].values())
  assert os.path.isfile(f"{out}.record.json") and os.path.isfile(f"{out}.profile.npz")
  config.model.head_spans = out
  check_config(config, jax.device_count())  # The trainer's own check of the plan.

  batch = next(moa_calibrate._batches(sampler, 128, request))  # pylint: disable=protected-access
  cfg = all_global(sampler.model_cfg)
  with jax.set_mesh(sampler.mesh), nn.logical_axis_rules(sampler.rules):
    loss, influence = jax.jit(lambda p, b: profile_batch(cfg, p, b, 64))(sampler.params, batch)
    losses = Decoder(cfg).apply({"params": sampler.params}, batch["tokens"], batch["positions"],
                                batch["segment_ids"], batch["targets"])["loss"]
  mask = batch["loss_mask"]
  np.testing.assert_allclose(loss, jnp.sum(losses * mask) / jnp.sum(mask), rtol=1e-5)
  assert influence.shape == (2, 4, 128) and np.isfinite(influence).all()


def _cli(*args):
  return subprocess.Popen([sys.executable, "-m", "trainer.tools.moa_plan", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_bad_input_stops_in_one_line_naming_the_flag(trained_run, tmp_path):
  """Density outside (0, 1], a length the run's mesh cannot split, an empty grid, a run
  without a checkpoint: each one line, naming the flag, before any profiling."""
  bare = tmp_path / "bare"
  bare.mkdir()
  (bare / "config.json").write_text(open(f"{trained_run}/config.json").read())
  run = f"--workdir={trained_run}"
  cases = {
      (run, "--density=0", "--lengths=128"): "error: --density=0.0 must be in (0, 1]",
      (run, "--density=1.5", "--lengths=128"): "error: --density=1.5 must be in (0, 1]",
      (run, "--density=0.25", "--lengths=130"): "error: --lengths: 130 cannot be profiled",
      (run, "--density=0.25", "--lengths=128", "--alphas=0", "--betas=0"):
          "error: --alphas=0 --betas=0: the candidate grid is empty",
      (f"--workdir={bare}", "--density=0.25", "--lengths=128"):
          f"error: --workdir={bare} has no checkpoints/ directory",
  }
  started = {args: _cli(*args) for args in cases}  # At once: most of each is imports.
  for args, start in cases.items():
    stdout, stderr = started[args].communicate(timeout=120)
    assert started[args].returncode == 1 and not stdout, (args, stderr)
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith(start), (args, stderr)
