"""Needle in a haystack on a run's checkpoint: is a fact found at every length and depth?

    python scripts/eval_needle.py --workdir runs/tiny_cpu --lengths 128,256,512
        [--depths 0,0.25,0.5,0.75,1] [--trials 4] [--step N | --untrained]
        [--config.model.attention=striped ...]

Hides a key-value fact at each depth of filler text from the run's eval split, for each
prompt length, asks for it and scores exact retrieval of greedy answers (trainer/tools/needle.py).
Writes `<workdir>/needle/<step>.json` (every trial, the grid, the command) and `<step>.png`
(the length x depth heatmap), `untrained.*` with --untrained, and prints the grid. When the
run logs to W&B and no training holds its workdir, the table and the heatmap go to its run.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402  (after the path fix above)

from trainer.config import needle_grid  # noqa: E402
from trainer.config import workdir as workdir_lock  # noqa: E402
from trainer.tools import needle, run_flags, sampling
from trainer.track import console, provenance, wandb_tracker


def define_flags() -> None:
  flags.DEFINE_string("lengths", "128,256,512", "Prompt lengths in tokens (1k = 1024).")
  flags.DEFINE_string("depths", "0,0.25,0.5,0.75,1", "Needle depths: 0 starts, 1 ends the "
                      "filler.")
  flags.DEFINE_integer("trials", 4, "Needles (key, value) per cell.")
  flags.DEFINE_integer("seed", 0, "Which keys and values the needles use.")
  flags.DEFINE_bool("untrained", False, "Evaluate the model as step 0 would start it "
                    "(the baseline), not a checkpoint.")


def main(argv: list[str]) -> None:
  console.exit_at_ctrl_c()  # Nothing to save but its W&B logging, which unwinds.
  f = run_flags.parse_run_flags(argv, define_flags)
  run_flags.use_cpu_devices(f.config)
  try:
    _evaluate(f, argv)
  except KeyboardInterrupt:
    console.exit_interrupted()
  except sampling.RUN_ERRORS + (needle_grid.NeedleError, workdir_lock.WorkdirError) as error:
    console.exit_with_error(str(error))


def _evaluate(f, argv: list[str]) -> None:
  if f.trials < 1:
    raise needle_grid.NeedleError(f"--trials={f.trials} must be at least 1")
  if f.untrained and f.step is not None:
    raise needle_grid.NeedleError("pass --step or --untrained, not both")
  lengths = needle_grid.parse_lengths(f.lengths)
  depths = needle_grid.parse_depths(f.depths)
  out_dir = os.path.join(f.workdir, "needle")
  try:  # Before the eval (hours on a large model), not when its results are written.
    os.makedirs(out_dir, exist_ok=True)
  except OSError as error:
    raise needle_grid.NeedleError(f"cannot create {out_dir}: {workdir_lock.os_reason(error)}"
                                  ) from None
  if not os.access(out_dir, os.W_OK):
    raise needle_grid.NeedleError(f"cannot write to {out_dir} (permission denied, or a "
                                  f"read-only file system)")
  if f.untrained:
    sampler, name, step = sampling.untrained(f.config), "untrained", 0
  else:
    sampler, step = sampling.load(f.workdir, f.config, f.step)
    name = str(step)
  print(f"needles in {sampler.model_cfg.attention} attention, "
        f"{name if f.untrained else f'step {step}'}: lengths {lengths}, depths {depths}, "
        f"{f.trials} per cell", flush=True)
  started = time.monotonic()
  rows = needle.evaluate(sampler, lengths, depths, f.trials, f.seed)
  accuracy = needle.grid(rows, lengths, depths)
  json_path, png_path = (os.path.join(out_dir, f"{name}.{ext}") for ext in ("json", "png"))
  title = (f"{os.path.basename(os.path.normpath(f.workdir))} {name}: needle retrieval "
           f"({sampler.model_cfg.attention}, trained at {sampler.config.data.seq_len} tokens)")
  needle.heatmap(accuracy, lengths, depths, png_path, title)
  workdir_lock.write_atomically(json_path, json.dumps(
      result_record(step, lengths, depths, f.trials, rows, accuracy, time.monotonic() - started,
                    argv), indent=1))
  print(f"\n{'tokens':>8} " + " ".join(f"{d:>6g}" for d in depths))
  for length, line in zip(lengths, accuracy):
    print(f"{length:>8,} " + " ".join(f"{a:>6.0%}" for a in line))
  print(f"mean {accuracy.mean():.1%}; wrote {json_path} and {png_path}")
  _log_to_wandb(f.config, f.workdir, step, rows, png_path)


def result_record(step: int, lengths: list[int], depths: list[float], trials: int,
                  rows: list[dict], accuracy, seconds: float, argv: list[str]) -> dict:
  """What `needle/<step>.json` holds; its command scrubbed as the trainer's own is (a token
  on the command line must not reach the workdir)."""
  return {"step": step, "lengths": lengths, "depths": depths, "trials": trials,
          "accuracy": accuracy.tolist(), "mean_accuracy": float(accuracy.mean()),
          "answered_a_value": sum(r["a_value"] for r in rows) / len(rows),
          "seconds": seconds, "command": provenance.scrubbed_command(argv), "rows": rows}


def _log_to_wandb(config, workdir: str, step: int, rows: list[dict], png_path: str) -> None:
  if wandb_tracker.resolve_mode(config.wandb.mode) == "disabled":
    return
  with console.ctrl_c_unwinds():  # The lock and the W&B run are closed as it stops.
    try:
      workdir_lock.claim(workdir)  # The run's W&B is the training process's while it runs.
    except workdir_lock.WorkdirError:
      print("W&B: not logged, a process holds the workdir (training?); the files have it all")
      return
    try:
      tracker = wandb_tracker.make(config, workdir)
      if isinstance(tracker, wandb_tracker.WandbTracker):
        columns = list(rows[0])
        tracker.log_table_and_image(step, "needle", columns, [[r[c] for c in columns]
                                                               for r in rows], png_path)
        tracker.close()
    finally:
      workdir_lock.release(workdir)


if __name__ == "__main__":
  main(sys.argv)
