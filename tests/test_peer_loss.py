"""A process of a multi-process run that dies: each survivor names it in one line and exits
non-zero at once, and the committed checkpoints stay as they were.

Before, a survivor printed Gloo's `Connection reset by peer` traceback twice, hung 85 s in
JAX's shutdown barrier and aborted with a C++ stack (rc -6). The watch itself
(trainer/run/peers.py) is tested with plain processes, which start in a fraction of a
second; one real 2-process run has its worker killed with `kill -9`.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import SHARED_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process of a watched group: it publishes its address in `folder`, connects to the
# others', says "connected", then leaves cleanly after `stay` seconds.
_WATCHER = """
import os, sys, time
from trainer.run.peers import PeerWatch
me, count, folder, stay = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
watch = PeerWatch(me, count, "127.0.0.1")
watch.checkpoints = os.path.join(folder, "checkpoints")
with open(os.path.join(folder, f"{me}.tmp"), "w") as f:
  f.write(watch.address)
os.rename(os.path.join(folder, f"{me}.tmp"), os.path.join(folder, str(me)))
paths = [os.path.join(folder, str(k)) for k in range(count)]
while not all(map(os.path.exists, paths)):
  time.sleep(0.01)
watch.connect([open(path).read() for path in paths])
print("connected", flush=True)
time.sleep(stay)
"""


def _watchers(folder, stays):
  procs = [subprocess.Popen([sys.executable, "-c", _WATCHER, str(k), str(len(stays)),
                             str(folder), str(stay)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
           for k, stay in enumerate(stays)]
  for proc in procs:
    assert proc.stdout.readline() == "connected\n", proc.communicate(timeout=10)
  return procs


def _finish(proc, timeout: float) -> tuple[float, str]:
  """(seconds until `proc` exited, its stderr)."""
  start = time.monotonic()
  _, err = proc.communicate(timeout=timeout)
  return time.monotonic() - start, err


def test_a_killed_process_is_named_by_each_survivor(tmp_path):
  """Three processes; the first is killed: the other two name it in one line (also the one
  that may see the other survivor leave first) and exit 1 within a second."""
  for name in ("4", "6.orbax-checkpoint-tmp-1"):  # Step 6's save had not committed.
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  procs = _watchers(tmp_path, [60, 60, 60])
  try:
    procs[0].kill()
    for k in (1, 2):
      seconds, err = _finish(procs[k], timeout=10)
      assert procs[k].returncode == 1 and seconds < 2, (seconds, err)
      assert err.splitlines() == [
          f"error: process 0 of 3 stopped answering: it was killed, crashed or lost its host "
          f"(its own output or the cluster's log says which); process {k} stops too; the "
          f"committed checkpoints are untouched, and a re-run resumes from step 4 in "
          f"{tmp_path / 'checkpoints'}"], err
  finally:
    for proc in procs:
      proc.kill()


def test_a_process_that_leaves_cleanly_is_no_death(tmp_path):
  """A process that finished (Python's exit says goodbye) leaves the other alone."""
  procs = _watchers(tmp_path, [0, 1.5])
  try:
    for proc in procs:
      _, err = _finish(proc, timeout=10)
      assert proc.returncode == 0 and err == "", err
  finally:
    for proc in procs:
      proc.kill()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _committed(checkpoints) -> dict[str, tuple[int, int]]:
  """Every file of the committed steps: path -> (size, mtime in ns)."""
  files = {}
  for step in (name for name in os.listdir(checkpoints) if name.isdigit()):
    for folder, _, names in os.walk(checkpoints / step):
      for name in names:
        stat = os.stat(os.path.join(folder, name))
        files[os.path.relpath(os.path.join(folder, name), checkpoints)] = (
            stat.st_size, stat.st_mtime_ns)
  return files


@pytest.mark.slow(25)
def test_a_worker_killed_mid_run_is_named_and_the_coordinator_exits_at_once(
    tmp_path, shared_data_dir):
  """kill -9 of process 1 mid-run (a checkpoint committed, the next being written): process
  0 says so in one line and exits 1 within seconds; the committed checkpoint is untouched."""
  address = f"127.0.0.1:{_free_port()}"
  # The device count comes from --config.cpu_devices, not the 8 that XLA_FLAGS asks for.
  xla_flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled", "XLA_FLAGS": xla_flags}
  workdir = tmp_path / "run"
  errors = [open(tmp_path / f"err{pid}", "w+") for pid in range(2)]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "trainer", "--config", "configs/tiny_cpu.py",
       f"--workdir={workdir}", f"--coordinator_address={address}", "--num_processes=2",
       f"--process_id={pid}", "--config.cpu_devices=4", "--config.train.steps=1000",
       "--config.train.log_every=1", "--config.train.eval_every=0", *SHARED_FLAGS,
       "--config.checkpoint.every_steps=2", f"--config.data.data_dir={shared_data_dir}"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=errors[pid], text=True)
      for pid in range(2)]
  try:
    for line in procs[0].stdout:
      if line.startswith("step") and line.split()[1] == "3/1000":
        break
    else:
      raise AssertionError(open(tmp_path / "err0").read()[-3000:])
    checkpoints = workdir / "checkpoints"
    deadline = time.monotonic() + 30
    while not (os.path.isdir(checkpoints / "2") and _committed(checkpoints)):
      assert time.monotonic() < deadline, os.listdir(checkpoints)
      time.sleep(0.05)
    committed = _committed(checkpoints)
    procs[1].kill()
    seconds, _ = _finish(procs[0], timeout=60)
  finally:
    for proc in procs:
      proc.kill()
  errors[0].seek(0)
  err = errors[0].read()
  assert procs[0].returncode == 1 and seconds < 10, (procs[0].returncode, seconds, err[-3000:])
  lines = [line for line in err.splitlines() if "process 1 of 2" in line]
  assert len(lines) == 1 and lines[0].startswith(
      "error: process 1 of 2 stopped answering: it was killed"), err[-3000:]
  assert "re-run resumes from step" in lines[0], lines
  for noise in ("Traceback", "Gloo", "Check failure", "Fatal Python error"):
    assert noise not in err, err[-3000:]
  after = _committed(checkpoints)
  assert {path: after.get(path) for path in committed} == committed
