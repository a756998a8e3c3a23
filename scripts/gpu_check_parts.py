"""The parts of `make gpu_check` (scripts/gpu_check.py), each run in a process of its own:
`python scripts/gpu_check_parts.py PART --out DIR [--smoke] [--deadline S]`.

Every measurement is one JSON line appended at once to DIR/gpu_check.jsonl (a part that
fails or runs out of time keeps what it measured). `--smoke` runs the same code on the CPU
at tiny shapes: Pallas in interpret mode, the `xla` kernel in the `cudnn` kernel's place,
JAX's XLA attention in cuDNN's, the tiny config in the 1B's.
"""

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_kernel  # noqa: E402  (scripts/, first on the path)
import bench_kernel_e2e  # noqa: E402
import parallelism  # noqa: E402
from parallelism import kernel_pallas, kernel_xla  # noqa: E402
from parallelism import kernels  # noqa: E402
from parallelism.masks import Mask, MaskSpec, Side  # noqa: E402
from parallelism.ring_attention import ring_attention  # noqa: E402
from parallelism.schedule import ring_schedule  # noqa: E402

F32 = jnp.float32
ERROR_OK = 2e-2  # bf16 operands against a float32 reference: rounding, not a wrong mask.
PROFILE_TRACE = "profile_32k.perfetto_trace.json.gz"


class Recorder:
  """Appends one JSON line per measurement to DIR/gpu_check.jsonl, at once, tagged with the
  part, the check's run id, the device (where this process holds it) and the seconds since
  the part began (`at_s`: what each row costs, for sizing the deadlines)."""

  def __init__(self, out: str, part: str, run: str, device: str | None):
    self.path = os.path.join(out, "gpu_check.jsonl")
    self.tags = {"part": part, "run": run, **({"device": device} if device else {})}
    self.started = time.monotonic()

  def __call__(self, **row) -> None:
    row = {**row, **self.tags, "at_s": round(time.monotonic() - self.started, 1)}
    with open(self.path, "a") as f:
      f.write(json.dumps(row, default=float) + "\n")


def _flops(seq_len: int, heads: int, head_dim: int) -> float:
  """Forward FLOPs of causal attention, B=1 (QK^T and PV, half of them); a forward and
  backward is 3.5x (FlashAttention's count), the same for every kernel compared."""
  return 4 * heads * seq_len ** 2 * head_dim / 2


def _window_flops(seq_len: int, window: int, heads: int, head_dim: int) -> float:
  """Forward FLOPs of a sliding window of `window` keys (the query's own included), B=1."""
  seen = np.minimum(np.arange(1, seq_len + 1), window).sum()
  return 4 * heads * float(seen) * head_dim


def _documents(seq_len: int, count: int = 5) -> np.ndarray:
  """Segment ids of one packed row: `count` documents of unequal lengths, then padding."""
  cuts = (np.array([0.0, 0.1, 0.35, 0.4, 0.75, 0.97]) * seq_len).astype(int)[:count + 1]
  seg = np.zeros((1, seq_len), np.int32)
  for i, (start, end) in enumerate(zip(cuts[:-1], cuts[1:])):
    seg[0, start:end] = i + 1
  return seg


def part_kernels(record, smoke: bool) -> None:
  """Block kernels against cuDNN flash attention (JAX's, `implementation='cudnn'`) on the
  same inputs: bf16, B=1, 32 heads, head_dim 128, causal and strictly causal blocks, each
  also of a packed row of 5 documents, which dense cuDNN attention runs too; forward and
  forward+backward TFLOP/s, each checked against the xla kernel in float32."""
  # At smoke one head of 64 tokens: every block is one tile, the cheapest interpreted Pallas
  # programs, and a 32-token window still leaves keys out of reach.
  seq_lens, heads, head_dim = ([64], 1, 32) if smoke else ([8192, 16384, 32768], 32, 128)
  # Labels and the kernels they run; `auto` is timed once, as the kernel it resolves to.
  names = {"pallas": "pallas", "cudnn": "xla" if smoke else "cudnn", "auto": "auto"}
  baseline = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                               implementation="xla" if smoke else "cudnn")
  for seq_len in seq_lens:
    q, k, v, dout = bench_kernel.normals(jax.random.key(seq_len), [(1, seq_len, heads,
                                                                   head_dim)] * 4, jnp.bfloat16)
    flops = _flops(seq_len, heads, head_dim)
    base_f = jax.jit(baseline)
    base_fb = jax.jit(lambda q, k, v, dout: jax.vjp(baseline, q, k, v)[1](dout))
    cudnn = dict(cudnn_fwd_tflops=flops / bench_kernel.median_time(base_f, q, k, v) / 1e12,
                 cudnn_fwd_bwd_tflops=3.5 * flops / bench_kernel.median_time(
                     base_fb, q, k, v, dout) / 1e12)
    # At smoke the causal block alone: the strictly causal one (striped's) runs the same code
    # on another schedule, which tests/test_kernel_pallas.py and test_kernel_cudnn.py check.
    shapes = [("causal", bench_kernel.causal_block(seq_len))] + (
        [] if smoke else [("strictly_causal", bench_kernel.strictly_causal_block(seq_len))])
    for shape, (schedule, pair) in shapes:
      _block_rows(record, schedule, pair, (q, k, v, dout), None,
                  _reference(schedule, pair, (q, k, v, dout), None), names, flops,
                  dict(seq_len=seq_len, shape=shape, **cudnn))
    if seq_len == seq_lens[0]:  # packed documents: exactness first, at the shortest length
      segments = jnp.asarray(_documents(seq_len))
      for shape, (schedule, pair) in shapes:
        want = _reference(schedule, pair, (q, k, v, dout), segments)
        _block_rows(record, schedule, pair, (q, k, v, dout), segments, want, names, flops,
                    dict(seq_len=seq_len, shape=f"{shape}_packed", **cudnn))
        if shape == "causal":  # dense attention of the packed row: the same mask
          _dense_row(record, (q, k, v, dout), segments, want, smoke, flops,
                     dict(seq_len=seq_len, **cudnn))
      _window_rows(record, (q, k, v, dout), 32 if smoke else 1024, names, smoke)


def _reference(schedule, pair, inputs, segments):
  """The xla kernel's gradients and output on float32 copies of `inputs`, at the highest
  matmul precision: what every kernel on this block is checked against, computed once."""
  tile = min(bench_kernel.TILE, inputs[0].shape[1])
  reference = jax.jit(bench_kernel.fwd_bwd(kernel_xla.block_fwd, kernel_xla.block_bwd,
                                           schedule, tile))
  with jax.default_matmul_precision("highest"):
    g_ref, o_ref, _ = reference(*(x.astype(F32) for x in inputs), pair, segments, segments)
  return g_ref, o_ref


def _window_rows(record, inputs, window: int, kernel_names, smoke: bool) -> None:
  """A local layer's block (a ring of one, `window` keys per query) in each kernel, against
  cuDNN's own sliding window (`local_window_size=(window - 1, 0)`: the same keys), whose
  output is checked against the float32 reference too (`cudnn_rel_err_out`)."""
  q, k, v, dout = inputs
  seq_len, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
  flops = _window_flops(seq_len, window, heads, head_dim)
  baseline = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                               local_window_size=(window - 1, 0),
                               implementation="xla" if smoke else "cudnn")
  base_f = jax.jit(baseline)
  base_fb = jax.jit(lambda q, k, v, dout: jax.vjp(baseline, q, k, v)[1](dout))
  schedule = ring_schedule("ring", seq_len, 1, window)
  want = _reference(schedule, jnp.int32(0), inputs, None)
  where = dict(seq_len=seq_len, shape=f"window_{window}", window=window,
               cudnn_rel_err_out=bench_kernel.rel_err(base_f(q, k, v), want[1]),
               cudnn_fwd_tflops=flops / bench_kernel.median_time(base_f, q, k, v) / 1e12,
               cudnn_fwd_bwd_tflops=3.5 * flops / bench_kernel.median_time(
                   base_fb, q, k, v, dout) / 1e12)
  _block_rows(record, schedule, jnp.int32(0), inputs, None, want, kernel_names, flops, where)


def _errors(got, want) -> dict:
  names = ("out", "dq", "dk", "dv")
  return {f"rel_err_{n}": bench_kernel.rel_err(g, w) for n, g, w in zip(names, got, want)}


def _block_rows(record, schedule, pair, inputs, segments, want, kernel_names, flops,
                where) -> None:
  q, k, v, dout = inputs
  tile = min(bench_kernel.TILE, q.shape[1])
  g_ref, o_ref = want
  measured = {}  # kernel run -> its row: `auto` is one of the others, as the ring chooses it
  for label, name in kernel_names.items():
    runs, _ = kernels.choose(name, MaskSpec(schedule.window), q.shape, k.shape, tile, q.dtype,
                             general="general" in schedule.shapes)
    if runs in measured:
      record(**{**measured[runs], "kernel": label, "runs": runs, "same_run_as": runs})
      continue
    fwd, bwd = kernels.KERNELS[runs][:2]
    at = dict(schedule=schedule, tile=tile)
    mask = Mask(MaskSpec(schedule.window), Side(segments), Side(segments))
    run_f = jax.jit(lambda q, k, v, pair, fwd=fwd: fwd(q, k, v, mask, pair=pair, **at))
    run_fb = jax.jit(bench_kernel.fwd_bwd(fwd, bwd, schedule, tile))
    try:
      (dq, dk, dv), out, _ = run_fb(q, k, v, dout, pair, segments, segments)
      errors = _errors((out, dq, dk, dv), (o_ref, *g_ref))
      t_f = bench_kernel.median_time(run_f, q, k, v, pair)
      t_fb = bench_kernel.median_time(run_fb, q, k, v, dout, pair, segments, segments)
    except Exception as error:  # noqa: BLE001  (one kernel failing must not hide the rest)
      record(**where, kernel=label, status="failed", error=f"{type(error).__name__}: "
             f"{str(error).splitlines()[0][:300] if str(error) else ''}")
      continue
    fwd_bwd_tflops = 3.5 * flops / t_fb / 1e12
    measured[runs] = dict(**where, kernel=label, runs=runs, status="ok",
                          fwd_tflops=flops / t_f / 1e12, fwd_bwd_tflops=fwd_bwd_tflops,
                          over_cudnn_fwd_bwd=fwd_bwd_tflops / where["cudnn_fwd_bwd_tflops"],
                          exact=max(errors.values()) < ERROR_OK, **errors)
    record(**measured[runs])


def _dense_row(record, inputs, segments, want, smoke: bool, flops, where) -> None:
  """`model.attention='dense'` on a GPU: cuDNN over the packed row (the fallback, the block
  kernels as a ring of one, for rows of more documents), against the xla kernel in float32
  (`want`: the packed causal block's reference)."""
  q, k, v, dout = inputs
  if smoke:  # no cuDNN: the model's plain masked softmax in its place
    from model.attention import dense_attention  # pylint: disable=g-import-not-at-top
    attend = lambda q, k, v: dense_attention(q, k, v, Mask.of(segment_ids=segments))
  else:
    fallback = lambda q, k, v, seg: ring_attention(
        q, k, v, Mask.of(segment_ids=seg), layout="ring",
        tile_size=min(bench_kernel.TILE, q.shape[1]))
    attend = lambda q, k, v: parallelism.cudnn_dense_attention(q, k, v, segments, fallback)
  g_ref, o_ref = want
  run_f = jax.jit(attend)
  run_fb = jax.jit(lambda q, k, v, dout: (jax.vjp(attend, q, k, v)[1](dout), attend(q, k, v)))
  try:
    (dq, dk, dv), out = run_fb(q, k, v, dout)
    errors = _errors((out, dq, dk, dv), (o_ref, *g_ref))
    t_f, t_fb = (bench_kernel.median_time(run_f, q, k, v),
                 bench_kernel.median_time(run_fb, q, k, v, dout))
  except Exception as error:  # noqa: BLE001
    record(**where, shape="dense_packed", kernel="dense", status="failed",
           error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
    return
  record(**where, shape="dense_packed", kernel="dense", status="ok",
         fwd_tflops=flops / t_f / 1e12, fwd_bwd_tflops=3.5 * flops / t_fb / 1e12,
         exact=max(errors.values()) < ERROR_OK, **errors)


def part_ring(record, smoke: bool) -> None:
  """The N=8 ring emulated on one GPU (bench_kernel's ring part): striped against ring, with
  pallas blocks, then cudnn's (what `auto` runs for striped and ring on a GPU), each on
  NVLink (8 GPUs are one node) and on a 400 Gb/s link between nodes, side by side."""
  config = kernel_pallas.DEFAULT_CONFIG
  if smoke:  # the CPU has no cuDNN; one head, blocks as short as the pallas query tile (128)
    bench_kernel.part_ring(config, [128], 4, 1, record=record)
    return
  for kernel in ("pallas", "cudnn"):
    bench_kernel.part_ring(config, [16384, 32768], 8, 32, record=record, kernel=kernel)


def part_e2e(record, smoke: bool, out: str, deadline: float) -> None:
  """`python -m trainer` on the 1B config, one device, 8k and 32k: striped/auto, striped
  with the other fused GPU kernel (`auto` is chosen by these rows), and dense (cuDNN); the
  32k striped/auto run traces its last step for the profile part."""
  config = "configs/tiny_cpu.py" if smoke else "configs/1b_32k_striped.py"
  seq_lens, steps = ([256], 4) if smoke else ([8192, 32768], 8)
  extra = ["--config.cpu_devices=1"] if smoke else []
  data_dir = tempfile.mkdtemp(prefix="gpu_check_data_")  # not in DIR: only results go back
  # The smoke's CPU runs neither fused GPU kernel (pallas only interprets there).
  other = [] if smoke else [("striped", "pallas" if kernels.resolve(
      kernels.AUTO, "gpu") == "cudnn" else "cudnn")]
  runs = [(s, attention, kernel) for s in seq_lens
          for attention, kernel in [("striped", "auto"), *other, ("dense", "auto")]]
  ends = time.monotonic() + deadline
  try:
    for i, (seq_len, attention, kernel) in enumerate(runs):
      left = (ends - time.monotonic()) / (len(runs) - i)
      profile = os.path.join(out, PROFILE_TRACE) if (
          seq_len == seq_lens[-1] and (attention, kernel) == ("striped", "auto")) else None
      bench_kernel_e2e.run(config, seq_len, attention, kernel, steps, "auto", data_dir, left,
                           record, extra, profile_to=profile)
  finally:
    shutil.rmtree(data_dir, ignore_errors=True)


def part_profile(record, out: str) -> None:
  """Where one 32k striped step's device time goes (the e2e part's trace)."""
  from trainer.track import profiling  # pylint: disable=g-import-not-at-top
  trace = os.path.join(out, PROFILE_TRACE)
  if not os.path.exists(trace):
    raise RuntimeError("no trace: the e2e part's 32k striped run wrote none")
  record(status="ok", trace=PROFILE_TRACE, **profiling.summarise(trace))


def part_sparse(record, smoke: bool) -> None:
  """Hash attention and QK-dropping against causal attention at SCFA's settings (issue #38:
  bf16, B=4, H=48, D=64, tile 128), one block through the `xla` kernel's run-time walk: the
  rows of `scripts/bench_sparse.py --gpu`'s block part at 8k, then 16k. Not a default part:
  `--parts sparse` after the others, where device time is left.

  First the walk's exactness on this device (`_sparse_exact`). Then one variant per
  measurement, each beside causal attention's own time, the sparsest first and one timed
  repeat (the walk one (row, query tile) at a time took seconds a call): each row is
  recorded as it is measured, and the part's deadline keeps every row it reached."""
  import bench_sparse  # pylint: disable=g-import-not-at-top  # scripts/, first on the path
  _sparse_exact(record, bench_sparse, smoke)
  seq_lens, (batch, heads, head_dim) = ([8192, 16384], (4, 48, 64)) if not smoke else (
      [256], (1, 2, 32))
  variants = [([64], []), ([16], []), ([], [0.5]), ([4], [])]
  for seq_len in seq_lens:
    schedule = ring_schedule("ring", seq_len, 1)
    inputs = bench_sparse.inputs(batch, seq_len, heads, heads, head_dim, jnp.bfloat16)
    steps = bench_sparse.block_step(schedule, 128)
    for buckets, drop_rates in variants:
      started = time.monotonic()
      causal, row = bench_sparse.run_part("block", seq_len, inputs, schedule, steps, buckets,
                                          drop_rates, 1, 128, lambda x: x, control=False)
      record(status="ok", seconds=time.monotonic() - started, causal_fwd_s=causal["fwd_s"],
             causal_fwd_bwd_s=causal["fwd_bwd_s"], **row)
      print(f"{seq_len:>6} {row['variant']:>9}  tiles {row['tile_ratio']:.3f}  fwd "
            f"{row['fwd_s']:.3f} s ({row['fwd_ratio']:.2f}x causal)  fwd+bwd "
            f"{row['fwd_bwd_s']:.3f} s ({row['fwd_bwd_ratio']:.2f}x causal)", flush=True)


def _sparse_exact(record, bench_sparse, smoke: bool) -> None:
  """Hash attention's block kernel (4 buckets, GQA 4:2) against the model's dense masked
  attention under the same codes, float32: out and gradients. On a GPU the kernel walks its
  tiles side by side in batches, which the CPU's tests check at tiny shapes only."""
  from model.attention import dense_attention  # pylint: disable=g-import-not-at-top
  seq_len = 256 if smoke else 2048
  q, k, v, dout = bench_sparse.inputs(1, seq_len, 4, 2, 64, jnp.float32, seed=1)
  codes = bench_sparse.codes_of(q, k, 4)
  variant = (bench_sparse.hash_spec(4), *codes)
  fwd, fwd_bwd = bench_sparse.block_step(ring_schedule("ring", seq_len, 1), 128)
  segments = jnp.ones((1, seq_len), jnp.int32)

  def dense(q, k, v):
    return dense_attention(q, k, v, Mask.of(bench_sparse.hash_spec(4), segments, codes=codes))

  with jax.default_matmul_precision("highest"):  # float32 matmuls, not TF32, on both sides
    mask = bench_sparse.mask_of(variant)
    got = (fwd(q, k, v, dout, mask)[0], *fwd_bwd(q, k, v, dout, mask))
    out, vjp = jax.vjp(dense, q, k, v)
    want = (out, *vjp(dout))
  errors = _errors(got, want)
  worst = max(errors.values())
  record(exactness="hash-4", seq_len=seq_len, exact=worst < 1e-4, max_rel_err=worst, **errors)
  print(f"hash-4 at {seq_len} against dense, float32: max relative error {worst:.1e}",
        flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("part", choices=("kernels", "ring", "e2e", "profile", "sparse"))
  parser.add_argument("--out", required=True)
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--deadline", type=float, default=300.0)
  parser.add_argument("--run", default="", help="the check's run id, on every line")
  args = parser.parse_args()
  device = None
  if args.part in ("kernels", "ring", "sparse"):  # the e2e part's runs need the device alone
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {device}", flush=True)
  record = Recorder(args.out, args.part, args.run, device)
  if args.part == "kernels":
    part_kernels(record, args.smoke)
  elif args.part == "ring":
    part_ring(record, args.smoke)
  elif args.part == "e2e":
    part_e2e(record, args.smoke, args.out, args.deadline)
  elif args.part == "sparse":
    part_sparse(record, args.smoke)
  else:
    part_profile(record, args.out)


if __name__ == "__main__":
  main()
