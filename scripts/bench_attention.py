"""Ring vs striped vs zigzag attention: tiles on the critical path, then CPU timings.

  python scripts/bench_attention.py            # all parts, appends results/bench_attention.jsonl
  python scripts/bench_attention.py --part count
  python scripts/bench_attention.py --part compute --window 512   # + local layers beside causal

Part 1 counts, without running any attention, the tiles each device executes at each
ring step: the static schedule the kernels run (`parallelism.schedule`). The ring
synchronises every step, so the time is set by the critical path: sum over steps of the
busiest device. Theory for long blocks: ring / striped = (N - 1/2) / (N / 2).

Part 2 times ring_attention forward and forward+backward on 2 CPU devices, each in its own
process with its own core (`taskset`), joined by `jax.distributed` on loopback so the ring's
ppermute is a real cross-process transfer; XLA's intra-op threading is off. One device per
process and one core per device is what makes the CPU a fair stand-in for accelerators: with
both fake devices in one process, a device idle on a ring step lends its core to the busy
one, which flatters ring (it leaves a device idle for a whole step; striped does not). Layouts
are interleaved, median after warm-up; a run is 3 calls back to back. The 2-core runs are
done with both core orders and pooled, so ring's busiest device (always the last) does not
keep the quieter core. A control re-runs the same with both processes on one core
(`taskset -c 0`): then only total work counts, which is the same for all layouts, so the
ratios there should be near 1.0 -- the speed-up comes from load balance, not from doing
less work.

Part 3 times the same critical path step by step: each ring step of each device in the
part 2 setup, forward and backward, through the ring's own step functions
(`RingDevice.forward_step` / `backward_step`: the schedule lookup, the skip of an empty
block pair, the kernel and the merge), alone on one core, summed over ring steps as the
busiest device per step. No transfers and no waiting at a rendezvous, so it shows the
kernels' balance without the harness's noise; part 2 is what a run gets. It also reports
what a skipped (empty) block pair costs next to a full one: ring's device 0 at step 1.

With `--window W`, parts 2 and 3 time each layout twice in the same run, interleaved: causal
and with a sliding window of W keys (labels `ring+w512` and so on). A ring cut short
(`RingSchedule.needed_steps`) runs only the steps it keeps, so part 3 counts the others as
zero and times only those; speed-ups are against `ring` with the same window, and
`local/causal` is each layout's causal time over its windowed one.

Expected: part 1 ratios ~1.85 at N=8; part 2 striped/ring >= 1.35 on 2 idle cores; part 3
near the tile-level theory for N=2 (1.44 with masked tiles at full cost; the xla kernel
computes a causal diagonal tile at 3/4 of it, so it may exceed that); an empty block
pair <= 2% of a full one. With 2
devices the per-step maximum is the exact critical path; the maximum of two equally busy
devices' medians leans a little high, so balanced layouts are slightly understated. Part 3
therefore reports the critical path from each block's minimum as well as from its median:
the kernels are deterministic, so time above a block's minimum is other processes on the
shared machine (timeit's reasoning), and two blocks with the same work then agree to ~1%
where their medians differ by up to 7%.
"""

import os
import sys

if __name__ == "__main__":
  # Before JAX starts: one single-threaded CPU device per process (see part 2).
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=1"
                             + " --xla_cpu_multi_thread_eigen=false").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import bench_results  # noqa: E402  (scripts/, first on the path)

from parallelism.layouts import LAYOUTS  # noqa: E402
from parallelism.schedule import critical_path, ring_schedule  # noqa: E402
from parallelism.tiles import SKIP  # noqa: E402

CALLS_PER_RUN = 3  # part 2: back-to-back calls per timed run
# Parts 2 and 3: the CPU setup (S from --seq_len, batch 1).
TIMED_DEVICES, TIMED_HEADS, TIMED_HEAD_DIM, TIMED_TILE = 2, 2, 64, 256
RESULTS = "bench_attention.jsonl"  # in results/


def variants(window: int | None) -> list[tuple[str, str, int | None]]:
  """(label, layout, window) of what parts 2 and 3 time: each layout causal, then with the
  window when one is given."""
  out = [(layout, layout, None) for layout in LAYOUTS]
  return out + ([(f"{layout}+w{window}", layout, window) for layout in LAYOUTS]
                if window else [])


def baseline(label: str) -> str:
  """The label speed-ups are measured against: ring with the same window."""
  return "ring" + label[label.index("+"):] if "+" in label else "ring"


def count_tiles(layout: str, num_shards: int, block_len: int, tile: int) -> dict:
  """Executed (non-skipped) tiles per device per ring step, from the static schedule."""
  schedule = ring_schedule(layout, num_shards * block_len, num_shards)
  executed_SN = schedule.computed_tiles(tile)
  return dict(critical_path=int(critical_path(executed_SN)), total=int(executed_SN.sum()),
              masked_total=int(schedule.masked_tiles(tile).sum()),
              per_step_max=executed_SN.max(axis=1).tolist())


def part_count(block_len: int = 32768, tile: int = 512) -> list[dict]:
  rows = []
  print(f"\nPart 1: executed {tile}-token tiles, {block_len} tokens per device")
  print(f"{'N':>3} {'layout':>8} {'critical':>9} {'total':>9} {'ring/this':>10} {'theory':>7}")
  for n in (2, 4, 8):
    counts = {layout: count_tiles(layout, n, block_len, tile) for layout in LAYOUTS}
    theory = (n - 0.5) / (n / 2)
    for layout in LAYOUTS:
      ratio = counts["ring"]["critical_path"] / counts[layout]["critical_path"]
      print(f"{n:>3} {layout:>8} {counts[layout]['critical_path']:>9} "
            f"{counts[layout]['total']:>9} {ratio:>10.3f} {theory:>7.3f}")
      rows.append(dict(part="count", num_shards=n, layout=layout, block_len=block_len, tile=tile,
                       ring_over_layout=ratio, theory=theory, **counts[layout]))
  at8 = [r for r in rows if r["num_shards"] == 8 and r["layout"] == "striped"][0]
  print(f"N=8 ring/striped = {at8['ring_over_layout']:.3f} (goal >= 1.84)")
  return rows


def block_seconds(seq_len: int, repeats: int,
                  window: int | None = None) -> dict[str, dict[str, float]]:
  """Median and minimum seconds of each (layout, pass, step, device) ring step (part 3).

  Runs in a child pinned to one core (`taskset`), so XLA's own threads stay on it too.
  Device and step are traced arguments, as inside the ring.
  """
  import jax
  import jax.numpy as jnp

  from parallelism.kernel_grads import Merged
  from parallelism.masks import Mask, MaskSpec
  from parallelism.ring import RingDevice

  num_shards, tile = TIMED_DEVICES, TIMED_TILE
  block_len = seq_len // num_shards
  shape = (1, block_len, TIMED_HEADS, TIMED_HEAD_DIM)
  rng = np.random.default_rng(0)
  q, k, v, dout = (jnp.asarray(rng.standard_normal(shape, np.float32)) for _ in range(4))
  def steps(schedule):
    """The ring's forward and backward step on `schedule`, jitted, device and step traced."""
    device = lambda d: RingDevice(schedule, d, "xla", tile)
    mask = Mask(MaskSpec(schedule.window))
    fwd = jax.jit(lambda d, s, carry, q, k, v: device(d).forward_step(
        s, carry, q, k, v, mask))
    bwd = jax.jit(lambda d, s, carry, lse, delta, q, k, v, dout: device(d).backward_step(
        s, carry, q, k, v, mask, Merged(None, lse, dout, delta)))  # xla reads no global out
    return fwd, bwd

  runs = {}
  for label, layout, w in variants(window):
    schedule = ring_schedule(layout, seq_len, num_shards, w)
    fwd, bwd = steps(schedule)
    for d in range(num_shards):
      d_ = jnp.int32(d)
      out, lse = fwd(d_, jnp.int32(0), None, q, k, v)  # a device's own block: step 0
      delta = jnp.sum(out * dout, axis=-1)
      carries = {"fwd": (out, lse),
                 "bwd": (out, None)}
      for step in schedule.needed_steps:  # a ring cut short never runs the others
        s_ = jnp.int32(step)
        fwd_carry, bwd_carry = (None, None) if step == 0 else (carries["fwd"], carries["bwd"])
        runs[f"{label}/fwd/{step}/{d}"] = functools.partial(fwd, d_, s_, fwd_carry, q, k, v)
        runs[f"{label}/bwd/{step}/{d}"] = functools.partial(bwd, d_, s_, bwd_carry, lse, delta,
                                                            q, k, v, dout)
  seconds = {key: [] for key in runs}
  for rep in range(repeats + 1):  # rep 0 compiles and warms up
    for key, run in runs.items():  # interleaved, as in part 2
      start = time.perf_counter()
      jax.block_until_ready(run())
      if rep:
        seconds[key].append(time.perf_counter() - start)
  return {"median": {key: statistics.median(ts) for key, ts in seconds.items()},
          "min": {key: min(ts) for key, ts in seconds.items()}}


def print_block_breakdown(seconds: dict, seq_len: int, num_shards: int,
                          window: int | None = None) -> None:
  """Where part 3's time goes: each device's step, its block pair's mask shape and its time.

  Tile counts per pair come from the schedule, so a reader can compare time per computed
  tile across shapes (a MASKED tile costing more than an UNMASKED one shows up here).
  """
  median, low = seconds["median"], seconds["min"]
  print(f"\n{'layout':>12} {'dev':>3} {'step':>4} {'mask shape':>16} {'tiles':>6} "
        f"{'fwd ms':>8} {'bwd ms':>8} {'fwd min':>8} {'bwd min':>8} {'fwd min us/tile':>15}")
  for label, layout, w in variants(window):
    schedule = ring_schedule(layout, seq_len, num_shards, w)
    counts = schedule.tiles(TIMED_TILE).classes
    for d in range(num_shards):
      for step in schedule.needed_steps:
        pair = schedule.pair[d, step]
        tiles = int((counts[pair] != SKIP).sum())
        fwd, bwd, fwd_min, bwd_min = (t[f"{label}/{what}/{step}/{d}"] for t in (median, low)
                                      for what in ("fwd", "bwd"))
        per_tile = f"{fwd_min / tiles * 1e6:>15.0f}" if tiles else f"{'-':>15}"
        print(f"{label:>12} {d:>3} {step:>4} {schedule.shapes[pair]:>16} {tiles:>6} "
              + " ".join(f"{t * 1e3:>8.1f}" for t in (fwd, bwd, fwd_min, bwd_min))
              + f" {per_tile}")


def part_compute(seq_len: int, repeats: int, window: int | None = None) -> list[dict]:
  """Kernel time on the critical path, block pair by block pair, on one core (part 3)."""
  num_shards, tile = TIMED_DEVICES, TIMED_TILE
  child = subprocess.run(
      ["taskset", "-c", "1", sys.executable, os.path.abspath(__file__), "--block_seconds",
       "--seq_len", str(seq_len), "--repeats", str(repeats)]
      + (["--window", str(window)] if window else []),
      capture_output=True, text=True, timeout=1800)
  if child.returncode:
    raise RuntimeError(f"the block timing process failed:\n{child.stderr[-2000:]}")
  seconds = json.loads(child.stdout.strip().splitlines()[-1])
  print_block_breakdown(seconds, seq_len, num_shards, window)
  critical = {}
  for estimate, blocks in seconds.items():
    for label, _, _ in variants(window):
      # Steps a ring cut short does not run were not timed: they cost nothing.
      times = {what: critical_path([[blocks.get(f"{label}/{what}/{step}/{d}", 0.0)
                                     for d in range(num_shards)] for step in range(num_shards)])
               for what in ("fwd", "bwd")}
      critical[estimate, label] = dict(times, fwd_bwd=times["fwd"] + times["bwd"])
  print(f"\nPart 3: kernels alone on the critical path, S={seq_len}, {num_shards} devices, "
        f"tile {tile}, one core, {repeats} runs per block pair (ms)")
  print(f"{'layout':>12} {'estimate':>8} {'fwd':>8} {'bwd':>8} {'f+b':>8} {'speedup fwd':>12} "
        f"{'speedup f+b':>12} {'local/causal f+b':>17}")
  speedup = {key: {what: critical[key[0], baseline(key[1])][what] / times[what]
                   for what in ("fwd", "fwd_bwd")} for key, times in critical.items()}
  local = {key: critical[key[0], key[1].partition("+")[0]]["fwd_bwd"] / times["fwd_bwd"]
           for key, times in critical.items() if "+" in key[1]}
  for (estimate, label), times in critical.items():
    print(f"{label:>12} {estimate:>8} " + " ".join(f"{t * 1e3:>8.1f}" for t in times.values())
          + f" {speedup[estimate, label]['fwd']:>12.3f}"
          + f" {speedup[estimate, label]['fwd_bwd']:>12.3f}"
          + (f" {local[estimate, label]:>17.2f}" if (estimate, label) in local else ""))
  rows = [dict(part="compute", layout=layout, window=w, seq_len=seq_len,
               num_shards=num_shards, tile=tile, repeats=repeats,
               critical_s=critical["median", label], speedup=speedup["median", label],
               critical_min_s=critical["min", label], speedup_min=speedup["min", label],
               **({"local_over_causal_fwd_bwd": local["median", label],
                   "local_over_causal_fwd_bwd_min": local["min", label]} if w else {}),
               steps_run=list(ring_schedule(layout, seq_len, num_shards, w).needed_steps),
               block_s={key.partition("/")[2]: value for key, value in seconds["median"].items()
                        if key.startswith(f"{label}/")},
               block_min_s={key.partition("/")[2]: value for key, value in seconds["min"].items()
                            if key.startswith(f"{label}/")})
          for label, layout, w in variants(window)]
  # Ring at step 1: device 0 holds the later block 1 (empty pair, skipped), device 1 the
  # earlier block 0 (full pair).
  median = seconds["median"]
  skipped = {what: median[f"ring/{what}/1/0"] / median[f"ring/{what}/1/1"]
             for what in ("fwd", "bwd")}
  print(f"an empty block pair costs {skipped['fwd']:.2%} (fwd) and {skipped['bwd']:.2%} (bwd) "
        f"of a full one, medians (goal <= 2%)")
  rows.append(dict(part="compute_skipped_block", seq_len=seq_len, tile=tile,
                   empty_over_full=skipped,
                   empty_s={w: median[f"ring/{w}/1/0"] for w in ("fwd", "bwd")},
                   full_s={w: median[f"ring/{w}/1/1"] for w in ("fwd", "bwd")}))
  return rows


def part_time(seq_len: int, repeats: int, coordinator: str, process_id: int,
              window: int | None = None) -> dict:
  """Seconds of each run of forward and forward+backward per layout on this process's device,
  one of the 2 ring devices (the other process runs the same loop)."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax.experimental import multihost_utils

  from parallelism.masks import Mask, MaskSpec
  from parallelism.ring_attention import ring_attention

  jax.distributed.initialize(coordinator, TIMED_DEVICES, process_id)
  num_heads, head_dim, tile = TIMED_HEADS, TIMED_HEAD_DIM, TIMED_TILE
  mesh = jax.make_mesh((TIMED_DEVICES,), ("sequence",))
  rng = np.random.default_rng(0)  # Same seed in both processes: one global array.

  def put(x, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  shape = (1, seq_len, num_heads, head_dim)
  q, k, v, dout = (put(rng.standard_normal(shape, np.float32), P(None, "sequence"))
                   for _ in range(4))

  def make(layout, w):
    attend = lambda q, k, v: ring_attention(q, k, v, Mask(MaskSpec(w)), layout=layout,
                                            mesh=mesh, tile_size=tile)
    fwd = jax.jit(attend)
    fwd_bwd = jax.jit(lambda q, k, v, dout: jax.vjp(attend, q, k, v)[1](dout))
    return {"fwd": lambda: fwd(q, k, v), "fwd_bwd": lambda: fwd_bwd(q, k, v, dout)}

  runs = {label: make(layout, w) for label, layout, w in variants(window)}
  times = {f"{label}/{what}": [] for label in runs for what in ("fwd", "fwd_bwd")}
  for rep in range(repeats + 1):  # rep 0 compiles and warms up
    for label in runs:  # interleaved so load drift hits all layouts alike
      for what, run in runs[label].items():
        # Both processes leave the barrier at about the same time; each then times its own
        # device, and the parent takes the slower of the two per run (the ring's critical
        # path). A run is several calls back to back, as in training, so the skew of leaving
        # the barrier (a few ms, paid by whichever process waits at the first transfer) is
        # shared out instead of counted whole.
        multihost_utils.sync_global_devices("start")
        start = time.perf_counter()
        jax.block_until_ready([run() for _ in range(CALLS_PER_RUN)])
        if rep:
          times[f"{label}/{what}"].append((time.perf_counter() - start) / CALLS_PER_RUN)
  jax.distributed.shutdown()
  return times


def time_on_cores(cores: tuple[str, str], seq_len: int, repeats: int,
                  window: int | None = None) -> dict[str, list]:
  """Runs the 2 ring processes pinned to `cores`; per run the slower process's time counts."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    coordinator = f"127.0.0.1:{s.getsockname()[1]}"
  children = [subprocess.Popen(
      ["taskset", "-c", core, sys.executable, os.path.abspath(__file__), "--child", str(pid),
       "--coordinator", coordinator, "--seq_len", str(seq_len), "--repeats", str(repeats)]
      + (["--window", str(window)] if window else []),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for pid, core in enumerate(cores)]
  outputs = [child.communicate(timeout=1800) for child in children]
  for child, (_, err) in zip(children, outputs):
    if child.returncode:
      raise RuntimeError(f"a ring process failed:\n{err[-2000:]}")
  per_process = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
  return {key: [max(ts) for ts in zip(*(p[key] for p in per_process))] for key in per_process[0]}


def time_on_both_core_orders(seq_len: int, repeats: int,
                             window: int | None = None) -> dict[str, list]:
  """Runs on cores (0, 1), then (1, 0), and pools the runs.

  Ring's busiest device is always the last one (process 1), and the cores of a shared
  machine are not equally quiet; swapping gives every layout the same mix of cores.
  """
  first = time_on_cores(("0", "1"), seq_len, repeats, window)
  second = time_on_cores(("1", "0"), seq_len, repeats, window)
  return {key: first[key] + second[key] for key in first}


def summarize(seconds: dict[str, list]) -> dict:
  # The min is printed too: on a machine shared with other jobs it is the least disturbed run.
  return {"median": {key: statistics.median(ts) for key, ts in seconds.items()},
          "min": {key: min(ts) for key, ts in seconds.items()},
          "runs": min(len(ts) for ts in seconds.values())}


def load_average() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def ratios(seconds: dict, window: int | None = None) -> dict:
  """ring time / layout time (a speed-up) for fwd and fwd_bwd, against ring with the same
  window; and each layout's causal time over its windowed one."""
  out = {f"{label}_over_ring_{what}": seconds[f"{baseline(label)}/{what}"]
         / seconds[f"{label}/{what}"]
         for label, layout, _ in variants(window) if layout != "ring"
         for what in ("fwd", "fwd_bwd")}
  out.update({f"{label}_local_over_causal_{what}": seconds[f"{layout}/{what}"]
              / seconds[f"{label}/{what}"]
              for label, layout, w in variants(window) if w for what in ("fwd", "fwd_bwd")})
  return out


def print_timing(title: str, timings: dict, window: int | None = None) -> None:
  med, low = timings["median"], timings["min"]
  print(f"\n{title}")
  print(f"{'layout':>12} {'fwd med':>8} {'fwd min':>8} {'f+b med':>8} {'f+b min':>8} "
        f"{'speedup fwd med/min':>20} {'speedup f+b med/min':>20}")
  for label, _, _ in variants(window):
    cells = [med[f"{label}/fwd"], low[f"{label}/fwd"], med[f"{label}/fwd_bwd"],
             low[f"{label}/fwd_bwd"]]
    speedups = [f"{t[f'{baseline(label)}/{what}'] / t[f'{label}/{what}']:.3f}"
                for what in ("fwd", "fwd_bwd") for t in (med, low)]
    print(f"{label:>12} " + " ".join(f"{c:>8.3f}" for c in cells)
          + f" {speedups[0] + ' / ' + speedups[1]:>20} {speedups[2] + ' / ' + speedups[3]:>20}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("all", "count", "time", "compute"), default="all")
  parser.add_argument("--seq_len", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--window", type=int, default=None,
                      help="parts 2 and 3: also time each layout with this sliding window")
  parser.add_argument("--child", type=int, default=None,
                      help="internal: run as ring process CHILD and print timings as JSON")
  parser.add_argument("--coordinator", default="", help="internal: host:port of process 0")
  parser.add_argument("--block_seconds", action="store_true",
                      help="internal: print part 3's per-block medians and minima as JSON")
  args = parser.parse_args()

  if args.block_seconds:
    print(json.dumps(block_seconds(args.seq_len, args.repeats, args.window)))
    return

  if args.child is not None:
    print(json.dumps(part_time(args.seq_len, args.repeats, args.coordinator, args.child,
                               args.window)))
    return

  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  rows = part_count() if args.part in ("all", "count") else []
  if args.part in ("all", "time"):
    load_before = load_average()
    two_cores = summarize(time_on_both_core_orders(args.seq_len, args.repeats, args.window))
    one_core = summarize(time_on_cores(("0", "0"), args.seq_len, args.repeats, args.window))
    load_after = load_average()
    print(f"\nPart 2: S={args.seq_len}, {TIMED_HEADS} heads, head_dim {TIMED_HEAD_DIM}, "
          f"tile {TIMED_TILE}, batch 1, "
          f"2 CPU devices in 2 processes, median of {two_cores['runs']} runs on 2 cores "
          f"(both core orders) and of {one_core['runs']} on 1")
    print(f"load before: {load_before}\nload after:  {load_after}")
    print("speedup = ring time / layout time (goal on 2 cores: striped fwd and fwd+bwd "
          ">= 1.35; control ~1.0)")
    print_timing("2 cores (one per device and process, both orders pooled)", two_cores,
                 args.window)
    print_timing("control: both processes pinned to 1 core (taskset -c 0)", one_core,
                 args.window)
    for cores, timings in (("2", two_cores), ("1 (taskset -c 0)", one_core)):
      rows.append(dict(part="time", cores=cores, seq_len=args.seq_len, num_heads=TIMED_HEADS,
                       head_dim=TIMED_HEAD_DIM, tile=TIMED_TILE, repeats=timings["runs"],
                       median_s=timings["median"],
                       min_s=timings["min"], window=args.window,
                       speedup_median=ratios(timings["median"], args.window),
                       speedup_min=ratios(timings["min"], args.window), load_before=load_before,
                       load_after=load_after))
  if args.part in ("all", "compute"):
    rows += part_compute(args.seq_len, args.repeats, args.window)
  commit = bench_results.commit()
  bench_results.append(RESULTS, [dict(time=stamp, commit=commit, **row) for row in rows])
  print(f"\nappended {len(rows)} lines to results/{RESULTS}")


if __name__ == "__main__":
  main()
