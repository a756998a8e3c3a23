"""`python -m trainer.tools.moa_plan`: MoA's per-head spans, searched from a run's checkpoint.

    python -m trainer.tools.moa_plan --workdir RUN --density 0.25 --lengths 128,256 \\
        [--out RUN/moa_plan.json] [--rows 8] [--step N] [--alphas ...] [--betas ...]
    python -m trainer.tools.moa_plan --from_hf DIR --density 0.25 --lengths 4096 --out PLAN
    python -m trainer --config ... --config.model.head_spans=RUN/moa_plan.json --workdir NEW

Profiles the run's checkpoint on `--rows` calibration rows of its eval split at each length
(model/moa_profile.py; with `--from_hf`, a Hugging Face LLaMA read as `trainer.sample` reads
it, on the eval split of the config's `data`: `--config.data.*`), then picks one rule
`alpha + beta * N` per layer and query head from the grid `--alphas` x `--betas` (and the
causal rule) so that the model keeps at most `--density` of causal attention's (query, key)
pairs at every profiled length, with the least estimated loss (trainer/tools/moa_search.py).
Writes the plan the trainer reads, and beside it `<out>.record.json` (checkpoint step,
lengths, budget, calibration rows, what it keeps) and `<out>.profile.npz`. Its flags and
grid are checked before JAX is imported.
"""

from __future__ import annotations

import math
import os
import sys

import ml_collections

from trainer.tools import moa_search
from trainer.tools.run_flags import SampleError, parse_run_flags, use_cpu_devices
from trainer.track import console

# MoA's rules mix a fixed part and a share of the row; this grid spans short windows to
# the whole row at the tiny model's lengths and scales with longer ones through beta.
DEFAULT_ALPHAS = "8,16,32,64,128"
DEFAULT_BETAS = "0,0.0625,0.125,0.25,0.5"


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_float("density", None, "Share of causal (query, key) pairs kept, in (0, 1].")
  flags.DEFINE_string("lengths", None, "Comma-separated row lengths to profile, e.g. 128,256.")
  flags.DEFINE_string("out", None, "Plan file to write; default <workdir>/moa_plan.json.")
  flags.DEFINE_integer("rows", 8, "Calibration rows of the eval split per length.")
  flags.DEFINE_string("alphas", DEFAULT_ALPHAS, "Candidate alphas (keys), comma-separated.")
  flags.DEFINE_string("betas", DEFAULT_BETAS, "Candidate betas (share of N), comma-separated.")
  flags.DEFINE_integer("chunk", 256, "Queries profiled at a time (bounds the memory).")
  flags.DEFINE_integer("seed", 0, "Seed of the calibration rows' order.")
  flags.DEFINE_enum("loss_on", "auto", ["auto", "answers", "all"], "Tokens whose loss is "
                    "profiled: the dataset's answers (as MoA profiles responses), all, or "
                    "auto (answers where the dataset marks them).")


def _numbers(flag: str, text: str | None, kind=float) -> list:
  """The comma-separated numbers of `--flag`; SampleError naming it if there are none or
  one is not a finite number of `kind`."""
  try:
    values = [kind(part) for part in (text or "").split(",") if part.strip()]
  except ValueError:
    raise SampleError(f"--{flag}={text}: not a comma-separated list of numbers") from None
  if not values or not all(math.isfinite(v) for v in values):
    raise SampleError(f"--{flag}={text or ''}: give at least one finite number")
  return values


def request_of(f):
  """The search's Request from the flags, checked before JAX (SampleError in one line)."""
  if f.density is None or not 0 < f.density <= 1:  # NaN fails too.
    raise SampleError(f"--density={f.density} must be in (0, 1] (the share of causal "
                      f"attention's pairs kept)")
  lengths = _numbers("lengths", f.lengths, int)
  if min(lengths) < 1:
    raise SampleError(f"--lengths={f.lengths}: a length is a positive number of tokens")
  if f.rows < 1 or f.chunk < 1:
    raise SampleError(f"--rows={f.rows} and --chunk={f.chunk} must be positive")
  alphas, betas = _numbers("alphas", f.alphas), _numbers("betas", f.betas)
  rules = moa_search.candidates(alphas, betas, lengths)
  if len(rules) < 2:  # The causal rule alone is no choice.
    raise SampleError(f"--alphas={f.alphas} --betas={f.betas}: the candidate grid is empty (a "
                      f"rule needs a span alpha + beta * N of at least 1 key at every length)")
  return moa_search.Request(f.density, tuple(sorted(set(lengths))), f.rows, tuple(rules),
                           f.chunk, f.seed, f.loss_on)


def length_problem(config: ml_collections.ConfigDict,
                   request: moa_search.Request) -> str | None:
  """Why the run cannot profile a requested length; None if it can: the row must split over
  the run's sequence shards in its layout and tiles, as a training row must. Imports JAX."""
  from trainer.tools.sampling import capacity_for  # pylint: disable=g-import-not-at-top
  shards, ulysses = config.mesh.sequence, config.mesh.ulysses
  for length in request.lengths:
    fits = capacity_for(length, config, shards, ulysses)
    if fits != length:
      return (f"--lengths: {length} cannot be profiled by this run: its "
              f"{config.model.attention} attention over {shards * ulysses} sequence "
              f"device(s) takes rows of {fits} tokens there (a multiple of what its layout "
              f"and tiles need)")
  return None


def main(argv: list[str]) -> None:
  """The command line (module docstring)."""
  f = parse_run_flags(argv, _define_flags, allow_hf=True)
  info = lambda line: print(line, file=sys.stderr, flush=True)
  try:
    request = request_of(f)  # Before seconds of imports and minutes of profiling.
    if f.from_hf and not f.out:
      raise SampleError("--out=PLAN is needed with --from_hf (a plan goes beside a run by "
                        "default, and there is none)")
    out = f.out or os.path.join(f.workdir, "moa_plan.json")
    use_cpu_devices(f.config)
    problem = length_problem(f.config, request)
    if problem:
      raise SampleError(problem)
    from trainer.tools import moa_calibrate  # pylint: disable=g-import-not-at-top
    if f.from_hf:
      from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
      from trainer.ckpt import hf_import  # pylint: disable=g-import-not-at-top
      info(hf_import.apply_to_config(f.config, config_flags.get_override_values(f["config"])))
    sampler, origin = moa_calibrate.load_run(f.workdir, f.config, f.step, info)
    moa_calibrate.search(sampler, origin, request, out, info)
  except SampleError as error:
    console.exit_with_error(str(error))


if __name__ == "__main__":
  main(sys.argv)
