"""Every GPU figure of the project from one call on a GPU machine, in under 10 minutes.

  make gpu_check                  # on the GPU machine; writes to $OUT, else --out
  make gpu_check SMOKE=1          # the same script on the CPU at tiny shapes (a test)

Parts, each in a process of its own with its own deadline (scripts/gpu_check_parts.py); a
part that fails is recorded with its first error line and the next one runs:
- kernels: the block kernels (`pallas`, `cudnn`, `auto`) against cuDNN flash attention on
  the same inputs, bf16, B=1, 32 heads, head_dim 128, 8k/16k/32k, causal and strictly
  causal blocks and a packed row, forward and forward+backward TFLOP/s, each checked
  against the xla kernel in float32; dense cuDNN attention of the packed row likewise; at 8k,
  a 1,024-token window against cuDNN's sliding window (its output checked too).
- ring: the one-GPU emulation of an N=8 ring, blocks of 16k and 32k: striped against ring,
  with pallas blocks, then cudnn's.
- e2e: `python -m trainer` on the 1B config, one device, 8k and 32k, striped/auto and
  striped with the other fused kernel against dense (cuDNN): tokens/sec and MFU from
  metrics.jsonl, losses, no checkpoint written.
- profile: a `jax.profiler` trace of one 32k striped step (the e2e run's), as the share of
  time in attention, matmuls, collectives, other and idle.
- sparse (only when named: `make gpu_check ARGS=--parts=sparse`, on a warm machine after the
  others): hash attention and QK-dropping against causal at SCFA's settings (issue #38).
Writes DIR/gpu_check.jsonl (every measurement, and a line per part), DIR/summary.txt (the
table printed at the end, with the goals), DIR/gpu_check.log (every part's output) and the
profile's trace.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import gpu_check_summary  # noqa: E402  (no JAX here: the parts need the device)

# Seconds per part on the GPU; their sum, with the carried wheels' install, stays under 10
# minutes. A part past its deadline is stopped; what it measured by then stays recorded.
# Sized by the parts' times in results/gpu_check/ (each row's `at_s`): kernels needs the
# most, ring the least.
DEADLINES = {"kernels": 230, "ring": 75, "e2e": 215, "profile": 20, "sparse": 150}
SMOKE_DEADLINES = {"kernels": 240, "ring": 180, "e2e": 240, "profile": 60, "sparse": 120}


def run_part(part: str, out: str, smoke: bool, deadline: float, run: str, log) -> dict:
  """Runs one part in its own process; returns its status line."""
  command = [sys.executable, os.path.join(HERE, "gpu_check_parts.py"), part, "--out", out,
             "--deadline", str(deadline), "--run", run] + (["--smoke"] if smoke else [])
  print(f"\n== {part} (deadline {deadline:.0f} s)", flush=True)
  log.write(f"\n== {part}\n")
  started = time.monotonic()
  lines: list[str] = []
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  if smoke:  # the CPU, as the tests run it; no GPU is looked for
    env.setdefault("JAX_PLATFORMS", "cpu")
  process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)

  def relay():  # the part's output, shown as it comes and kept for its error line
    for line in process.stdout:
      print(line, end="", flush=True)
      log.write(line)
      lines.append(line)

  reader = threading.Thread(target=relay, daemon=True)
  reader.start()
  try:
    process.wait(timeout=deadline)
    reader.join()
    status = "ok" if process.returncode == 0 else "failed"
    error = None if status == "ok" else _first_error(lines)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
    status, error = "failed", f"past its deadline of {deadline:.0f} s"
  log.flush()
  return {"part": part, "run": run, "status": status, "error": error,
          "seconds": round(time.monotonic() - started, 1)}


def _first_error(lines: list[str]) -> str:
  """The line that says what went wrong: a traceback's last line, else the last line."""
  text = [l.rstrip() for l in lines if l.strip()]
  errors = [l for l in text if "Error" in l.split(":")[0] or l.startswith("error")]
  return (errors or text or ["(no output)"])[-1][:300]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
      ROOT, "results", "gpu_check", run), help="output folder (default: $OUT, else "
      "results/gpu_check/<UTC time>); lines of earlier checks there are kept")
  parser.add_argument("--smoke", action="store_true", help="the CPU, tiny shapes")
  parser.add_argument("--parts", default="kernels,ring,e2e,profile")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  deadlines = SMOKE_DEADLINES if args.smoke else DEADLINES
  started = time.monotonic()
  statuses = []
  with open(os.path.join(args.out, "gpu_check.log"), "a") as log:
    for part in args.parts.split(","):
      status = run_part(part, args.out, args.smoke, deadlines[part], run, log)
      statuses.append(status)
      with open(os.path.join(args.out, "gpu_check.jsonl"), "a") as f:
        f.write(json.dumps({**status, "part_status": True}) + "\n")
  table = gpu_check_summary.summary(os.path.join(args.out, "gpu_check.jsonl"), statuses,
                                    time.monotonic() - started, args.smoke, run)
  with open(os.path.join(args.out, "summary.txt"), "w") as f:
    f.write(table + "\n")
  print("\n" + table)
  print(f"\nwritten to {args.out}")
  sys.exit(0 if all(s["status"] == "ok" for s in statuses) else 1)


if __name__ == "__main__":
  main()
