"""Hash attention (SCFA, issue #38) against causal attention: time and computed tile pairs.

  python scripts/bench_sparse.py                                  # CPU: block, ring, ring2
  python scripts/bench_sparse.py --part ring2 --ring2_seq_len 16384
  python scripts/bench_sparse.py --part block --seq_lens 4096,8192,16384
  python scripts/bench_sparse.py --gpu                            # SCFA's settings on a GPU

Appends JSON lines to results/bench_sparse.jsonl (and $OUT/bench_sparse.jsonl when set).

- block: one device, one causal block (a ring of one) through the `xla` kernel, forward and
  forward+backward as ring_attention's custom_vjp runs them: causal (the static schedule's
  tiles) and hash attention with each bucket count (codes from the model's hash,
  `model.hashing`, of the same random q and k). Each repeat times causal and every bucket
  count back to back, so the ratios compare runs seconds apart (the machine is shared and
  absolute times drift); the table shows each one's median and its median ratio to causal.
- ring: the same through `ring_attention` on 8 simulated CPU devices (one process; the
  devices share its cores, so this is total work, not a ring's critical path) in
  `--layout`.
- ring2: the same through `ring_attention` on a ring of 2 devices that really run side by
  side: the script starts itself again as 2 processes joined by `jax.distributed` on
  loopback, each pinned to a core of its own with single-threaded XLA and holding one CPU
  device (`scripts/two_cores.py`, as `scripts/compare_demo.py` trains). A ring step waits
  for the slower device, so this times the ring's critical path, not its total work. Both
  processes make the same inputs and run the same calls (the collectives pair them); process
  0 alone prints and records (rows with `processes`), its clock covering both devices
  through the ring's collectives. Needs 2 cores and `taskset`.
- tiles: (query head, query tile, key tile) pairs computed, summed over devices and ring
  steps: causal from the static schedule, hash from the kernel's own ranges
  (`kernel_hash.computed_tiles`, sorted as the ring sorts). Ideal: the visible pairs over
  causal's (`visible_fraction`, about 1/buckets); sorted, each bucket also computes its
  ragged edge tiles, which weigh more as buckets get fewer tiles each.
- drop-r: QK-dropping at rate r through the same codes (`model.dropping`: kept 0, dropped
  queries 1, dropped keys 2), so the same kernel; ideal about (1 - r)^2.
- sparsek-k: SparseK (`model.sparsek`) keeping k keys per query beside a window of one tile,
  each query's exact prefix threshold over scores u per key and kv head: `--sparsek_scores
  iid`, u ~ N(0, 4^2) independent of position (the worst case: nearly every key tile holds a
  key above a query tile's threshold, so little is skipped), or `recent`, u = position / 8
  plus N(0, 1/4) noise (the best case: the selected keys are the most recent ones, a band
  the tiles skip around). Tiles from `kernel_sparsek.computed_tiles`, ideal about
  (k + window) / (the causal keys per query, on average). Learned scores lie in between.
  `sparsek-thresholds` times the thresholds themselves (forward and VJP, one row: every
  prefix at once, O(S log S), `model/sparsek_prefixes.py`) against causal.
- hash-1: every code equal, so the mask is causal: the run-time walk (sorted rows, one head
  per matmul, every tile masked) against the static kernel at about the same tiles. Its
  time ratio is the walk's own cost per tile; hash-b's ratio is that times the tiles saved.

`--gpu`: SCFA's settings (bf16, B=4, H=48, D=64, 8k to 32k tokens, tile 128), block part
only, on whatever one device JAX finds (not run yet: the walk is one head per tile pair, so
on a GPU each step is a few small launches; expect it launch-bound, not 1/buckets).
"""

import os
import sys

# Set by this script on the command lines of part ring2's 2 processes.
_RING2_PROCESS = any(arg.startswith("--process_id") for arg in sys.argv)

if __name__ == "__main__":
  # Before JAX starts: the ring part's 8 CPU devices (a ring2 process keeps two_cores' one).
  if "--gpu" not in sys.argv and not _RING2_PROCESS:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

from model.dropping import drop_codes  # noqa: E402
from model.hashing import bucket_codes, projections  # noqa: E402
from model.sparsek import prefix_thresholds  # noqa: E402
from parallelism import kernel_hash, kernel_sparsek, kernel_xla  # noqa: E402
from parallelism.layouts import LAYOUTS, permute  # noqa: E402
from parallelism.kernel_grads import Merged  # noqa: E402
from parallelism.masks import Mask, MaskSpec, Side  # noqa: E402
from parallelism.ring_attention import ring_attention  # noqa: E402
from parallelism.schedule import held_block, ring_schedule  # noqa: E402
import bench_results  # noqa: E402  (scripts/, first on the path)
import two_cores  # noqa: E402

RESULTS = "bench_sparse.jsonl"
_STAMP = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def record(rows: list[dict]) -> None:
  """Appends rows to results/ (and $OUT: the device machine hands back only that)."""
  stamped = [dict(time=_STAMP, commit=bench_results.commit(),
                  device=jax.devices()[0].device_kind, **row) for row in rows]
  bench_results.append(RESULTS, stamped)
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], RESULTS), "a", encoding="utf-8") as f:
      f.writelines(json.dumps(row) + "\n" for row in stamped)


def inputs(batch, seq_len, heads, kv_heads, head_dim, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = [(batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim),
            (batch, seq_len, kv_heads, head_dim), (batch, seq_len, heads, head_dim)]
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def codes_of(q, k, buckets: int):
  """The model's bucket codes of q and k (one layer's fixed projection)."""
  proj_KDR = jnp.asarray(projections(1, k.shape[2], k.shape[3], buckets)[0])
  return bucket_codes(q, proj_KDR), bucket_codes(k, proj_KDR)


def sparsek_codes(q, k, keep: int, window: int, scores: str = "iid"):
  """(thresholds [B, S, Hq], scores [B, S, Hkv]) float32 of SparseK keeping `keep` keys beside
  `window`: scores as `scores` says (module docstring), the row's exact prefix thresholds."""
  noise = jax.random.normal(jax.random.key(7), k.shape[:3], jnp.float32)
  u = 4.0 * noise if scores == "iid" else (
      jnp.arange(k.shape[1], dtype=jnp.float32)[None, :, None] / 8 + 0.5 * noise)
  seg = jnp.zeros(k.shape[:2], jnp.int32)
  tau = jax.jit(prefix_thresholds, static_argnums=(2, 3))(u, seg, keep, window)
  return jnp.repeat(tau, q.shape[2] // k.shape[2], axis=2), u


def hash_spec(buckets: int) -> MaskSpec:
  return MaskSpec(sparse="hash", hash_buckets=buckets)


def mask_of(variant) -> Mask:
  """A variant's mask: None is causal; else (spec, the queries', the keys' operand), codes
  (hash, QK-dropping) or SparseK's thresholds and scores."""
  if variant is None:
    return Mask()
  spec, q_side, k_side = variant
  field = "scores" if spec.selects else "codes"
  return Mask(spec, Side(**{field: q_side}), Side(**{field: k_side}))


def block_step(schedule, tile: int):
  """Forward, and forward+backward, of one block pair (ring_attention's custom_vjp order),
  each (q, k, v, dout, mask)."""
  at = dict(schedule=schedule, pair=jnp.int32(0), tile=tile)

  def fwd(q, k, v, dout, mask):
    return kernel_xla.block_fwd(q, k, v, mask, **at)

  def fwd_bwd(q, k, v, dout, mask):
    out, lse = fwd(q, k, v, dout, mask)
    delta = jnp.sum(out * dout.astype(jnp.float32), axis=-1)
    grads = kernel_xla.block_bwd(q, k, v, mask, Merged(out, lse, dout, delta), **at)
    return grads.dq, grads.dk, grads.dv
  return jax.jit(fwd), jax.jit(fwd_bwd)


def ring_step(mesh, layout: str, tile: int):
  """Forward, and forward+backward, of ring_attention on `mesh` (inputs already permuted)."""
  def fwd(q, k, v, dout, mask):
    return ring_attention(q, k, v, mask, layout=layout, mesh=mesh, kernel="xla",
                          tile_size=tile)

  def fwd_bwd(q, k, v, dout, mask):
    out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, dout, mask), q, k, v)
    return vjp(dout)
  return jax.jit(fwd), jax.jit(fwd_bwd)


def tile_counts(schedule, tile: int, variant, batch: int) -> tuple[int, int]:
  """(causal, the variant's) tile pairs computed over every device and ring step; its
  operands in the layout's order. Per (query head, tile pair), the unit of the run-time
  walk (codes: `kernel_hash.computed_tiles`, the pair sorted as the ring sorts it)."""
  heads = variant[1].shape[2]
  causal = int(schedule.computed_tiles(tile).sum()) * batch * heads
  block, total = schedule.block_len, 0
  if variant[0].selects:  # SparseK: the devices' own indices (its window reads distances)
    count = jax.jit(lambda mask, qi, ki: kernel_sparsek.computed_tiles(mask, qi, ki, tile))
  else:
    count = jax.jit(lambda mask, qi, ki: kernel_hash.computed_tiles(mask, tile, qi, ki))
  for device in range(schedule.num_shards):
    for step in range(schedule.num_shards):
      if schedule.shapes[schedule.pair[device, step]] == "empty":
        continue  # the ring skips the kernel
      kb = held_block(device, step, schedule.num_shards)
      spec, q_side, k_side = variant
      pair = (spec, q_side[:, device * block:(device + 1) * block],
              k_side[:, kb * block:(kb + 1) * block])
      total += int(count(mask_of(pair), schedule.order[device], schedule.order[kb]))
  return causal, total


def visible_fraction(variant) -> float:
  """The visible (query head, key) pairs of a coded variant over causal attention's: each
  query's keys with its code at or before it (one row, no documents, in original order)."""
  _, q_codes, k_codes = (np.asarray(x) for x in variant)
  batch, seq_len, heads = q_codes.shape
  group = heads // k_codes.shape[2]
  seen = 0
  for b in range(batch):
    for h in range(heads):
      q_S, k_S = q_codes[b, :, h], k_codes[b, :, h // group]
      values = np.unique(np.concatenate([q_S, k_S]))
      # Keys of each code at or before each position, read at each query's own code.
      before_SV = np.cumsum(k_S[:, None] == values[None, :], axis=0)
      seen += int(before_SV[np.arange(seq_len), np.searchsorted(values, q_S)].sum())
  return seen / (batch * heads * seq_len * (seq_len + 1) / 2)


def measure(steps, args, variants: dict, repeats: int) -> dict:
  """{(variant, 'fwd'|'fwd_bwd'): [seconds per repeat]}, every variant timed back to back
  within each repeat after one warm-up call each (which also compiles)."""
  times = {}
  for name, codes in variants.items():
    for kind, fn in zip(("fwd", "fwd_bwd"), steps):
      jax.block_until_ready(fn(*args, mask_of(codes)))
      times[name, kind] = []
  for _ in range(repeats):
    for name, codes in variants.items():
      for kind, fn in zip(("fwd", "fwd_bwd"), steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, mask_of(codes)))
        times[name, kind].append(time.perf_counter() - start)
  return times


def run_part(part: str, seq_len: int, args, schedule, steps, bucket_list, drop_rates,
             repeats, tile: int, perm, keeps=(), scores: str = "iid",
             place=lambda x: x, control: bool = True) -> list[dict]:
  """One row per variant; `perm` puts an array in the layout's order (NumPy, which the tile
  counts read), `place` on the devices where the timed steps take it. `control`: also
  `hash-1`, one bucket: the run-time walk on the causal mask, which separates the walk's own
  speed per tile from what the buckets skip (its slowest variant)."""
  q, k = args[:2]
  one = (hash_spec(2), jnp.zeros(q.shape[:3], jnp.int32), jnp.zeros(k.shape[:3], jnp.int32))
  variants = {"causal": None} | ({"hash-1": one} if control else {})
  variants |= {f"hash-{b}": (hash_spec(b), *codes_of(q, k, b)) for b in bucket_list}
  variants |= {f"drop-{r}": (MaskSpec(sparse="qk_drop", qk_drop_rate=r),
                             *drop_codes(q.shape[0], seq_len, q.shape[2], k.shape[2], r,
                                         jnp.int32(0), "ring")) for r in drop_rates}
  variants |= {f"sparsek-{n}": (MaskSpec(sparse="sparsek", sparsek_k=n, sparsek_window=tile),
                                *sparsek_codes(q, k, n, tile, scores)) for n in keeps}
  # The visible pairs of coded variants, in the original order (before the layout's).
  ideals = {name: visible_fraction(c) for name, c in variants.items()
            if c is not None and c[0].coded}
  variants = {name: None if c is None else (c[0], *map(perm, c[1:]))
              for name, c in variants.items()}
  args = [place(perm(x)) for x in args]
  times = measure(steps, args, {name: None if c is None else (c[0], *map(place, c[1:]))
                                for name, c in variants.items()}, repeats)
  rows = []
  for name, codes in variants.items():
    row = dict(part=part, layout=schedule.layout, shards=schedule.num_shards, seq_len=seq_len,
               batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
               dtype=str(q.dtype), tile=tile, variant=name, repeats=repeats)
    if codes is not None:
      causal_tiles, hash_tiles = tile_counts(schedule, tile, codes, q.shape[0])
      kind, value = name.split("-")
      # Lambdas: only this kind's value parses (int('0.5') would fail).
      option, ideal = {
          "hash": lambda: ({"buckets": int(value)}, ideals[name]),
          "drop": lambda: ({"drop_rate": float(value)}, ideals[name]),
          "sparsek": lambda: ({"sparsek_k": int(value), "sparsek_window": tile,
                               "sparsek_scores": scores},
                              min(1.0, (int(value) + tile) / ((seq_len + 1) / 2)))}[kind]()
      row |= dict(tiles=hash_tiles, causal_tiles=causal_tiles, ideal=ideal,
                  tile_ratio=hash_tiles / causal_tiles, **option)
    for kind in ("fwd", "fwd_bwd"):
      mine, base = times[name, kind], times["causal", kind]
      row[f"{kind}_s"] = statistics.median(mine)
      row[f"{kind}_ratio"] = statistics.median(a / b for a, b in zip(mine, base))
    rows.append(row)
  return rows


def threshold_row(seq_len: int, k, keep: int, window: int, causal: dict, repeats: int) -> dict:
  """SparseK's prefix thresholds of one row's scores, forward and forward+VJP, timed against
  the median causal times of the same part."""
  u = 4.0 * jax.random.normal(jax.random.key(7), k.shape[:3], jnp.float32)
  seg = jnp.zeros(k.shape[:2], jnp.int32)
  fwd = jax.jit(lambda u: prefix_thresholds(u, seg, keep, window))
  total = lambda u: jnp.sum(jnp.where(jnp.isfinite(fwd(u)), fwd(u), 0.0))
  steps = (fwd, jax.jit(jax.grad(total)))
  row = dict(part="block", layout="ring", shards=1, seq_len=seq_len, batch=k.shape[0],
             heads=k.shape[2], kv_heads=k.shape[2], head_dim=k.shape[3], dtype="float32",
             tile=window, variant="sparsek-thresholds", repeats=repeats, sparsek_k=keep)
  for kind, fn in zip(("fwd", "fwd_bwd"), steps):
    jax.block_until_ready(fn(u))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(u))
      times.append(time.perf_counter() - start)
    row[f"{kind}_s"] = statistics.median(times)
    row[f"{kind}_ratio"] = row[f"{kind}_s"] / causal[kind]
  return row


def ring2_part(args, shape, buckets, rates, keeps) -> list[dict]:
  """Part ring2 in one of its 2 processes: ring_attention over one CPU device per process.
  Both make the same inputs (same seeds); each device is handed only its own block."""
  jax.distributed.initialize(args.coordinator, 2, args.process_id)
  n, seq_len = jax.device_count(), args.ring2_seq_len
  mesh = jax.make_mesh((n,), ("sequence",))
  on_ring = NamedSharding(mesh, P(None, "sequence"))
  place = lambda x: jax.make_array_from_callback(x.shape, on_ring, lambda index: x[index])
  perm = lambda x: permute(np.asarray(x), args.layout, n)
  rows = run_part("ring2", seq_len, inputs(args.batch, seq_len, *shape[1:]),
                  ring_schedule(args.layout, seq_len, n), ring_step(mesh, args.layout, args.tile),
                  buckets, rates, args.repeats, args.tile, perm, keeps, args.sparsek_scores,
                  place)
  return [row | dict(processes=jax.process_count()) for row in rows]


def start_ring2() -> None:
  """Runs this script's command line again as part ring2's 2 processes, one per core."""
  two_cores.run(lambda index, address: [
      sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--part=ring2",
      f"--process_id={index}", f"--coordinator={address}"], two_cores.cores(), "part ring2")


def print_table(rows: list[dict]) -> None:
  print(f"{'part':<6}{'layout':<8}{'N':>3}{'seq':>7}{'variant':>19}{'tiles/causal':>14}"
        f"{'fwd s':>9}{'fwd/causal':>12}{'f+b s':>9}{'f+b/causal':>12}{'ideal':>7}")
  for r in rows:
    ideal = f"{r['ideal']:.3f}" if "ideal" in r else ""
    tiles = f"{r['tile_ratio']:.3f}" if "tile_ratio" in r else "1.000"
    print(f"{r['part']:<6}{r['layout']:<8}{r['shards']:>3}{r['seq_len']:>7}{r['variant']:>19}"
          f"{tiles:>14}{r['fwd_s']:>9.3f}{r['fwd_ratio']:>12.3f}{r['fwd_bwd_s']:>9.3f}"
          f"{r['fwd_bwd_ratio']:>12.3f}{ideal:>7}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("all", "block", "ring", "ring2"), default="all")
  parser.add_argument("--seq_lens", default=None,
                      help="block part (default 4096,8192,16384; with --gpu 8192,16384,32768)")
  parser.add_argument("--ring_seq_len", type=int, default=16384)
  parser.add_argument("--ring2_seq_len", type=int, default=8192,
                      help="part ring2 (default 8192: the part in a few minutes on 2 cores)")
  parser.add_argument("--layout", choices=LAYOUTS, default="zigzag")
  parser.add_argument("--buckets", default="2,4,8,16,32,64", help="'' for none")
  parser.add_argument("--drop_rates", default="0.2,0.5,0.8",
                      help="QK-dropping (model.dropping's codes); '' for none")
  parser.add_argument("--sparsek", default="256,1024",
                      help="SparseK's keys per query (window: one tile); '' for none")
  parser.add_argument("--sparsek_scores", choices=("iid", "recent"), default="iid")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=2)
  parser.add_argument("--kv_heads", type=int, default=2)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--tile", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--gpu", action="store_true",
                      help="SCFA's settings: bf16, B=4, H=48, D=64, 8k-32k, block part only")
  # Set by start_ring2 on the command lines of part ring2's processes.
  parser.add_argument("--process_id", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", help=argparse.SUPPRESS)
  args = parser.parse_args()
  dtype, part = jnp.float32, args.part
  seq_lens = args.seq_lens or "4096,8192,16384"
  if args.gpu:
    args.batch, args.heads, args.kv_heads, args.head_dim = 4, 48, 48, 64
    dtype, seq_lens, part = jnp.bfloat16, args.seq_lens or "8192,16384,32768", "block"
  seq_lens = [int(s) for s in seq_lens.split(",")]
  buckets = [int(b) for b in args.buckets.split(",") if b]
  rates = [float(r) for r in args.drop_rates.split(",") if r]
  keeps = [int(n) for n in args.sparsek.split(",") if n]
  shape = (args.batch, args.heads, args.kv_heads, args.head_dim, dtype)
  if _RING2_PROCESS:
    rows = ring2_part(args, shape, buckets, rates, keeps)
    if jax.process_index() == 0:  # one writer
      record(rows)
      print(f"\npart ring2 ({len(rows)} rows appended to results/{RESULTS}):")
      print_table(rows)
    return
  rows = []
  if part in ("all", "block"):
    for seq_len in seq_lens:
      schedule = ring_schedule("ring", seq_len, 1)
      rows += run_part("block", seq_len, inputs(args.batch, seq_len, *shape[1:]), schedule,
                       block_step(schedule, args.tile), buckets, rates, args.repeats,
                       args.tile, lambda x: x, keeps, args.sparsek_scores)
      causal = next(r for r in rows[::-1] if r["variant"] == "causal")
      if keeps:
        rows.append(threshold_row(seq_len, inputs(args.batch, seq_len, *shape[1:])[1], keeps[0],
                                  args.tile, {kind: causal[f"{kind}_s"]
                                              for kind in ("fwd", "fwd_bwd")}, args.repeats))
      print_table(rows[-len(buckets) - len(rates) - len(keeps) - 2 - bool(keeps):])
  if part in ("all", "ring"):
    n, seq_len = len(jax.devices()), args.ring_seq_len
    mesh = jax.make_mesh((n,), ("sequence",))
    schedule = ring_schedule(args.layout, seq_len, n)
    perm = lambda x: permute(np.asarray(x), args.layout, n)
    rows += run_part("ring", seq_len, inputs(args.batch, seq_len, *shape[1:]), schedule,
                     ring_step(mesh, args.layout, args.tile), buckets, rates, args.repeats,
                     args.tile, perm, keeps, args.sparsek_scores)
  if rows:
    record(rows)
    print(f"\nall rows ({len(rows)} appended to results/{RESULTS}):")
    print_table(rows)
  if part in ("all", "ring2"):
    print(f"\npart ring2: 2 processes, one core each, {args.ring2_seq_len} tokens", flush=True)
    start_ring2()


if __name__ == "__main__":
  main()
