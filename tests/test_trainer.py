"""The train loop end to end on the tiny config: determinism, learning, outputs."""

import json

import numpy as np

from trainer.loop import train


def _losses(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def test_same_seed_same_losses_and_the_loss_falls(tmp_path, tiny_config):
  config = tiny_config(**{"train.steps": 30, "train.log_every": 1})
  train(config, str(tmp_path / "a"))
  train(config, str(tmp_path / "b"))
  first, second = _losses(tmp_path / "a"), _losses(tmp_path / "b")
  assert len(first) == 30
  assert first == second  # Bitwise: same seed, same data, same program.
  assert np.mean(first[-5:]) < first[0] - 0.5, first


def test_run_writes_config_and_metrics_lines(tmp_path, tiny_config):
  config = tiny_config(**{"train.steps": 4, "train.log_every": 2, "train.eval_every": 4,
                          "train.eval_steps": 1})
  summary = train(config, str(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text())["model"]["attention"] == "dense"
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
