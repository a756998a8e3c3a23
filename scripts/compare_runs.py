"""Compares training runs by speed and loss, from their workdirs alone (no W&B needed).

    python scripts/compare_runs.py runs/ring runs/striped [--out runs/compare.png]

prints one row per run (layout, mesh, seq_len, median tokens/sec after warm-up, speedup
against the first run, final loss) and writes a PNG with tokens/sec and loss against step.
Each RUN_DIR must hold the `config.json` and `metrics.jsonl` that `python -m trainer` writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")  # Files only; no display needed.
from matplotlib import figure as mpl_figure  # noqa: E402  (after the backend is chosen)

_AXES = ("data", "fsdp", "sequence", "ulysses", "tensor")


@dataclasses.dataclass
class Run:
  name: str
  config: dict
  records: list[dict]  # Training records (with a loss), one per step, in step order.

  @property
  def layout(self) -> str:
    """The attention layout, and the sequence-parallel strategy when it is not the ring."""
    model = self.config["model"]
    strategy = model.get("sequence_parallel", "ring")
    if model["attention"] == "dense" or strategy == "ring":
      return model["attention"]
    return f"{model['attention']}/{strategy}"

  @property
  def seq_len(self) -> int:
    return self.config["data"]["seq_len"]

  @property
  def mesh(self) -> str:
    """data x fsdp x sequence x ulysses x tensor, a -1 filled from the device count in the
    metrics (runs from before the ulysses axis existed had it at 1)."""
    sizes = [self.config["mesh"].get(axis, 1) for axis in _AXES]
    if -1 in sizes and self.records and self.records[-1].get("tokens_per_sec_per_device"):
      last = self.records[-1]
      devices = round(last["tokens_per_sec"] / last["tokens_per_sec_per_device"])
      fixed = 1
      for size in sizes:
        fixed *= size if size != -1 else 1
      sizes = [devices // fixed if size == -1 else size for size in sizes]
    return "x".join(str(size) for size in sizes)

  @property
  def timed(self) -> list[dict]:
    """Records whose interval held no compilation (the first one of each process does)."""
    return [r for r in self.records if not r.get("warmup")]

  @property
  def median_tokens_per_sec(self) -> float | None:
    timed = self.timed
    return statistics.median(r["tokens_per_sec"] for r in timed) if timed else None

  @property
  def final_loss(self) -> float | None:
    return self.records[-1]["loss"] if self.records else None


def load_run(path: str) -> Run:
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  by_step: dict[int, dict] = {}
  with open(os.path.join(path, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError:
        continue  # A line cut short by a crash.
      if "loss" in record:
        by_step[record["step"]] = record  # A resumed run repeats steps: keep the latest.
  return Run(os.path.basename(os.path.normpath(path)), config,
             [by_step[step] for step in sorted(by_step)])


def table(runs: list[Run]) -> str:
  header = ("run", "layout", "mesh d x f x s x u x t", "seq_len", "tok/s (median)", "speedup",
            "final loss")
  base = runs[0].median_tokens_per_sec if runs else None
  rows = [header]
  for run in runs:
    speed = run.median_tokens_per_sec
    rows.append((
        run.name, run.layout, run.mesh, str(run.seq_len),
        f"{speed:,.0f}" if speed else "n/a",
        f"{speed / base:.2f}x" if speed and base else "n/a",
        f"{run.final_loss:.4f}" if run.final_loss is not None else "n/a"))
  widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
           for row in rows]
  lines.insert(1, "  ".join("-" * width for width in widths))
  return "\n".join(lines)


def build_figure(runs: list[Run]) -> mpl_figure.Figure:
  """Two panels: tokens/sec (warm-up intervals left out) and loss, against step."""
  fig = mpl_figure.Figure(figsize=(11, 4.2), layout="constrained")
  speed_ax, loss_ax = fig.subplots(1, 2)
  for run in runs:
    label = f"{run.name} ({run.layout}, mesh {run.mesh})"
    timed = run.timed
    speed_ax.plot([r["step"] for r in timed], [r["tokens_per_sec"] for r in timed],
                  marker=".", label=label)
    loss_ax.plot([r["step"] for r in run.records], [r["loss"] for r in run.records],
                 label=label)
  speed_ax.set(title="Throughput", xlabel="step", ylabel="tokens / sec")
  loss_ax.set(title="Training loss", xlabel="step", ylabel="loss")
  for ax in (speed_ax, loss_ax):
    ax.grid(alpha=0.3)
  loss_ax.legend(fontsize="small")
  return fig


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument("--out", default=os.path.join("runs", "compare.png"),
                      help="PNG to write (default runs/compare.png, beside the runs and out of "
                           "git)")
  args = parser.parse_args(argv)
  runs = []
  for path in args.run_dirs:
    try:
      runs.append(load_run(path))
    except (OSError, ValueError, KeyError) as error:
      print(f"error: cannot read run {path}: {error}", file=sys.stderr)
      return 1
  print(table(runs))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  build_figure(runs).savefig(args.out, dpi=110)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
