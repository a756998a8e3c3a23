"""The planner's strategy table: every way to split the config's sequence devices, compared.

    python -m trainer --config configs/7b_256k_striped.py --dry_run --compare_strategies

The devices that share a row's sequence (mesh.sequence x mesh.ulysses) can run every
strategy of `parallelism.strategies` and, with Ulysses, every ring x Ulysses split, in
every layout; data, fsdp and tensor stay as configured. Each feasible choice gets a row:
per-device memory from its own compiled train step (the CPU figure the dry run's verdict
uses; one compile per split, in the config's layout), the bytes each device sends for
attention per step (`parallelism.traffic.formula`, equal to the compiled HLO's count:
tests/test_traffic.py), the attention balance of the static schedule, and an estimated
step time from this model:

- compute = (matmul FLOPs + attention FLOPs / balance) / (devices x peak x MFU), the
  FLOPs x 8/6 where remat runs the forward again (`save_attention`: not attention's);
  balance per ring step for a ring, per device over all steps for the all-gather (it
  holds every block, so it never waits within a layer);
- a ring's hops overlap the attention compute (only the excess adds); all-gather and
  all-to-all bytes add in full (this code does not overlap them);
- Ulysses' all-to-alls cross --intra_node_gbps while its group fits in a node
  (--node_size devices with tensor), else --inter_node_gbps; the same for the ring and
  the all-gather with the whole sequence group.

The fastest choice that fits is marked. It is a model for ranking, not a measurement.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import ml_collections

import parallelism
from parallelism import traffic
from trainer.config import flops
from trainer.config.config_check import ConfigError
from trainer.core.training import model_config
from trainer.plan import dry_run, plan_report, plan_target, ring_links



def attention_bytes(config: ml_collections.ConfigDict, shape: dict[str, int]) -> dict[str, float]:
  """Bytes one device sends for attention per train step: 'ulysses' (the all-to-alls) and
  'ring' (the ring's hops or the all-gather)."""
  m, t = config.model, config.train
  sent = traffic.formula(m.sequence_parallel, ring_links.shapes(config, shape),
                         shape["sequence"], shape["ulysses"])
  ulysses = traffic.layer_bytes(sent, t.remat, "ulysses_")
  total = traffic.layer_bytes(sent, t.remat)
  per_step = m.num_layers * t.micro_batches
  return {"ulysses": ulysses * per_step, "ring": (total - ulysses) * per_step}


def estimate(config: ml_collections.ConfigDict, shape: dict[str, int], balance: float,
             peak: float, mfu: float, intra_bps: float, inter_bps: float,
             node_size: int) -> dict[str, float]:
  """Step time of the model in this module's docstring, and its parts, in seconds."""
  cfg = model_config(config)
  devices = math.prod(shape.values())
  tokens = config.train.batch_size * config.data.seq_len
  # Remat runs the forward again: 8 FLOPs per 6; `save_attention` keeps attention's result.
  remat = config.train.remat
  again = 8 / 6 if remat in traffic.RECOMPUTES_ATTENTION + ("save_attention",) else 1.0
  attention_again = again if remat != "save_attention" else 1.0
  attention_flops = 6 * cfg.num_layers * cfg.num_heads * cfg.head_size * config.data.seq_len
  attention_s = attention_flops * attention_again * tokens / balance / (devices * peak * mfu)
  matmul_s = 6 * cfg.matmul_params() * again * tokens / (devices * peak * mfu)
  sent = attention_bytes(config, shape)
  link = lambda group: intra_bps if group * shape["tensor"] <= node_size else inter_bps
  ring_s = sent["ring"] / link(shape["sequence"] * shape["ulysses"])
  ulysses_s = sent["ulysses"] / link(shape["ulysses"])
  exposed = ring_s if config.model.sequence_parallel == "allgather" else max(
      0.0, ring_s - attention_s)
  return {"step_s": matmul_s + attention_s + exposed + ulysses_s, "compute_s":
          matmul_s + attention_s, "ring_s": ring_s, "ulysses_s": ulysses_s,
          "sent_bytes": sent["ring"] + sent["ulysses"]}


def compare(config: ml_collections.ConfigDict, device_memory_gib: float | None = None,
            mfu: float = 0.4, accelerator: str = "h100",
            intra_node_gbps: float = flops.LINK_BYTES_PER_S["nvlink"] / 1e9,
            inter_node_gbps: float = flops.LINK_BYTES_PER_S["ib_400g"] / 1e9,
            node_size: int = flops.GPUS_PER_NODE,
            log: Callable[[str], None] = print,
            target: str | None = None) -> list[dict[str, Any]]:
  """Plans every split of the config's sequence devices, in every layout; prints and
  returns the rows. Each split compiles once (for described `target` devices, else fake CPU),
  in the config's layout: the layouts differ in the schedule (balance, so time), not in
  what the step holds."""
  device_memory_gib = device_memory_gib or dry_run.default_memory_gib(target, accelerator)
  if config.model.attention == "dense":
    raise ConfigError("--compare_strategies compares ways to split the sequence; "
                      "model.attention='dense' does not split it")
  count = dry_run.plan_device_count(config)
  shape = dict(zip(parallelism.MESH_AXES, parallelism.resolve_mesh_shape(config.mesh, count)))
  devices = shape["sequence"] * shape["ulysses"]
  heads = config.model.num_heads // shape["tensor"]
  peak = flops.PEAK_FLOPS[plan_target.peak_key(accelerator)]
  compiled = f"for {target}" if target else "on the CPU"
  log(f"strategies for {devices} sequence devices of {count} ({config.data.seq_len:,} tokens, "
      f"{accelerator} at {mfu:.0%} MFU, links {intra_node_gbps:g} GB/s in a node of "
      f"{node_size}, {inter_node_gbps:g} GB/s across; memory compiled {compiled} in the "
      f"{config.model.attention} layout)")
  log(f"{'strategy':>9} {'ring x U':>9} {'layout':>8} {'memory':>12} {'fits':>4} "
      f"{'sent/step':>12} {'balance':>7} {'compute':>10} {'exposed':>10} {'step':>10}")
  rows = []
  for strategy, ring, ulysses in parallelism.strategies.splits(devices, heads):
    choice = copy.deepcopy(config)
    choice.model.sequence_parallel = strategy
    for axis in parallelism.MESH_AXES:
      choice.mesh[axis] = shape[axis]
    choice.mesh.sequence, choice.mesh.ulysses = ring, ulysses
    split = {**shape, "sequence": ring, "ulysses": ulysses}
    try:  # The plan checks the config first.
      memory = dry_run.memory_plan(choice, device_memory_gib, floor=False, target=target)[0]
    except ConfigError as error:
      log(f"{strategy:>9} {f'{ring} x {ulysses}':>9}  cannot run: {error}")
      continue
    # A ring of one holds the tokens unpermuted: every layout is the same there.
    layouts = [config.model.attention] if ring == 1 else list(parallelism.LAYOUTS)
    for layout in layouts:
      if config.data.seq_len % parallelism.length_unit(
          layout, ring, config.model.attention_tile, ulysses, config.data.seq_len):
        continue
      choice.model.attention = layout
      balance = traffic.attention_balance(layout, config.data.seq_len, ring,
                                          config.model.attention_tile,
                                          per_step=strategy != "allgather")
      time = estimate(choice, split, balance, peak, mfu, intra_node_gbps * 1e9,
                      inter_node_gbps * 1e9, node_size)
      row = {"strategy": strategy, "ring": ring, "ulysses": ulysses,
             "layout": layout if ring > 1 else "any", "total_bytes": memory["total_bytes"],
             "fits": memory["fits"], "balance": balance, **time}
      rows.append(row)
      log(_row_line(row))
  fitting = [row for row in rows if row["fits"]]
  if fitting:
    best = min(fitting, key=lambda row: (row["step_s"], -row["balance"]))  # ties: balance
    layout = "" if best["layout"] == "any" else f"--config.model.attention={best['layout']} "
    log(f"fastest that fits: {best['strategy']} {best['ring']} x {best['ulysses']} "
        f"({layout}--config.model.sequence_parallel={best['strategy']} "
        f"--config.mesh.sequence={best['ring']} --config.mesh.ulysses={best['ulysses']})")
  else:
    log(f"none fits in {device_memory_gib:g} GiB per device")
  return rows


def _row_line(row: dict[str, Any]) -> str:
  seconds = lambda s: f"{plan_report.human_seconds(s):>10}"
  split = f"{row['ring']} x {row['ulysses']}"
  return (f"{row['strategy']:>9} {split:>9} {row['layout']:>8} "
          f"{plan_report.human_bytes(row['total_bytes'])} {'yes' if row['fits'] else 'no':>4} "
          f"{plan_report.human_bytes(row['sent_bytes'])} {row['balance']:>7.3f} "
          f"{seconds(row['compute_s'])} {seconds(row['step_s'] - row['compute_s'])} "
          f"{seconds(row['step_s'])}")
