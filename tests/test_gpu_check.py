"""`make gpu_check SMOKE=1`: the GPU check's own script, every part, on the CPU at tiny shapes,
so that it cannot arrive broken on a GPU machine whose minutes are few."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check  # noqa: E402


@pytest.mark.slow(150)
def test_every_part_runs_at_smoke_shapes(tmp_path):
  done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out",
                         str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
  rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
  assert len({r["run"] for r in rows}) == 1
  parts = {r["part"]: r["status"] for r in rows if r.get("part_status")}
  assert parts == dict.fromkeys(("kernels", "ring", "e2e", "profile"), "ok")
  kernels = [r for r in rows if r["part"] == "kernels" and "shape" in r]
  # At smoke the causal block alone (the strictly causal one is another schedule, no more).
  assert {(r["shape"], r["kernel"]) for r in kernels} == {
      *((shape, kernel) for shape in ("causal", "causal_packed", "window_32")
        for kernel in ("pallas", "cudnn", "auto")), ("dense_packed", "dense")}
  assert all(r["status"] == "ok" and r["exact"] for r in kernels), kernels
  # The baseline's window is ours: (w - 1, 0) around the query is the same w keys (one key
  # more or less is a 10% error at these shapes; bf16 rounding 0.2%).
  assert all(r["cudnn_rel_err_out"] < 2e-2 for r in kernels if r["shape"] == "window_32")
  ring = {(r["link"], r["layout"]) for r in rows if r["part"] == "ring" and "layout" in r}
  # Timings are a busy CPU's, not judged; each layout on both links, from one timing.
  assert ring == {(link, layout) for link in ("nvlink", "ib_400g")
                  for layout in ("ring", "striped", "zigzag")}
  e2e = [r for r in rows if r["part"] == "e2e" and "seq_len" in r]
  assert [(r["attention"], r["status"], r["loss_falls"]) for r in e2e] == [
      ("striped", "ok", True), ("dense", "ok", True)]
  assert "dense" in {r["attention"] for r in e2e} and e2e[1]["kernel"] == "xla"
  profile = next(r for r in rows if r["part"] == "profile" and "idle" in r)
  assert sum(profile[k] for k in ("attention", "matmuls", "collectives", "other", "idle")) \
      == pytest.approx(1.0)
  summary = (tmp_path / "summary.txt").read_text()
  assert "goals (not judged at smoke shapes)" in summary and "e2e: python -m trainer" in summary
  # Nothing but what the device tool hands back (at most 8 files, 2 folders down) is left.
  assert sorted(os.listdir(tmp_path)) == ["gpu_check.jsonl", "gpu_check.log",
                                          "profile_32k.perfetto_trace.json.gz", "summary.txt"]


def test_a_failing_part_says_why_in_one_line_and_a_slow_one_is_stopped(tmp_path):
  with open(tmp_path / "log", "w") as log:
    failed = gpu_check.run_part("profile", str(tmp_path), True, 60, "r", log)
    stopped = gpu_check.run_part("kernels", str(tmp_path), True, 0.5, "r", log)
  assert failed["status"] == "failed"
  assert failed["error"] == "RuntimeError: no trace: the e2e part's 32k striped run wrote none"
  assert stopped == {"part": "kernels", "run": "r", "status": "failed",
                     "error": "past its deadline of 0 s", "seconds": stopped["seconds"]}
