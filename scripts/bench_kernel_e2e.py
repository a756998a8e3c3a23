"""bench_kernel's e2e part: `python -m trainer` itself on one device, per sequence length
and kernel (its own module: it runs the trainer in subprocesses, no kernel of its own).

  PYTHONPATH=. python3 scripts/bench_kernel.py --parts e2e        # 1B of configs/1b_32k_striped.py
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import bench_results
from parallelism.kernels import FALLBACK_SAID

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMMIT = bench_results.commit()  # Before this run appends to the results file.


def part_e2e(config_file: str, seq_lens, kernels, steps: int, remat_policy: str,
             overrides: list[str], record) -> None:
  """`python -m trainer` itself, one run per (sequence length, kernel), on one device: the
  config's model, mesh 1x1x1x1, batch 1, the synthetic corpus (no download), the real data
  pipeline, loss and optimizer. Tokens/s and MFU are the trainer's own, read from its
  metrics.jsonl (median over the steps after the first two); the kernel is the one the run
  resolved (config.json); the loss must fall. Nothing of JAX runs in this process, so the
  trainer has the whole device."""
  print(f"\ne2e: python -m trainer --config {config_file}, one device, {steps} steps")
  print(f"{'S':>7} {'kernel':>12} {'remat':>6} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} "
        f"{'loss':>15}")
  for seq_len in seq_lens:
    remat = remat_policy if remat_policy != "auto" else "none" if seq_len <= 8192 else "full"
    for kernel in kernels:
      workdir = tempfile.mkdtemp(prefix="bench_e2e_")
      command = [sys.executable, "-m", "trainer", "--config", config_file, "--workdir", workdir,
                 "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.sequence=1",
                 "--config.mesh.tensor=1", "--config.train.batch_size=1",
                 f"--config.data.seq_len={seq_len}", f"--config.train.steps={steps}",
                 "--config.train.warmup_steps=1", "--config.train.log_every=1",
                 "--config.train.eval_every=0", f"--config.checkpoint.every_steps={steps + 1}",
                 "--config.data.dataset=synthetic_longrange",
                 "--config.data.tokenizer_vocab_size=512", "--config.wandb.mode=disabled",
                 f"--config.model.kernel={kernel}", f"--config.train.remat={remat}", *overrides]
      try:  # The run ends with a checkpoint (13 GB at 1B); the workdir goes either way.
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode:
          print(f"  S={seq_len} kernel={kernel}: the run failed (exit {done.returncode}):\n"
                + (done.stdout + done.stderr)[-2000:])
          continue
        with open(os.path.join(workdir, "config.json")) as f:
          written = json.load(f)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
          rows = [r for r in map(json.loads, f) if "loss" in r]
      finally:
        shutil.rmtree(workdir, ignore_errors=True)
      timed = rows[2:] or rows[-1:]
      step_s = statistics.median(r["step_time_s"] for r in timed)
      tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in timed)
      mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
      mfu = statistics.median(mfus) if mfus else None
      losses = (rows[0]["loss"], rows[-1]["loss"])
      resolved = written["resolved"]
      if FALLBACK_SAID in done.stdout:  # auto fell back for some blocks (said once).
        resolved["attention_kernel"] += "+xla"
      name = resolved["attention_kernel"]
      name = name if kernel == name else f"{kernel}={name}"
      print(f"{seq_len:>7} {name:>12} {remat:>6} {step_s * 1e3:>9.1f} "
            f"{tokens_per_sec:>10,.0f} {'-' if mfu is None else f'{mfu:.3f}':>6} "
            f"{losses[0]:>7.3f}->{losses[1]:<7.3f}"
            + ("" if losses[1] < losses[0] else "  (the loss did not fall)"))
      record(part="e2e", device=resolved["device_kind"], commit=_COMMIT,
             config_file=config_file, attention=written["model"]["attention"],
             kernel_requested=kernel, kernel=resolved["attention_kernel"], seq_len=seq_len,
             remat=remat, steps=steps, step_s=step_s, tokens_per_sec=tokens_per_sec, mfu=mfu,
             first_loss=losses[0], last_loss=losses[1], loss_falls=losses[1] < losses[0],
             command=" ".join(command[1:]).replace(workdir, "WORKDIR"))
