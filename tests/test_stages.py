"""Staged context extension: the plan, the checks, the optimizer hand-over, and a 2-stage run
that is killed inside stage 2 and resumes exactly."""

import importlib
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from conftest import BATCH_SIZE
from trainer.ckpt import resume
from trainer.config import stages
from trainer.config.config_check import ConfigError, check_config
from trainer.core.optimizer import make_optimizer, make_schedule
from trainer.core.state import TrainState, carry_over_stage
from trainer.run.loop import train
from trainer.tools.hf_export import export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extend_config(data_dir, steps=(6, 6)):
  config = importlib.import_module("configs.tiny_extend").get_config()
  config.data.data_dir = data_dir
  config.train.batch_size = BATCH_SIZE  # Each stage's too.
  config.stages[0].train.steps, config.stages[1].train.steps = steps
  config.train.log_every = 1
  config.train.eval_every = 0
  config.checkpoint.every_steps = 4
  config.checkpoint.async_save = False  # A kill after step 8's line finds step 8 committed.
  config.wandb.mode = "disabled"
  # Stages are the same under every attention; dense compiles in a fraction of the time.
  config.model.attention = "dense"
  return config


def test_plan_numbers_steps_on_and_resolves_each_stage(shared_data_dir):
  first, second = stages.resolve(_extend_config(shared_data_dir, steps=(30, 20)))
  assert (first.first_step, first.last_step, second.first_step, second.last_step) == (
      1, 30, 31, 50)
  assert (first.config.data.seq_len, second.config.data.seq_len) == (64, 256)
  # The loop trains up to train.steps; each schedule is the stage's own length.
  assert (first.config.train.steps, second.config.train.steps) == (30, 50)
  assert (first.config.train.schedule_steps, second.config.train.schedule_steps) == (30, 20)
  assert second.config.model.rope_scaling.type == "yarn"
  assert first.config.model.rope_scaling.type == "default"
  assert second.keep_optimizer and not first.keep_optimizer
  assert second.config.stages == () and second.config.model.d_model == 128
  assert stages.holding([first, second], 30) is first
  assert stages.next_to_run([first, second], 30) is second
  assert stages.next_to_run([first, second], 50) is second


@pytest.mark.parametrize("edit, message", [
    (lambda s: s[1].model.update({"d_model": 64}), r"stages\[1\].model.d_model cannot be set"),
    (lambda s: s[1].train.update({"stepz": 3}), r"stages\[1\].train.stepz is not a config"),
    (lambda s: s[1].update({"name": "64"}), r"stages\[1\].name='64' names two stages"),
    (lambda s: s[0].update({"keep_optimizer": True}), r"stages\[0\].keep_optimizer"),
    (lambda s: s[1].train.update({"steps": 0}), r"stages\[1\].train.steps must be a positive"),
    # A stage's own config is checked in full, its errors prefixed with the stage.
    (lambda s: s[1].data.update({"seq_len": 102}), r"stage 2/2 '256': data.seq_len=102"),
])
def test_a_bad_stage_is_one_error_naming_stage_and_field(shared_data_dir, edit, message):
  config = _extend_config(shared_data_dir)
  edit(config.stages)
  with pytest.raises(ConfigError, match=message):
    check_config(config, 8)


def test_command_line_overrides_that_stages_replace_are_said(tmp_path):
  """`--config.train.steps`, which every stage sets, did nothing, without a word; one that a
  stage replaces holds in the others only (`--config.model.rope_scaling.factor=16`: stage
  1's, not stage 2's 4.0)."""
  config = importlib.import_module("configs.tiny_extend").get_config()
  assert stages.replaced_overrides(config, {"train.log_every": 1, "data.data_dir": "d"}) == (
      None, [])
  assert stages.replaced_overrides(config, {"model.rope_scaling.factor": 16.0}) == (None, [
      "note: --config.model.rope_scaling.factor holds in stages that do not set it; stage "
      "2 '256' sets its own (--config.stages[1].model.rope_scaling.factor overrides that)"])
  stored = json.loads(config.to_json_best_effort())  # A run's config.json: plain dicts.
  assert stages.replaced_overrides(ml_collections.ConfigDict(stored),
                                   {"model.rope_scaling.factor": 16.0})[1]
  result = subprocess.run(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_extend.py",
       f"--workdir={tmp_path / 'run'}", "--config.train.steps=100"],
      cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      "error: --config.train.steps is set by every stage of config.stages, whose values win: "
      "set --config.stages[0].train.steps (and so on) instead"]
  assert not (tmp_path / "run").exists()
  result = subprocess.run(  # A stage the config does not have: was an IndexError traceback.
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_extend.py",
       "--config.stages[2].train.lr=1e-4"], cwd=ROOT, capture_output=True, text=True,
      timeout=120, check=False)
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      "error: --config.stages[2].train.lr: an index past the end of its list (a stage, say, "
      "that the config does not have; they count from 0)"]


def test_resume_may_change_stages_not_yet_begun_only(shared_data_dir):
  old = resume.config_dict(_extend_config(shared_data_dir))
  later = _extend_config(shared_data_dir)
  later.stages[1].data.seq_len = 128
  # A checkpoint of stage 1: stage 2 has not begun and may change.
  assert resume.compare(old, later, started_stages=1) == [
      "stages[1].data.seq_len: 256 -> 128"]
  with pytest.raises(ConfigError, match=r"stages\[1\].data.seq_len=128"):
    resume.compare(old, later, started_stages=2)
  longer = _extend_config(shared_data_dir)
  longer.stages[1].train.lr = 5e-4  # Allowed in a begun stage, as train.lr is for a run.
  assert resume.compare(old, longer, started_stages=2) == ["stages[1].train.lr: 0.001 -> 0.0005"]


def test_a_checkpoint_must_sit_in_the_stage_that_wrote_it(shared_data_dir):
  plan = stages.resolve(_extend_config(shared_data_dir, steps=(6, 6)))
  meta = plan[1].checkpoint_meta()
  assert stages.check_checkpoint(plan, 8, meta) is None
  moved = stages.resolve(_extend_config(shared_data_dir, steps=(5, 7)))
  assert "cannot change" in stages.check_checkpoint(moved, 8, meta)
  unstaged = stages.resolve(ml_collections.ConfigDict({"stages": (), "train": {"steps": 12}}))
  assert "stage '256'" in stages.check_checkpoint(unstaged, 8, meta)
  assert "without stages" in stages.check_checkpoint(plan, 8, {})


@pytest.mark.parametrize("keep", [True, False])
def test_carry_over_keeps_or_resets_moments_and_restarts_the_schedule(keep):
  train_cfg = ml_collections.ConfigDict({"grad_clip": 1.0, "lr": 1e-3, "b1": 0.9, "b2": 0.95,
                                         "weight_decay": 0.1, "warmup_steps": 2, "steps": 10,
                                         "schedule_steps": 0, "min_lr_ratio": 0.1})
  optimizer = make_optimizer(train_cfg)
  params = {"w": jnp.arange(6.0).reshape(2, 3)}
  opt_state = optimizer.init(params)
  for _ in range(3):
    _, opt_state = optimizer.update({"w": jnp.ones((2, 3))}, opt_state, params)
  state = TrainState(step=jnp.asarray(3, jnp.int32), params=params, opt_state=opt_state)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  find = lambda tree, kind: [s for s in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, kind)) if isinstance(s, kind)][0]
  old_mu = np.array(find(opt_state, optax.ScaleByAdamState).mu["w"], copy=True)  # Consumed.
  new = carry_over_stage(state, optimizer, shardings, keep)
  adam = find(new.opt_state, optax.ScaleByAdamState)
  assert int(find(new.opt_state, optax.ScaleByScheduleState).count) == 0
  assert int(new.step) == 3 and np.array_equal(new.params["w"], params["w"])
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(opt_state) if leaf.size > 1)
  if keep:
    assert int(adam.count) == 3 and np.array_equal(adam.mu["w"], old_mu)
  else:
    assert int(adam.count) == 0 and not np.any(adam.nu["w"])


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f) if "loss" in r}  # The last of a repeat.


@pytest.mark.slow(45)
def test_two_stages_train_and_resume_exactly_after_a_kill_inside_stage_2(
    tmp_path, shared_data_dir, capsys):
  # In this process, resuming at a stage's last step: stage 1 alone, then both stages in its
  # workdir, so stage 2 starts from the restored step 6 (weights and the moments it keeps).
  first_only = _extend_config(shared_data_dir)
  first_only.stages = first_only.stages[:1]
  train(first_only, str(tmp_path / "appended"))
  train(_extend_config(shared_data_dir), str(tmp_path / "appended"))
  appended = _records(tmp_path / "appended")
  assert sorted(appended) == list(range(1, 13))
  assert {appended[s]["stage_name"] for s in range(1, 7)} == {"64"}
  assert {appended[s]["stage_name"] for s in range(7, 13)} == {"256"}
  stage_2 = stages.resolve(_extend_config(shared_data_dir))[1].config
  # Its own schedule: warmup restarts at stage 2.
  assert appended[8]["lr"] == pytest.approx(float(make_schedule(stage_2.train)(1)), rel=1e-6)
  # The final step exports with the last stage's RoPE: YaRN x4 over 64 positions.
  export(str(tmp_path / "appended"), str(tmp_path / "hf"), log=lambda line: None)
  with open(tmp_path / "hf" / "config.json") as f:
    hf_config = json.load(f)
  assert hf_config["rope_parameters"]["rope_type"] == "yarn"
  assert hf_config["rope_parameters"]["factor"] == 4.0
  assert hf_config["max_position_embeddings"] == 256

  # Both stages in one go (stage 2 from stage 1's state in memory), in this process: the
  # same losses. Then the state a kill at step 10 leaves (test_crash.py shows that a kill
  # leaves exactly the committed checkpoints): steps 6 and 8. The re-run resumes inside
  # stage 2 from step 8 and trains its losses again.
  killed = tmp_path / "killed"
  train(_extend_config(shared_data_dir), str(killed))
  assert sorted(os.listdir(killed / "checkpoints")) == ["12", "6", "8"]  # Keeps 3.
  assert {s: r["loss"] for s, r in _records(killed).items()} == {s: r["loss"] for s, r in
                                                                 appended.items()}
  shutil.rmtree(killed / "checkpoints" / "12")
  with open(killed / "metrics.jsonl") as f:  # What the killed run had logged: steps 1-10.
    logged = [line for line in f if json.loads(line).get("step", 0) <= 10]
  with open(killed / "metrics.jsonl", "w") as f:
    f.writelines(logged)
  capsys.readouterr()
  train(_extend_config(shared_data_dir), str(killed))
  resumed = capsys.readouterr().out
  assert "stage 2/2 '256': steps 7-12" in resumed
  assert "resuming at step 8" in resumed
  assert "stage 1/2" not in resumed  # Stage 1 is done; it is not run again.
  records = _records(killed)
  assert {s: r["loss"] for s, r in records.items()} == {s: r["loss"] for s, r in
                                                       appended.items()}
  assert [records[s]["stage"] for s in range(1, 13)] == [1] * 6 + [2] * 6

  # The tools that read a run open a staged one (its config.json holds the stages as plain
  # dicts), at the stage of the step they read.
  sampled = subprocess.run(
      [sys.executable, "-m", "trainer.sample", f"--workdir={killed}",
       "--prompt=the code of", "--max_new_tokens=2", "--config.model.rope_scaling.factor=4.0"],
      cwd=ROOT, text=True, capture_output=True, timeout=300)
  assert sampled.returncode == 0, sampled.stderr
  assert "note: --config.model.rope_scaling.factor holds in stages" in sampled.stderr


def test_the_llama_extension_recipe_resolves_on_an_imported_checkpoint():
  from trainer.ckpt import hf_import
  config = importlib.import_module("configs.llama_extend_32k_to_256k_striped").get_config(
      os.path.join(ROOT, "tests", "hf_fixtures", "llama3_rope"))
  hf_import.apply_to_config(config)
  check_config(config, 8)
  plan = stages.resolve(config)
  assert [(s.config.data.seq_len, s.config.model.rope_scaling.factor, s.last_step)
          for s in plan] == [(65536, 2.0, 300), (131072, 4.0, 500), (262144, 8.0, 600)]
  # The checkpoint's shape and tokenizer, the stages' RoPE.
  assert plan[2].config.model.num_kv_heads == 1 and plan[2].config.data.tokenizer.endswith(
      "tokenizer.model")
  assert plan[2].config.model.rope_scaling.type == "yarn"
  assert plan[2].config.model.rope_theta == 500000.0
