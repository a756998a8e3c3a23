"""Bytes each device sends for attention under every sequence-parallel strategy.

  python scripts/bench_strategies.py        # configs/7b_256k_striped.py at 256k, 8 and 64 devices
  python scripts/bench_strategies.py --config configs/1b_32k_striped.py --devices 8

For each feasible (strategy, ring x Ulysses) split of one row's sequence over the devices,
compiles one layer's attention (forward, and forward with backward) on fake CPU devices
from abstract shapes, counts what its collectives send per device in the compiled HLO
(`parallelism.traffic`), and prints it beside the formula. Counted in float32 (the CPU
compiler moves bf16 all-to-alls as float32); the "bf16" columns are the formula at the
model's dtype. Per step = layers x `traffic.layer_bytes` (the gradient's bytes, adjusted
for the config's remat). Packed
documents add 4 bytes per token of segment ids and are left out here. "balance" is the
attention work an even split would give each device over the work on the critical path
(from the static schedule; 1.0 = every device busy at every ring step). Appends to
results/bench_strategies.jsonl.
"""

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=64").strip()
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import bench_results  # noqa: E402  (scripts/, first on the path)
from parallelism import traffic  # noqa: E402
from parallelism.layouts import LAYOUTS  # noqa: E402
from parallelism.strategies import splits  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/7b_256k_striped.py",
                      help="configs/NAME.py, or configs/NAME.py:ARG as for the trainer")
  parser.add_argument("--devices", default="8,64", help="comma-separated sequence devices")
  args = parser.parse_args()
  path, _, argument = args.config.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  module = importlib.import_module(f"configs.{name}")
  config = module.get_config(argument) if argument else module.get_config()
  if config.model.attention not in LAYOUTS:
    parser.error(f"{args.config} has model.attention={config.model.attention!r}, not a layout "
                 f"that splits the sequence; name one of {', '.join(LAYOUTS)} (e.g. "
                 f"configs/tiny_cpu.py:striped)")
  m = config.model
  head_dim = m.head_dim or m.d_model // m.num_heads
  itemsize = jnp.dtype(m.dtype).itemsize
  layout = m.attention
  counted_shapes = traffic.Shapes(rows=1, seq_len=config.data.seq_len, heads=m.num_heads,
                                  kv_heads=m.num_kv_heads, head_dim=head_dim, itemsize=4,
                                  packed=False)
  model_shapes = traffic.Shapes(**{**counted_shapes.__dict__, "itemsize": itemsize})
  print(f"{args.config}: {m.num_layers} layers, {m.num_heads} heads ({m.num_kv_heads} kv), "
        f"head dim {head_dim}, {config.data.seq_len:,} tokens per row, layout {layout}, "
        f"remat {config.train.remat}; bytes sent per device, MiB")
  header = (f"{'devices':>7} {'strategy':>9} {'ring x U':>9} {'fwd HLO':>9} {'fwd formula':>11} "
            f"{'grad HLO':>9} {'grad formula':>12} {'bf16 layer':>10} {'bf16 step GiB':>13} "
            f"{'balance':>7}")
  print(header)
  records = []
  for devices in (int(d) for d in args.devices.split(",")):
    for strategy, ring, ulysses in splits(devices, m.num_heads):
      if config.data.seq_len % (ring * ulysses):
        continue
      started = time.monotonic()
      counted = traffic.compiled_bytes(strategy, counted_shapes, ring, ulysses, layout=layout,
                                       tile_size=m.attention_tile)
      compile_s = time.monotonic() - started
      f32 = traffic.formula(strategy, counted_shapes, ring, ulysses)
      bf16 = traffic.formula(strategy, model_shapes, ring, ulysses)
      layer = traffic.layer_bytes(bf16, config.train.remat)
      row = {
          "devices": devices, "strategy": strategy, "ring": ring, "ulysses": ulysses,
          "forward_hlo": traffic.sent_total(counted["forward"]), "forward_formula": f32["forward"],
          "gradient_hlo": traffic.sent_total(counted["gradient"]),
          "gradient_formula": traffic.layer_bytes(f32, "none"),
          "unknown_trips": counted["gradient"]["unknown_trips"],
          "layer_bytes_model_dtype": layer, "step_bytes_model_dtype": layer * m.num_layers,
          "attention_balance": traffic.attention_balance(layout, config.data.seq_len, ring,
                                                         m.attention_tile,
                                                         per_step=strategy != "allgather"),
          "compile_s": round(compile_s, 1)}
      records.append(row)
      mib = lambda x: f"{x / 2**20:,.1f}"
      print(f"{devices:>7} {strategy:>9} {f'{ring} x {ulysses}':>9} {mib(row['forward_hlo']):>9} "
            f"{mib(row['forward_formula']):>11} {mib(row['gradient_hlo']):>9} "
            f"{mib(row['gradient_formula']):>12} {mib(layer):>10} "
            f"{row['step_bytes_model_dtype'] / 2**30:>13.2f} {row['attention_balance']:>7.3f}",
            flush=True)
      if not math.isclose(row["gradient_hlo"], row["gradient_formula"]) or not math.isclose(
          row["forward_hlo"], row["forward_formula"]):
        print("  ^ the compiled program and the formula differ: a bug to explain", flush=True)
  stamp = {"config": args.config, "commit": bench_results.commit(),
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  bench_results.append("bench_strategies.jsonl", [{**stamp, **r} for r in records])


if __name__ == "__main__":
  main()
