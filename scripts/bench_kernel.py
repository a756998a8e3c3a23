"""The Pallas block kernel on one GPU: vs cuDNN, and the ring / striped / zigzag schedule.

  PYTHONPATH=. python3 scripts/bench_kernel.py                    # check, sweep, cudnn, ring

`make gpu_check` (scripts/gpu_check.py) runs the kernel, ring and `python -m trainer`
figures in one call; this script is for deeper kernel work (tile sweeps, the Triton check).

Parts (each appends JSON lines to results/bench_kernel.jsonl):
- check: the Pallas kernel (Triton, float32 inputs) against the `xla` kernel on ring,
  striped and zigzag block pairs with GQA and packed segments: max relative errors.
- sweep: a few tile / warp / stage settings on one causal block (S=--sweep_seq_len); the
  fastest forward and backward settings are used below.
- cudnn_kernel: the `cudnn` block kernel (parallelism/kernel_cudnn.py) against the Pallas
  one on the same causal and strictly causal blocks (a ring of one; striped's cross-device
  block at N=2), bf16, B=1, 32 heads, head_dim 128:
  TFLOP/s forward and forward+backward, and each kernel's relative error against the xla
  reference on the same inputs.
- cudnn: one causal block (a ring of one device, no segment ids), bf16, B=1, 32 heads,
  head_dim 128: ours vs `jax.nn.dot_product_attention(implementation='cudnn',
  is_causal=True)`, TFLOP/s forward and forward+backward and the ratio, plus the relative
  error of our output and gradients against cuDNN's on the same inputs. FLOPs: forward
  4*B*H*S^2*D/2 (causal half), forward+backward 3.5x that (FlashAttention's count: the
  backward's five matmuls, QK^T recomputed), the same for both sides.
- ring: the N-device ring emulated on one GPU. For each layout, ring step s and device d,
  the query block of d and the key block that started on d - s (the layout's static
  schedule, `parallelism.schedule`) go through our block kernel. The kernel's work is
  fixed by the class matrix of its tile pairs at its tile sizes, so each distinct
  (forward, dK/dV, dQ) class triple is timed once and reused for every pair with the same
  triple. A step costs max(busiest device, link time), because
  `ring_attention` issues the transfer before computing: forward sends K/V (bf16), the
  backward sends K/V and the float32 dK/dV accumulators (one step behind, and home after
  the last step), over each link of `--links` (NVLink and a 400 Gb/s link between nodes
  by default), from the same timings. Critical path = sum over steps. Reported as ideal /
  critical path with ideal = N x t(causal block); ring should be near N/(2N-1). The
  log-sum-exp merges
  and delta are left out (elementwise, the same for every layout).
Timing: warm-up calls, then the median of repeats, each call synchronised with
block_until_ready (perf_counter around it); every input random normal, never zeros.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from parallelism import kernel_pallas, kernel_xla  # noqa: E402
from parallelism.kernels import KERNELS  # noqa: E402
from parallelism.layouts import LAYOUTS  # noqa: E402
from parallelism.kernel_grads import Merged  # noqa: E402
from parallelism.masks import Mask, MaskSpec, Side  # noqa: E402
from parallelism.schedule import ring_schedule  # noqa: E402
from trainer.config import flops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results", "bench_kernel.jsonl")
TILE = 512  # ring_attention's default tile_size; the kernel clips its own tiles to it
F32, BF16 = jnp.float32, jnp.bfloat16
_STAMP = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def record(device: str | None = None, **row) -> None:
  """Appends one JSON line at once, so a later part that fails loses nothing before it."""
  line = json.dumps(dict(time=_STAMP, device=device or jax.devices()[0].device_kind, **row),
                    default=float)
  paths = [RESULTS]
  if os.environ.get("OUT"):  # the device machine hands back only what is under $OUT
    paths.append(os.path.join(os.environ["OUT"], "bench_kernel.jsonl"))
  for path in paths:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
      f.write(line + "\n")


def median_time(fn, *args, warmup: int = 2, repeats: int = 7) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.isfinite(a).all(), "NaN/inf in the kernel's output"
  norm = np.linalg.norm(b)
  return float(np.linalg.norm(a - b) / norm) if norm else float(np.linalg.norm(a))


def normals(key, shapes, dtype):
  keys = jax.random.split(key, len(shapes))
  return [jax.random.normal(k, s, F32).astype(dtype) for k, s in zip(keys, shapes)]


def fwd_bwd(block_fwd, block_bwd, schedule, tile: int = TILE):
  """Forward then backward of one block pair, as ring_attention's custom_vjp runs them."""
  def run(q, k, v, dout, pair, qs=None, ks=None):
    at = dict(schedule=schedule, pair=pair, tile=tile)
    mask = Mask(MaskSpec(schedule.window), Side(qs), Side(ks))
    out, lse = block_fwd(q, k, v, mask, **at)
    delta = jnp.sum(out * dout.astype(F32), axis=-1)
    # The global out is the block's own here (one block); cuDNN's backward takes it.
    grads = block_bwd(q, k, v, mask, Merged(out, lse, dout, delta), **at)
    return (grads.dq, grads.dk, grads.dv), out, lse
  return run


def causal_block(seq_len: int):
  """A ring of one device: its only block pair is one causal block."""
  return ring_schedule("ring", seq_len, 1), jnp.int32(0)


def strictly_causal_block(seq_len: int):
  """Striped at N=2: device 0's queries on device 1's keys (step 1) are strictly causal."""
  schedule = ring_schedule("striped", 2 * seq_len, 2)
  pair = int(schedule.pair[0, 1])
  assert schedule.shapes[pair] == "strictly_causal", schedule.shapes
  return schedule, jnp.int32(pair)


def part_check() -> None:
  """Triton kernel vs the xla reference (float32, highest matmul precision)."""
  n, c, heads, kv, d = 4, 1024, 8, 2, 128
  q, k, v, dout = normals(jax.random.key(1), [(2, c, heads, d), (2, c, kv, d), (2, c, kv, d),
                                              (2, c, heads, d)], F32)
  seg = np.zeros((2, n * c), np.int32)
  seg[1, 1500:] = 1
  seg[1, 3000:] = 2  # packed row: three documents
  print("\ncheck: pallas (Triton, f32) vs xla kernel, max rel error over pairs")
  for layout in LAYOUTS:
    schedule = ring_schedule(layout, n * c, n)
    ours = jax.jit(fwd_bwd(kernel_pallas.block_fwd, kernel_pallas.block_bwd, schedule))
    ref = jax.jit(fwd_bwd(kernel_xla.block_fwd, kernel_xla.block_bwd, schedule))
    worst = {}
    for dq_dev, dk_dev in ((2, 1), (1, 2), (2, 2), (3, 0)):
      pair = jnp.int32(schedule.pair[dq_dev, (dq_dev - dk_dev) % n])
      qs, ks = (np.take_along_axis(seg, np.stack([schedule.order[x]] * 2), axis=1)
                for x in (dq_dev, dk_dev))
      with jax.default_matmul_precision("highest"):
        (g_ref, o_ref, l_ref) = ref(q, k, v, dout, pair, qs, ks)
      (g, o, lse) = ours(q, k, v, dout, pair, qs, ks)
      seen = np.isfinite(np.asarray(l_ref))
      assert (np.isfinite(np.asarray(lse)) == seen).all(), "lse -inf pattern differs"
      errs = dict(out=rel_err(o, o_ref),
                  lse=rel_err(np.where(seen, lse, 0), np.where(seen, l_ref, 0)),
                  **{name: rel_err(g[i], g_ref[i]) for i, name in enumerate(("dq", "dk", "dv"))})
      worst = {key: max(worst.get(key, 0.0), e) for key, e in errs.items()}
    print(f"  {layout:>8}: " + " ".join(f"{key} {e:.1e}" for key, e in worst.items()))
    record(part="check", layout=layout, block=c, heads=heads, kv_heads=kv, **worst)


def _causal_fwd_flops(seq_len: int, heads: int = 32, d: int = 128) -> float:
  """Forward FLOPs of causal attention on `_causal_inputs` (QK^T and PV, half of them)."""
  return 4 * heads * seq_len ** 2 * d / 2


def _causal_inputs(seq_len: int, heads: int = 32, d: int = 128, seed: int = 0):
  return normals(jax.random.key(seed), [(1, seq_len, heads, d)] * 4, BF16)


def _ours(config):
  fwd = functools.partial(kernel_pallas.block_fwd, config=config)
  bwd = functools.partial(kernel_pallas.block_bwd, config=config)
  return fwd, bwd


def part_sweep(seq_len: int) -> kernel_pallas.KernelConfig:
  """Times a few settings on one causal block; returns the fastest forward + backward."""
  fwd_opts = [dict(fwd_q=64, fwd_k=64, fwd_warps=4, fwd_stages=3),
              dict(fwd_q=64, fwd_k=64, fwd_warps=4, fwd_stages=2),
              dict(fwd_q=128, fwd_k=64, fwd_warps=4, fwd_stages=3),
              dict(fwd_q=128, fwd_k=64, fwd_warps=8, fwd_stages=2),
              dict(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=3),
              dict(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=2)]
  bwd_opts = [dict(dkv_k=64, dkv_q=64, dq_q=64, dq_k=64, bwd_warps=4, bwd_stages=2),
              dict(dkv_k=64, dkv_q=64, dq_q=64, dq_k=64, bwd_warps=4, bwd_stages=3),
              dict(dkv_k=64, dkv_q=64, dq_q=128, dq_k=64, bwd_warps=4, bwd_stages=2),
              dict(dkv_k=64, dkv_q=128, dq_q=128, dq_k=64, bwd_warps=4, bwd_stages=2),
              dict(dkv_k=64, dkv_q=128, dq_q=128, dq_k=64, bwd_warps=8, bwd_stages=2),
              dict(dkv_k=64, dkv_q=32, dq_q=64, dq_k=32, bwd_warps=4, bwd_stages=2),
              dict(dkv_k=128, dkv_q=64, dq_q=128, dq_k=64, bwd_warps=8, bwd_stages=2)]
  q, k, v, dout = _causal_inputs(seq_len)
  schedule, pair = causal_block(seq_len)
  at = dict(schedule=schedule, tile=TILE)
  fwd_flops = _causal_fwd_flops(seq_len)
  best = {"fwd": (None, np.inf), "bwd": (None, np.inf)}
  out, lse = jax.jit(functools.partial(kernel_pallas.block_fwd, **at))(
      q, k, v, Mask(), pair=pair)
  delta = jnp.sum(out * dout.astype(F32), axis=-1)
  print(f"\nsweep at S={seq_len}, 32 heads: TFLOP/s (bwd counted as 2.5x fwd FLOPs)")
  for what, options, flops in (("fwd", fwd_opts, fwd_flops), ("bwd", bwd_opts, 2.5 * fwd_flops)):
    for opts in options:
      cfg = dataclasses.replace(kernel_pallas.DEFAULT_CONFIG, **opts)
      if what == "fwd":
        fn = jax.jit(lambda *a, pair, cfg=cfg: kernel_pallas.block_fwd(
            *a, Mask(), pair=pair, config=cfg, **at))
        args = (q, k, v)
      else:
        fn = jax.jit(lambda q, k, v, dout, lse, delta, pair, cfg=cfg: kernel_pallas.block_bwd(
            q, k, v, Mask(), Merged(None, lse, dout, delta), pair=pair, config=cfg, **at))
        args = (q, k, v, dout, lse, delta)
      fn = functools.partial(fn, pair=pair)
      try:
        t = median_time(fn, *args, repeats=5)
      except Exception as e:  # a setting Triton cannot compile (shared memory, registers)
        print(f"  {what} {opts}: failed {type(e).__name__}: {str(e)[:120]}")
        continue
      print(f"  {what} {opts}: {flops / t / 1e12:6.1f}")
      record(part="sweep", what=what, seq_len=seq_len, **opts, tflops=flops / t / 1e12)
      best[what] = min(best[what], (opts, t), key=lambda x: x[1])
  print(f"  best fwd {best['fwd'][0]}\n  best bwd {best['bwd'][0]}")
  return dataclasses.replace(kernel_pallas.DEFAULT_CONFIG, **best["fwd"][0], **best["bwd"][0])


def part_cudnn(config, seq_lens) -> None:
  fwd, bwd = _ours(config)
  attend = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                             implementation="cudnn")
  cudnn_f = jax.jit(attend)
  cudnn_fb = jax.jit(lambda q, k, v, dout: jax.vjp(attend, q, k, v)[1](dout))
  print(f"\ncudnn: B=1, 32 heads, head_dim 128, bf16, causal; config {config}")
  print(f"{'S':>6} {'ours fwd':>9} {'cudnn fwd':>9} {'ratio':>6} {'ours f+b':>9} {'cudnn f+b':>9}"
        f" {'ratio':>6}  rel err vs cudnn (out, dq, dk, dv)")
  for seq_len in seq_lens:
    q, k, v, dout = _causal_inputs(seq_len, seed=seq_len)
    schedule, pair = causal_block(seq_len)
    ours_f = jax.jit(lambda q, k, v, pair: fwd(q, k, v, Mask(), schedule=schedule,
                                               pair=pair, tile=TILE))
    ours_fb = jax.jit(fwd_bwd(fwd, bwd, schedule))
    fwd_flops = _causal_fwd_flops(seq_len)
    (dq, dk, dv), out, _ = ours_fb(q, k, v, dout, pair)
    ref_out = cudnn_f(q, k, v)
    ref_dq, ref_dk, ref_dv = cudnn_fb(q, k, v, dout)
    errs = [rel_err(out, ref_out), rel_err(dq, ref_dq), rel_err(dk, ref_dk), rel_err(dv, ref_dv)]
    times = [median_time(ours_f, q, k, v, pair), median_time(cudnn_f, q, k, v),
             median_time(ours_fb, q, k, v, dout, pair),
             median_time(cudnn_fb, q, k, v, dout)]
    tf = [fwd_flops / times[0], fwd_flops / times[1], 3.5 * fwd_flops / times[2],
          3.5 * fwd_flops / times[3]]
    tf = [x / 1e12 for x in tf]
    ref_tf = _jax_pallas_reference(q, k, v, dout, fwd_flops)
    print(f"{seq_len:>6} {tf[0]:>9.1f} {tf[1]:>9.1f} {tf[0] / tf[1]:>6.2f} {tf[2]:>9.1f} "
          f"{tf[3]:>9.1f} {tf[2] / tf[3]:>6.2f}  " + " ".join(f"{e:.1e}" for e in errs))
    record(part="cudnn", seq_len=seq_len, ours_fwd_tflops=tf[0], cudnn_fwd_tflops=tf[1],
           ratio_fwd=tf[0] / tf[1], ours_fwd_bwd_tflops=tf[2], cudnn_fwd_bwd_tflops=tf[3],
           ratio_fwd_bwd=tf[2] / tf[3], rel_err_out=errs[0], rel_err_dq=errs[1],
           rel_err_dk=errs[2], rel_err_dv=errs[3], seconds=times, config=dataclasses.asdict(config),
           jax_pallas_mha_tflops=ref_tf)


def part_cudnn_kernel(config, seq_lens) -> None:
  """The cudnn block kernel vs the Pallas one, both checked against the xla reference."""
  kernels = {"cudnn": tuple(KERNELS["cudnn"])[:2], "pallas": _ours(config)}
  print("\ncudnn_kernel: B=1, 32 heads, head_dim 128, bf16; TFLOP/s, rel err vs xla "
        "(out, dq, dk, dv)")
  for seq_len in seq_lens:
    q, k, v, dout = _causal_inputs(seq_len, seed=seq_len)
    fwd_flops = _causal_fwd_flops(seq_len)
    for shape, (schedule, pair) in (("causal", causal_block(seq_len)),
                                    ("strictly_causal", strictly_causal_block(seq_len))):
      (g_ref, o_ref, _) = jax.jit(fwd_bwd(kernel_xla.block_fwd, kernel_xla.block_bwd,
                                          schedule))(*(x.astype(F32) for x in (q, k, v, dout)),
                                                     pair)
      row = {}
      for name, (fwd, bwd) in kernels.items():
        f = jax.jit(lambda q, k, v, pair, fwd=fwd, schedule=schedule: fwd(
            q, k, v, Mask(), schedule=schedule, pair=pair, tile=TILE))
        fb = jax.jit(fwd_bwd(fwd, bwd, schedule))
        (dq, dk, dv), out, _ = fb(q, k, v, dout, pair)
        errs = [rel_err(out, o_ref), *(rel_err(g, w) for g, w in zip((dq, dk, dv), g_ref))]
        t_f, t_fb = median_time(f, q, k, v, pair), median_time(fb, q, k, v, dout, pair)
        row[name] = dict(fwd_tflops=fwd_flops / t_f / 1e12,
                         fwd_bwd_tflops=3.5 * fwd_flops / t_fb / 1e12, rel_errs=errs)
        print(f"{seq_len:>6} {shape:>15} {name:>6}: fwd {row[name]['fwd_tflops']:6.1f}  f+b "
              f"{row[name]['fwd_bwd_tflops']:6.1f}  " + " ".join(f"{e:.1e}" for e in errs))
      ratios = {f"cudnn_over_pallas_{what}": row["cudnn"][f"{what}_tflops"] /
                row["pallas"][f"{what}_tflops"] for what in ("fwd", "fwd_bwd")}
      print(f"{'':>22} cudnn / pallas: fwd {ratios['cudnn_over_pallas_fwd']:.2f}  f+b "
            f"{ratios['cudnn_over_pallas_fwd_bwd']:.2f}")
      record(part="cudnn_kernel", seq_len=seq_len, shape=shape, **row, **ratios,
             config=dataclasses.asdict(config))


def _jax_pallas_reference(q, k, v, dout, fwd_flops):
  """JAX's own Pallas-Triton flash attention (no index rule): the backend's ceiling here."""
  try:
    from jax.experimental.pallas.ops.gpu import attention
    mha = functools.partial(attention.mha, segment_ids=None, causal=True,
                            sm_scale=q.shape[-1] ** -0.5)
    f = jax.jit(mha)
    fb = jax.jit(lambda q, k, v, dout: jax.vjp(mha, q, k, v)[1](dout))
    tf = (fwd_flops / median_time(f, q, k, v) / 1e12,
          3.5 * fwd_flops / median_time(fb, q, k, v, dout) / 1e12)
    print(f"        jax.experimental.pallas.ops.gpu.attention.mha: fwd {tf[0]:.1f}, "
          f"f+b {tf[1]:.1f} TFLOP/s")
    return tf
  except Exception as e:  # reference only; its API moves between JAX versions
    print(f"        jax pallas mha reference failed: {type(e).__name__}: {str(e)[:200]}")
    return None


def _class_key(schedule, pair: int, config) -> bytes:
  """The kernel's work on a block pair: its class matrices at the three calls' tile sizes."""
  sizes = ((config.fwd_q, config.fwd_k), (config.dkv_q, config.dkv_k), (config.dq_q, config.dq_k))
  return b"|".join(schedule.tiles(min(bq, TILE), min(bk, TILE)).classes[pair].tobytes()
                   for bq, bk in sizes)


LINKS = flops.LINK_BYTES_PER_S  # what the ring part compares, bytes/s per direction


def critical_paths(t_SD2, t_causal, kv_s: float, dkv_s: float) -> dict[str, float]:
  """Critical path and fraction of ideal of a ring whose busiest device takes
  `t_SD2[step, device, (fwd, bwd)]`, over a link moving a K/V block in `kv_s` and its dK/dV
  in `dkv_s`. A step costs max(busiest device, its transfers): the forward sends the next
  K/V block at every step but the last; the backward also sends the dK/dV accumulator one
  step behind its block (from step 1 on), then, after the last step, home (nothing to
  overlap: added in full), as `parallelism.ring.backward_pass` does."""
  num_shards = t_SD2.shape[0]
  busiest_S2 = t_SD2.max(axis=1)
  steps = np.arange(num_shards)
  comm_f = np.where(steps == num_shards - 1, 0.0, kv_s)
  comm_b = comm_f + np.where(steps >= 1, dkv_s, 0.0)
  crit_f = np.maximum(busiest_S2[:, 0], comm_f).sum()
  crit_fb = crit_f + np.maximum(busiest_S2[:, 1], comm_b).sum() + dkv_s
  ideal_f, ideal_fb = num_shards * t_causal[0], num_shards * sum(t_causal)
  return dict(fraction_fwd=ideal_f / crit_f, fraction_fwd_bwd=ideal_fb / crit_fb,
              fraction_fwd_nocomm=ideal_f / busiest_S2[:, 0].sum(),
              fraction_fwd_bwd_nocomm=ideal_fb / busiest_S2.sum(),
              critical_fwd_s=crit_f, critical_fwd_bwd_s=crit_fb)


def part_ring(config, blocks, num_shards: int, heads: int, links=LINKS,
              record=record, kernel: str = "pallas") -> None:
  """Each layout's critical path on an N-device ring over each of `links` (name: bytes/s
  per direction), from the block kernel `kernel`'s time on each distinct block pair
  (`pallas` at `config`, or another registered kernel), timed once for all links."""
  fwd, bwd = _ours(config) if kernel == "pallas" else KERNELS[kernel][:2]
  print(f"\nring emulation, {kernel} blocks: N={num_shards}, {heads} heads (= kv heads), "
        f"head_dim 128, bf16; links (GB/s per direction) "
        f"{', '.join(f'{name} {bps / 1e9:g}' for name, bps in links.items())}; "
        f"fraction = N x t(causal) / critical")
  print(f"{'block':>6} {'link':>8} {'layout':>8} {'classes':>7} {'fwd':>6} {'f+b':>6} "
        f"{'fwd nocomm':>10} {'f+b nocomm':>10} {'ring/this f+b':>13}")
  for c in blocks:
    q, k, v, dout = normals(jax.random.key(c), [(1, c, heads, 128)] * 4, BF16)
    tile = min(TILE, c)  # as the ring clips it
    cache: dict[bytes, tuple[float, float]] = {}

    def programs(schedule):  # the kernel's forward and backward on the schedule's blocks
      at = dict(schedule=schedule, tile=tile)
      return (jax.jit(lambda q, k, v, pair: fwd(q, k, v, Mask(), pair=pair, **at)),
              jax.jit(lambda q, k, v, dout, out, lse, delta, pair: bwd(
                  q, k, v, Mask(), Merged(out, lse, dout, delta), pair=pair, **at)))

    # A causal block's out and lse: finite for every query, as a ring's global ones are
    # (cuDNN's backward takes the global out); its forward program is the one timed below.
    causal = causal_block(c)
    causal_programs = programs(causal[0])
    out, lse = causal_programs[0](q, k, v, causal[1])
    delta = jax.random.normal(jax.random.key(7), lse.shape, F32)

    def pair_time(schedule, pair: int, compiled=None):
      if schedule.shapes[pair] == "empty":
        return 0.0, 0.0  # the ring skips the kernel on a block pair with nothing visible
      key = _class_key(schedule, pair, config)
      if key not in cache:
        run_f, run_b = compiled or programs(schedule)
        pair = jnp.int32(pair)
        cache[key] = (median_time(run_f, q, k, v, pair, repeats=5),
                      median_time(run_b, q, k, v, dout, out, lse, delta, pair, repeats=5))
      return cache[key]

    t_causal = pair_time(*causal, causal_programs)
    times = {}
    for layout in LAYOUTS:
      schedule = ring_schedule(layout, num_shards * c, num_shards)
      times[layout] = np.array([[pair_time(schedule, schedule.pair[d, s])
                                 for d in range(num_shards)]
                                for s in range(num_shards)])  # [step, device, (fwd, bwd)]
    for link, bandwidth in links.items():
      kv_bytes, dkv_bytes = 2 * c * heads * 128 * 2, 2 * c * heads * 128 * 4
      paths = {layout: critical_paths(t, t_causal, kv_bytes / bandwidth, dkv_bytes / bandwidth)
               for layout, t in times.items()}
      for layout, p in paths.items():
        speedup = paths["ring"]["critical_fwd_bwd_s"] / p["critical_fwd_bwd_s"]
        print(f"{c:>6} {link:>8} {layout:>8} {len(cache):>7} {p['fraction_fwd']:>6.3f} "
              f"{p['fraction_fwd_bwd']:>6.3f} {p['fraction_fwd_nocomm']:>10.3f} "
              f"{p['fraction_fwd_bwd_nocomm']:>10.3f} {speedup:>13.3f}")
        record(part="ring", kernel=kernel, block=c, num_shards=num_shards, heads=heads,
               link=link, bandwidth=bandwidth, layout=layout,
               distinct_classes_timed=len(cache), t_causal_fwd_s=t_causal[0],
               t_causal_bwd_s=t_causal[1], ring_over_this_fwd_bwd=speedup,
               ring_over_this_fwd=paths["ring"]["critical_fwd_s"] / p["critical_fwd_s"],
               theory_ring=num_shards / (2 * num_shards - 1),
               config=dataclasses.asdict(config), **p)
    del q, k, v, dout


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default="check,sweep,cudnn,ring")
  parser.add_argument("--seq_lens", default="8192,16384,32768")
  parser.add_argument("--sweep_seq_len", type=int, default=16384)
  parser.add_argument("--blocks", default="8192,16384,32768", help="ring: per-device block")
  parser.add_argument("--num_shards", type=int, default=8)
  parser.add_argument("--ring_heads", type=int, default=32)
  parser.add_argument("--links", default=",".join(f"{k}={v:g}" for k, v in LINKS.items()),
                      help="ring: name=bytes/s per direction, comma-separated")
  parser.add_argument("--config", default="{}", help="KernelConfig fields as JSON (no sweep)")
  args = parser.parse_args()
  parts = args.parts.split(",")
  ints = lambda s: [int(x) for x in s.split(",")]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
  config = dataclasses.replace(kernel_pallas.DEFAULT_CONFIG, **json.loads(args.config))
  if "check" in parts:
    part_check()
  if "sweep" in parts:
    config = part_sweep(args.sweep_seq_len)
  if "cudnn_kernel" in parts:
    part_cudnn_kernel(config, ints(args.seq_lens))
  if "cudnn" in parts:
    part_cudnn(config, ints(args.seq_lens))
  if "ring" in parts:
    links = {name: float(bps) for name, bps in (x.split("=") for x in args.links.split(","))}
    part_ring(config, ints(args.blocks), args.num_shards, args.ring_heads, links)
  print(f"\nappended to {RESULTS}")


if __name__ == "__main__":
  main()
