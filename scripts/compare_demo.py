"""Striped against ring on a laptop: `make compare`.

    .venv/bin/python scripts/compare_demo.py [--steps 16] [--seq_len 8192] [--out FILE.png]

The embedded default (`make train`) runs 8 simulated devices on 2 cores: the devices take
turns on the cores, so the time of a step is the sum of all devices' work, and the critical
path that striped attention shortens (every device waiting for the busiest one at every
ring step) does not exist there; striped even pays a little extra for its masks.

Here `python -m trainer` runs as 2 processes joined by `jax.distributed` on loopback, each
pinned to a core of its own with single-threaded XLA: 2 ring devices that really run side by
side, as on a node. The model is small and the sequence long (8,192 tokens), so attention is
most of the work. It trains ring, striped, striped, ring (each from scratch under
`runs/compare/`; the mirrored order cancels a machine that speeds up or slows down over the
minutes), then `scripts/compare_runs.py` prints the table and writes the PNG, and the ratio
of the two layouts' median tokens/sec over both their runs is printed and appended to
`results/compare_demo.jsonl`. The ratio to expect is the tile-level bound of 2 devices
(1.44 for attention alone) diluted by the work that is not attention: about 1.25-1.3 on 2
idle cores. The runs log to W&B offline (unless WANDB_MODE says otherwise) into one
workspace, `runs/compare/wandb`, that `wandb leet runs/compare/wandb` shows as a dashboard.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "scripts"), ROOT]
import compare_runs  # noqa: E402  (the table and PNG of any two workdirs)
import two_cores  # noqa: E402  (2 processes, one core each)
from configs import tiny_cpu  # noqa: E402  (what the demo trains)

LAYOUTS = ("ring", "striped")
RESULTS = os.path.join(ROOT, "results", "compare_demo.jsonl")
WORKSPACE = os.path.join(ROOT, "runs", "compare", "wandb")  # wandb.workspace's default here.


def _overrides(args) -> list[str]:
  return [f"--config.data.seq_len={args.seq_len}", "--config.train.batch_size=1",
          f"--config.train.steps={args.steps}", "--config.train.log_every=1",
          # A demo shorter than the config's warm-up warms up for all but one step.
          f"--config.train.warmup_steps="
          f"{min(tiny_cpu.get_config().train.warmup_steps, args.steps - 1)}",
          "--config.train.eval_every=0", f"--config.checkpoint.every_steps={args.steps}",
          "--config.model.dtype=float32",  # XLA:CPU's bfloat16 matmuls are emulated, slower.
          f"--config.model.attention_tile={args.tile}",
          "--config.mesh.fsdp=1", "--config.mesh.sequence=2", "--config.cpu_devices=1",
          "--config.wandb.mode=offline", "--config.wandb.tags=compare"]


def train_on_two_cores(layout: str, workdir: str, cores: list[int], args) -> None:
  """One ring device per process, each process alone on its core."""
  two_cores.run(lambda index, address: [
      sys.executable, "-m", "trainer", "--config", f"configs/tiny_cpu.py:{layout}",
      f"--workdir={workdir}", f"--coordinator_address={address}", "--num_processes=2",
      f"--process_id={index}", f"--config.wandb.name={os.path.basename(workdir)}",
      *_overrides(args)], cores, f"the {layout} run", cwd=ROOT)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=16,
                      help="training steps per run, at least 3 (the first compiles and is not "
                           "timed; default 16)")
  parser.add_argument("--seq_len", type=int, default=8192,
                      help="tokens per row: attention must be most of the work for the gain "
                           "to show (default 8192)")
  parser.add_argument("--tile", type=int, default=256,  # Finer skipping: bound 1.44, not 1.39.
                      help="attention tile of the block kernel (default 256)")
  parser.add_argument("--out", default="runs/compare/compare.png",  # Beside the runs: not in git.
                      help="the comparison PNG (default runs/compare/compare.png)")
  args = parser.parse_args()
  if args.steps < 3:
    parser.error(f"--steps={args.steps}: at least 3, so that some steps are timed")
  cores = two_cores.cores()
  order = [("ring", 1), ("striped", 1), ("striped", 2), ("ring", 2)]
  workdirs = {run: os.path.join(ROOT, "runs", "compare", f"{run[0]}-{run[1]}") for run in order}
  for run, workdir in workdirs.items():
    shutil.rmtree(workdir, ignore_errors=True)  # A fresh run each time, not a resume.
    print(f"\n== {run[0]} (run {run[1]} of 2): 2 processes on cores {cores}, {args.steps} "
          f"steps of {args.seq_len} tokens ==", flush=True)
    start = time.monotonic()
    train_on_two_cores(run[0], workdir, cores, args)
    print(f"({run[0]} took {time.monotonic() - start:.0f} s with start-up and compile)")
  print()
  compare_runs.main([*workdirs.values(), "--out", args.out])
  speed = {layout: statistics.median(
               record["tokens_per_sec"] for run, workdir in workdirs.items() if run[0] == layout
               for record in compare_runs.load_run(workdir).timed)
           for layout in LAYOUTS}
  row = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "seq_len": args.seq_len, "steps": args.steps, "tile": args.tile, "cores": cores,
         "median_tokens_per_sec": speed, "striped_over_ring": speed["striped"] / speed["ring"],
         "load_average": os.getloadavg()[0]}
  with open(RESULTS, "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")
  print(f"median tokens/sec over both runs: ring {speed['ring']:,.0f}, striped "
        f"{speed['striped']:,.0f}; striped/ring {row['striped_over_ring']:.2f}x (goal >= 1.25); "
        f"appended to {os.path.relpath(RESULTS, ROOT)}")
  if os.path.isdir(WORKSPACE):  # Not when WANDB_MODE=disabled.
    print(f"the four runs in W&B's terminal dashboard: .venv/bin/wandb leet "
          f"{os.path.relpath(WORKSPACE)}")


if __name__ == "__main__":
  main()
