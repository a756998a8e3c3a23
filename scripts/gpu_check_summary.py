"""The table `make gpu_check` ends with, from its JSON lines, and the goals of issue #35."""

import json

# (what, target) of each goal; `_goals` measures them.
GOALS = (("auto >= 0.95x cuDNN forward+backward on every shape", 0.95),
         ("striped >= 0.9 of ideal at N=8 (forward+backward)", 0.9),
         ("striped >= 1.8x ring at N=8 (forward+backward)", 1.8),
         ("1B striped/auto MFU >= 0.40 at 8k", 0.40),
         ("1B striped/auto MFU >= 0.38 at 32k", 0.38),
         ("1B striped/auto >= 0.97x dense (cuDNN) tokens/s", 0.97))


def read(path: str, run: str | None) -> list[dict]:
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if run is None or r.get("run") == run]


def _f(value, spec=".1f") -> str:
  return "-" if value is None else format(value, spec)


def _kernels(rows) -> list[str]:
  kernel_rows = [r for r in rows if r["part"] == "kernels" and "shape" in r]
  if not kernel_rows:
    return []
  out = ["kernels: TFLOP/s forward / forward+backward, x cuDNN's f+b, exact vs float32 "
         "(rel err < 2e-2)",
         f"{'S':>6} {'shape':>22} {'kernel':>7} {'fwd':>6} {'f+b':>6} {'x cuDNN':>7} "
         f"{'exact':>5}   cuDNN fwd / f+b"]
  for r in kernel_rows:
    if r.get("status") != "ok":
      out.append(f"{r['seq_len']:>6} {r['shape']:>22} {r['kernel']:>7}  failed: {r['error']}")
      continue
    out.append(f"{r['seq_len']:>6} {r['shape']:>22} {r['kernel']:>7} {_f(r['fwd_tflops']):>6} "
               f"{_f(r['fwd_bwd_tflops']):>6} {_f(r.get('over_cudnn_fwd_bwd'), '.2f'):>7} "
               f"{'yes' if r['exact'] else 'NO':>5}   {_f(r['cudnn_fwd_tflops'])} / "
               f"{_f(r['cudnn_fwd_bwd_tflops'])}")
  return out


def _ring(rows) -> list[str]:
  ring_rows = [r for r in rows if r["part"] == "ring" and "layout" in r]
  if not ring_rows:
    return []
  # "no link": the same without the transfers, so that a link-bound row (faster blocks, the
  # same bytes) reads as the link's, not the layout's.
  out = ["ring (one-GPU emulation): fraction of ideal forward+backward, with and without the "
         "link's time; ring's time over this",
         f"{'block':>6} {'N':>3} {'kernel':>7} {'link':>8} {'layout':>8} {'of ideal':>8} "
         f"{'no link':>8} {'ring/this':>9}"]
  for r in ring_rows:
    link = r.get("link", f"{r['bandwidth'] / 1e9:g}GB/s")
    out.append(f"{r['block']:>6} {r['num_shards']:>3} {r.get('kernel', 'pallas'):>7} "
               f"{link:>8} {r['layout']:>8} {r['fraction_fwd_bwd']:>8.3f} "
               f"{r['fraction_fwd_bwd_nocomm']:>8.3f} {r['ring_over_this_fwd_bwd']:>9.3f}")
  return out


def _e2e(rows) -> list[str]:
  e2e_rows = [r for r in rows if r["part"] == "e2e" and "seq_len" in r]
  if not e2e_rows:
    return []
  out = ["e2e: python -m trainer, one device (median after 2 steps)",
         f"{'S':>6} {'attention':>9} {'kernel':>10} {'tokens/s':>10} {'MFU':>6} {'loss':>15}"]
  for r in e2e_rows:
    if r.get("status") != "ok":
      out.append(f"{r['seq_len']:>6} {r['attention']:>9}  failed: {r['error']}")
      continue
    falls = "" if r["loss_falls"] else "  (the loss did not fall)"
    kernel = r["kernel"] if r.get("kernel_requested", "auto") == "auto" else (
        f"{r['kernel']} (set)")
    out.append(f"{r['seq_len']:>6} {r['attention']:>9} {kernel:>10} "
               f"{r['tokens_per_sec']:>10,.0f} {_f(r['mfu'], '.3f'):>6} "
               f"{r['first_loss']:>7.3f}->{r['last_loss']:<7.3f}{falls}")
  return out


def _profile(rows) -> list[str]:
  shares = [r for r in rows if r["part"] == "profile" and "idle" in r]
  if not shares:
    return []
  r = shares[-1]
  return ["profile of one 32k striped step: " + ", ".join(
      f"{name} {r[name]:.0%}" for name in ("attention", "matmuls", "collectives", "other",
                                           "idle"))]


def _sparse(rows) -> list[str]:
  sparse_rows = [r for r in rows if r["part"] == "sparse" and "variant" in r]
  exactness = [r for r in rows if r["part"] == "sparse" and "exactness" in r]
  if not sparse_rows and not exactness:
    return []
  out = [f"sparse: {r['exactness']} at {r['seq_len']} against dense, float32: "
         f"{'exact' if r['exact'] else 'NOT exact'} (max relative error {r['max_rel_err']:.1e})"
         for r in exactness]
  out += ["sparse (SCFA's settings, one block): time and tiles as a share of causal attention's",
         f"{'S':>6} {'variant':>9} {'tiles':>6} {'ideal':>6} {'fwd':>6} {'f+b':>6}"]
  for r in sparse_rows:
    out.append(f"{r['seq_len']:>6} {r['variant']:>9} {_f(r.get('tile_ratio', 1.0), '.3f'):>6} "
               f"{_f(r.get('ideal'), '.3f'):>6} {r['fwd_ratio']:>6.2f} {r['fwd_bwd_ratio']:>6.2f}")
  return out


def _goals(rows) -> list[tuple[float | None, str]]:
  """The measured value of each of GOALS (None where nothing was measured), and where."""
  autos = [r for r in rows if r["part"] == "kernels" and r.get("kernel") == "auto"
           and r.get("status") == "ok" and r.get("shape") in ("causal", "strictly_causal")]
  worst_auto = min(autos, key=lambda r: r["over_cudnn_fwd_bwd"], default=None)
  striped = [r for r in rows if r["part"] == "ring" and r.get("layout") == "striped"
             and r.get("num_shards") == 8]
  # Judged on the kernel `auto` runs for striped on a GPU (cudnn) where it was timed.
  striped = [r for r in striped if r.get("kernel") == "cudnn"] or striped
  e2e = {(r["seq_len"], r["attention"]): r for r in rows  # the goals are auto's
         if r["part"] == "e2e" and r.get("status") == "ok" and "seq_len" in r
         and r.get("kernel_requested", "auto") == "auto"}

  def mfu(seq_len):
    r = e2e.get((seq_len, "striped"))
    return (r["mfu"], f"S={seq_len}") if r and r["mfu"] is not None else (None, "")

  ratios = [(e2e[(s, "striped")]["tokens_per_sec"] / e2e[(s, "dense")]["tokens_per_sec"], s)
            for s in (8192, 32768) if (s, "striped") in e2e and (s, "dense") in e2e]
  worst_ratio = min(ratios, default=(None, None))
  return [
      (worst_auto and worst_auto["over_cudnn_fwd_bwd"],
       worst_auto and f"worst: S={worst_auto['seq_len']} {worst_auto['shape']}"),
      (min((r["fraction_fwd_bwd"] for r in striped), default=None), "worst block"),
      (min((r["ring_over_this_fwd_bwd"] for r in striped), default=None), "worst block"),
      mfu(8192), mfu(32768),
      (worst_ratio[0], worst_ratio[1] and f"worst: S={worst_ratio[1]}")]


def summary(path: str, statuses: list[dict], seconds: float, smoke: bool,
            run: str | None = None) -> str:
  rows = read(path, run)
  devices = sorted({r["device"] for r in rows if r.get("device")})
  lines = [f"gpu_check{' (SMOKE: the CPU at tiny shapes)' if smoke else ''}, "
           f"{', '.join(devices) or 'device unknown'}, {seconds:.0f} s",
           f"{'part':>8} {'status':>7} {'seconds':>8}  error"]
  for s in statuses:
    lines.append(f"{s['part']:>8} {s['status']:>7} {s['seconds']:>8.0f}  {s['error'] or ''}")
  for block in (_kernels(rows), _ring(rows), _e2e(rows), _profile(rows), _sparse(rows)):
    if block:
      lines += [""] + block
  lines += ["", "goals" + (" (not judged at smoke shapes)" if smoke else "")]
  for (what, target), (value, where) in zip(GOALS, _goals(rows)):
    verdict = ("not measured" if value is None else "n/a" if smoke else
               "met" if value >= target else "MISSED")
    lines.append(f"  {what}: {_f(value, '.3f')} {verdict}{f' ({where})' if value else ''}")
  return "\n".join(lines)
