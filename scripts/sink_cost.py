"""FLOPs of the sink path (parallelism/sinks.py) against the windowed ring it sits beside, per
device, forward: one round of the sink table (every local query on every table key), the
ring as the schedule's computed tiles on its busiest device (tile x tile x 4 x D per head).

    python scripts/sink_cost.py --seq_len 262144 --shards 8 --window 4096 --sinks 4

Needs no accelerator: it builds the schedule and counts.
"""

from __future__ import annotations

import argparse

import numpy as np

from parallelism import sinks
from parallelism.schedule import ring_schedule


def main() -> None:
  parser = argparse.ArgumentParser()
  for name, default in (("seq_len", 262144), ("shards", 8), ("window", 4096), ("sinks", 4),
                        ("heads", 32), ("kv_heads", 8), ("head_dim", 128), ("tile", 512)):
    parser.add_argument(f"--{name}", type=int, default=default)
  parser.add_argument("--layout", default="zigzag")
  a = parser.parse_args()
  block = a.seq_len // a.shards
  plan = sinks.SinkPlan(a.sinks, a.window, a.window)
  schedule = ring_schedule(a.layout, a.seq_len, a.shards, a.window)

  # XLA's cost analysis does not see into the rounds' loop, so the table's matmuls are
  # counted here as the ring's are: QK and PV of every local query on every table key.
  sink_flops = 4 * block * a.heads * plan.capacity(a.seq_len) * a.head_dim
  tiles = schedule.computed_tiles(a.tile)  # [steps, devices]
  ring_flops = float(np.max(tiles.sum(axis=0))) * a.tile ** 2 * 4 * a.head_dim * a.heads
  print(f"S={a.seq_len} N={a.shards} w={a.window} k={a.sinks} heads={a.heads}/{a.kv_heads} "
        f"D={a.head_dim} {a.layout}: table {plan.capacity(a.seq_len)} keys per round")
  print(f"ring (busiest device, forward): {ring_flops:.3e} FLOPs")
  print(f"sink path (one round, one device, forward): {sink_flops:.3e} FLOPs "
        f"= {sink_flops / ring_flops:.1%} of the ring")


if __name__ == "__main__":
  main()
