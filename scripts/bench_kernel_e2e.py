"""`python -m trainer` itself on one device, per sequence length and attention: the e2e part
of `make gpu_check` (scripts/gpu_check.py). Nothing of JAX runs in this process, so each
trainer run has the whole device.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import bench_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMMIT = bench_results.commit()  # Before this run appends to the results file.


def remat_for(seq_len: int, policy: str) -> str:
  """`auto`: none at 8k, full above (by estimate no-remat activations of the 1B at 32k
  exceed 80 GB)."""
  return policy if policy != "auto" else "none" if seq_len <= 8192 else "full"


def command(config_file: str, workdir: str, seq_len: int, attention: str, kernel: str,
            steps: int, remat: str, data_dir: str, overrides=()) -> list[str]:
  """The trainer's command line for one run: the config's model, mesh 1x1x1x1x1, batch 1,
  the synthetic corpus (no download) with documents up to a row long (a few per row, so
  dense attention packs them for cuDNN), no checkpoint, no eval, W&B off."""
  return [sys.executable, "-m", "trainer", "--config", config_file, "--workdir", workdir,
          *(f"--config.mesh.{axis}=1" for axis in ("data", "fsdp", "sequence", "ulysses",
                                                   "tensor")),
          "--config.train.batch_size=1", f"--config.data.seq_len={seq_len}",
          f"--config.train.steps={steps}", "--config.train.warmup_steps=1",
          "--config.train.log_every=1", "--config.train.eval_every=0",
          "--config.checkpoint.every_steps=0", "--config.wandb.mode=disabled",
          "--config.data.dataset=synthetic_longrange", f"--config.data.data_dir={data_dir}",
          "--config.data.tokenizer_vocab_size=512", "--config.data.num_documents=200",
          "--config.data.num_eval_documents=20",
          f"--config.data.max_document_tokens={seq_len}",
          f"--config.model.attention={attention}", f"--config.model.kernel={kernel}",
          f"--config.train.remat={remat}", *overrides]


def run(config_file: str, seq_len: int, attention: str, kernel: str, steps: int,
        remat_policy: str, data_dir: str, deadline_s: float, record, overrides=(),
        profile_to: str | None = None) -> None:
  """One trainer run, recorded: tokens/s and MFU from its metrics.jsonl (median over the
  steps after the first two), the kernel it resolved (config.json), the losses (they must
  fall). `profile_to`: trace the last step and copy its Perfetto trace there."""
  remat = remat_for(seq_len, remat_policy)
  workdir = tempfile.mkdtemp(prefix="gpu_check_e2e_")
  args = command(config_file, workdir, seq_len, attention, kernel, steps, remat, data_dir,
                 overrides)
  if profile_to:
    args.append(f"--profile_steps={steps}")
  where = dict(part="e2e", seq_len=seq_len, attention=attention, kernel_requested=kernel,
               remat=remat, steps=steps, commit=_COMMIT, config_file=config_file,
               command=" ".join(args[1:]).replace(workdir, "WORKDIR"))
  started = time.monotonic()
  try:
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=deadline_s)
    print(done.stdout[-3000:] + done.stderr[-3000:], flush=True)
    if done.returncode:
      lines = [l for l in (done.stdout + done.stderr).splitlines() if l.strip()]
      record(**where, status="failed", error=(lines or ["(no output)"])[-1][:300])
      return
    with open(os.path.join(workdir, "config.json")) as f:
      resolved = json.load(f)["resolved"]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [r for r in map(json.loads, f) if "loss" in r]
    if profile_to:
      traces = sorted(os.path.join(d, f) for d, _, files in os.walk(workdir) for f in files
                      if f == "perfetto_trace.json.gz")
      if traces:
        shutil.copy(traces[-1], profile_to)
  except subprocess.TimeoutExpired:
    record(**where, status="failed", error=f"past its deadline of {deadline_s:.0f} s")
    return
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  timed = rows[2:] or rows[-1:]
  mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
  first, last = rows[0]["loss"], rows[-1]["loss"]
  record(**where, status="ok", device=resolved["device_kind"], kernel=resolved["attention_kernel"],
         step_s=statistics.median(r["step_time_s"] for r in timed),
         tokens_per_sec=statistics.median(r["tokens_per_sec"] for r in timed),
         mfu=statistics.median(mfus) if mfus else None, first_loss=first, last_loss=last,
         loss_falls=last < first, seconds=time.monotonic() - started)
