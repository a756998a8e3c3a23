"""Hash attention (SCFA, issue #38) against causal attention: time and computed tile pairs.

  python scripts/bench_sparse.py                                  # CPU: block, then ring
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
- tiles: (query head, query tile, key tile) pairs computed, summed over devices and ring
  steps: causal from the static schedule, hash from the kernel's own run-time rule
  (`kernel_hash.computed_tiles`). Ideal ratio about 1/buckets; the rule also computes each
  bucket's ragged edge tiles, which weigh more as buckets get fewer tiles each.
- drop-r: QK-dropping at rate r through the same codes (`model.dropping`: kept 0, dropped
  queries 1, dropped keys 2), so the same walk; ideal ratio (1 - r)^2.
- hash-1: every code equal, so the mask is causal: the run-time walk (sorted rows, one head
  per matmul, every tile masked) against the static kernel at about the same tiles. Its
  time ratio is the walk's own cost per tile; hash-b's ratio is that times the tiles saved.

`--gpu`: SCFA's settings (bf16, B=4, H=48, D=64, 8k to 32k tokens, tile 128), block part
only, on whatever one device JAX finds (not run yet: the walk is one head per tile pair, so
on a GPU each step is a few small launches; expect it launch-bound, not 1/buckets).
"""

import os
import sys

if __name__ == "__main__":
  if "--gpu" not in sys.argv:  # before JAX starts: the ring part's 8 CPU devices
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
import numpy as np  # noqa: E402

from model.dropping import drop_codes  # noqa: E402
from model.hashing import bucket_codes, projections  # noqa: E402
from parallelism import kernel_hash, kernel_xla  # noqa: E402
from parallelism.layouts import LAYOUTS, permute  # noqa: E402
from parallelism.ring_attention import ring_attention  # noqa: E402
from parallelism.schedule import held_block, ring_schedule  # noqa: E402
import bench_results  # noqa: E402  (scripts/, first on the path)

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


def block_step(schedule, tile: int):
  """Forward, and forward+backward, of one block pair (ring_attention's custom_vjp order)."""
  at = dict(schedule=schedule, pair=jnp.int32(0), tile=tile)

  def fwd(q, k, v, dout, codes):
    return kernel_xla.block_fwd(q, k, v, None, None, **at, **_code_args(codes))

  def fwd_bwd(q, k, v, dout, codes):
    out, lse = fwd(q, k, v, dout, codes)
    delta = jnp.sum(out * dout.astype(jnp.float32), axis=-1)
    return kernel_xla.block_bwd(q, k, v, dout, lse, delta, None, None, out_BTHD=out, **at,
                                **_code_args(codes))
  return jax.jit(fwd), jax.jit(fwd_bwd)


def _code_args(codes) -> dict:
  return {} if codes is None else dict(q_codes_BTH=codes[0], k_codes_BTK=codes[1])


def ring_step(mesh, layout: str, tile: int):
  """Forward, and forward+backward, of ring_attention on `mesh` (inputs already permuted)."""
  def fwd(q, k, v, dout, codes):
    return ring_attention(q, k, v, layout=layout, mesh=mesh, kernel="xla", tile_size=tile,
                          **({} if codes is None else dict(q_buckets=codes[0],
                                                           k_buckets=codes[1])))

  def fwd_bwd(q, k, v, dout, codes):
    out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, dout, codes), q, k, v)
    return vjp(dout)
  return jax.jit(fwd), jax.jit(fwd_bwd)


def tile_counts(schedule, tile: int, codes, batch: int) -> tuple[int, int]:
  """(causal, hash) tile pairs computed over every device and ring step; `codes` in the
  layout's order. Per (query head, tile pair), the unit of hash attention's walk."""
  heads = codes[0].shape[2]
  causal = int(schedule.computed_tiles(tile).sum()) * batch * heads
  block, total = schedule.block_len, 0
  count = jax.jit(lambda qc, kc, qi, ki, qr, kr: kernel_hash.computed_tiles(
      qc, kc, None, None, qi, ki, tile=tile, window=schedule.window, q_run_T=qr, k_run_T=kr))
  (q_index_PT, k_index_PT), (q_run_PT, k_run_PT) = (schedule.pair_index,
                                                    kernel_hash.pair_runs(schedule))
  for device in range(schedule.num_shards):
    for step in range(schedule.num_shards):
      p = schedule.pair[device, step]
      if schedule.shapes[p] == "empty":
        continue  # the ring skips the kernel
      kb = held_block(device, step, schedule.num_shards)
      total += int(count(codes[0][:, device * block:(device + 1) * block],
                         codes[1][:, kb * block:(kb + 1) * block], q_index_PT[p], k_index_PT[p],
                         q_run_PT[p], k_run_PT[p]))
  return causal, total


def measure(steps, args, variants: dict, repeats: int) -> dict:
  """{(variant, 'fwd'|'fwd_bwd'): [seconds per repeat]}, every variant timed back to back
  within each repeat after one warm-up call each (which also compiles)."""
  times = {}
  for name, codes in variants.items():
    for kind, fn in zip(("fwd", "fwd_bwd"), steps):
      jax.block_until_ready(fn(*args, codes))
      times[name, kind] = []
  for _ in range(repeats):
    for name, codes in variants.items():
      for kind, fn in zip(("fwd", "fwd_bwd"), steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, codes))
        times[name, kind].append(time.perf_counter() - start)
  return times


def run_part(part: str, seq_len: int, args, schedule, steps, bucket_list, drop_rates,
             repeats, tile: int, perm) -> list[dict]:
  q, k = args[:2]
  # One bucket: the run-time walk on the causal mask, the control that separates the walk's
  # own speed per tile from what the buckets skip.
  one = (jnp.zeros(q.shape[:3], jnp.int32), jnp.zeros(k.shape[:3], jnp.int32))
  variants = {"causal": None, "hash-1": one}
  variants |= {f"hash-{b}": codes_of(q, k, b) for b in bucket_list}
  variants |= {f"drop-{r}": drop_codes(q.shape[0], seq_len, q.shape[2], k.shape[2], r,
                                       jnp.int32(0), "ring") for r in drop_rates}
  variants = {name: None if c is None else tuple(perm(x) for x in c)
              for name, c in variants.items()}
  args = [perm(x) for x in args]
  times = measure(steps, args, variants, repeats)
  rows = []
  for name, codes in variants.items():
    row = dict(part=part, layout=schedule.layout, shards=schedule.num_shards, seq_len=seq_len,
               batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
               dtype=str(q.dtype), tile=tile, variant=name, repeats=repeats)
    if codes is not None:
      causal_tiles, hash_tiles = tile_counts(schedule, tile, codes, q.shape[0])
      kind, value = name.split("-")
      ideal = 1 / int(value) if kind == "hash" else (1 - float(value)) ** 2
      row |= dict(tiles=hash_tiles, causal_tiles=causal_tiles, ideal=ideal,
                  tile_ratio=hash_tiles / causal_tiles,
                  **({"buckets": int(value)} if kind == "hash" else {"drop_rate": float(value)}))
    for kind in ("fwd", "fwd_bwd"):
      mine, base = times[name, kind], times["causal", kind]
      row[f"{kind}_s"] = statistics.median(mine)
      row[f"{kind}_ratio"] = statistics.median(a / b for a, b in zip(mine, base))
    rows.append(row)
  return rows


def print_table(rows: list[dict]) -> None:
  print(f"{'part':<6}{'layout':<8}{'N':>3}{'seq':>7}{'variant':>10}{'tiles/causal':>14}"
        f"{'fwd s':>9}{'fwd/causal':>12}{'f+b s':>9}{'f+b/causal':>12}{'ideal':>7}")
  for r in rows:
    ideal = f"{r['ideal']:.3f}" if "ideal" in r else ""
    tiles = f"{r['tile_ratio']:.3f}" if "tile_ratio" in r else "1.000"
    print(f"{r['part']:<6}{r['layout']:<8}{r['shards']:>3}{r['seq_len']:>7}{r['variant']:>10}"
          f"{tiles:>14}{r['fwd_s']:>9.3f}{r['fwd_ratio']:>12.3f}{r['fwd_bwd_s']:>9.3f}"
          f"{r['fwd_bwd_ratio']:>12.3f}{ideal:>7}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("all", "block", "ring"), default="all")
  parser.add_argument("--seq_lens", default=None,
                      help="block part (default 4096,8192,16384; with --gpu 8192,16384,32768)")
  parser.add_argument("--ring_seq_len", type=int, default=16384)
  parser.add_argument("--layout", choices=LAYOUTS, default="zigzag")
  parser.add_argument("--buckets", default="2,4,8,16,32,64", help="'' for none")
  parser.add_argument("--drop_rates", default="0.2,0.5,0.8",
                      help="QK-dropping (model.dropping's codes); '' for none")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=2)
  parser.add_argument("--kv_heads", type=int, default=2)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--tile", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--gpu", action="store_true",
                      help="SCFA's settings: bf16, B=4, H=48, D=64, 8k-32k, block part only")
  args = parser.parse_args()
  dtype, part = jnp.float32, args.part
  seq_lens = args.seq_lens or "4096,8192,16384"
  if args.gpu:
    args.batch, args.heads, args.kv_heads, args.head_dim = 4, 48, 48, 64
    dtype, seq_lens, part = jnp.bfloat16, args.seq_lens or "8192,16384,32768", "block"
  seq_lens = [int(s) for s in seq_lens.split(",")]
  buckets = [int(b) for b in args.buckets.split(",") if b]
  rates = [float(r) for r in args.drop_rates.split(",") if r]
  shape = (args.batch, args.heads, args.kv_heads, args.head_dim, dtype)
  rows = []
  if part in ("all", "block"):
    for seq_len in seq_lens:
      schedule = ring_schedule("ring", seq_len, 1)
      rows += run_part("block", seq_len, inputs(args.batch, seq_len, *shape[1:]), schedule,
                       block_step(schedule, args.tile), buckets, rates, args.repeats,
                       args.tile, lambda x: x)
      print_table(rows[-len(buckets) - len(rates) - 2:])
  if part in ("all", "ring"):
    n, seq_len = len(jax.devices()), args.ring_seq_len
    mesh = jax.make_mesh((n,), ("sequence",))
    schedule = ring_schedule(args.layout, seq_len, n)
    perm = lambda x: permute(np.asarray(x), args.layout, n)
    rows += run_part("ring", seq_len, inputs(args.batch, seq_len, *shape[1:]), schedule,
                     ring_step(mesh, args.layout, args.tile), buckets, rates, args.repeats,
                     args.tile, perm)
  record(rows)
  print(f"\nall rows ({len(rows)} appended to results/{RESULTS}):")
  print_table(rows)


if __name__ == "__main__":
  main()
