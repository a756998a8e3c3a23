"""scripts/slurm_train.sh, unchanged, under a real Slurm: a one-node cluster of the test's own.

munged, slurmctld and slurmd run as this test's children on a generated slurm.conf in a
temporary folder (removed after, with the runs); Debian's `slurm-wlm` and `munge`, which
`make test` installs where apt-get works. Where Slurm cannot start, the test skips saying
why. One job of 2 tasks x 4 CPU devices, submitted once with sbatch and requeued twice:

  1. preempted by `scancel --signal=TERM` (what `--signal=TERM@300` does before the time
     limit): both processes save one agreed step and exit 0;
  2. requeued: it resumes from that step; then one task is killed with kill -9 (as soon as
     the run says it resumed, before its first step: tests/test_peer_loss.py kills one in
     the middle of a run): the other names it in one line and exits 1,
     `--kill-on-bad-exit` ends the job, and the committed checkpoint is untouched;
  3. requeued again: it resumes from that step and finishes.

The losses of the three runs, step by step, are bitwise those of one process with 8
devices run through the same collectives (`--coordinator_address=127.0.0.1:PORT
--num_processes=1 --process_id=0` puts one process on JAX's multi-process runtime, so on
Gloo, as the job's two are). A plain one-process run differs in the last bit on some steps
(1 ulp on 6 of 20 losses): XLA:CPU's in-process all-reduce sums the 8 devices' values in
rank order, x0 + x1 + ... + x7, where Gloo's ring sums chunk c of a buffer from rank c - 1
down, x[c-1] + x[c-2] + ... + x[c] (mod 8). The order depends on the collectives, not on
the number of processes; putting one-process CPU runs on Gloo too would make them 2.4 times
slower.

Where the time goes: three starts of two processes (Python, JAX, and on CPU process 1
compiles the step at every start: JAX's persistent cache keys a CPU program by its
process's topology, and only process 0 writes), and the one-process run, started once the
job has prepared the data, which uses the core that process 0 leaves idle while process 1
compiles.
"""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo",
             "squeue")
# JAX's Slurm detection puts the coordinator on this port range, by job id.
_JAX_PORTS = (65536 - 4096, 65536)
# The tiny config in float32 on one 20-step schedule: test_parallel_training's reference, so
# that the persistent compilation cache may already hold the one-process program.
_OVERRIDES = {"train.log_every": 1, "train.steps": STEPS, "train.schedule_steps": 20,
              "train.eval_every": 0, "model.dtype": "float32", "checkpoint.every_steps": 1000}


def _free_port(low: int = 0, high: int = 0) -> int:
  """A port nobody listens on: any, or one in [low, high)."""
  for _ in range(100):
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", random.randrange(low, high) if high else 0))
      except OSError:
        continue
      return s.getsockname()[1]
  raise OSError(f"no free port in [{low}, {high})")


def _missing_commands() -> list[str]:
  path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
  return [name for name in _COMMANDS if not shutil.which(name, path=path)]


class Cluster:
  """One node ("localhost", 2 CPUs) and its controller, with munge, all under `folder`."""

  def __init__(self, folder: str):
    self.folder = folder
    self.conf = os.path.join(folder, "slurm.conf")
    self.daemons: list[subprocess.Popen] = []
    self.env = {name: value for name, value in os.environ.items()
                if not name.startswith("SLURM_")}  # A test run inside a Slurm job.
    self.env["SLURM_CONF"] = self.conf
    self.env["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])

  def start(self) -> None:
    """Starts the daemons; pytest.skip naming the reason when the node never comes up."""
    munge = os.path.join(self.folder, "munge")
    os.makedirs(munge, mode=0o755)  # munged wants its socket's folder open to all.
    key = os.path.join(munge, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o400), "wb") as f:
      f.write(os.urandom(1024))
    socket_path = os.path.join(munge, "socket")
    self._daemon("munged", "--foreground", "--force", f"--socket={socket_path}",
                 f"--key-file={key}", f"--pid-file={munge}/pid", f"--seed-file={munge}/seed")
    self._write_conf(socket_path)
    self._daemon("slurmctld", "-D")
    self._daemon("slurmd", "-D", "-N", "localhost")
    self._wait_until_idle()

  def _write_conf(self, munge_socket: str) -> None:
    folder = self.folder
    for name in ("state", "spool"):
      os.makedirs(os.path.join(folder, name))
    # The job's id picks JAX's coordinator port: one nobody listens on.
    first_job_id = _free_port(*_JAX_PORTS) - _JAX_PORTS[0] + 4096
    settings = {
        "ClusterName": "test", "SlurmctldHost": "localhost", "SlurmUser": "root",
        "SlurmctldPort": _free_port(), "SlurmdPort": _free_port(),
        "AuthType": "auth/munge", "CredType": "cred/munge",
        "AuthInfo": f"socket={munge_socket}", "StateSaveLocation": f"{folder}/state",
        "SlurmdSpoolDir": f"{folder}/spool", "SlurmctldPidFile": f"{folder}/slurmctld.pid",
        "SlurmdPidFile": f"{folder}/slurmd.pid", "SlurmctldLogFile": f"{folder}/slurmctld.log",
        "SlurmdLogFile": f"{folder}/slurmd.log", "MailProg": "/bin/true",
        # No cgroups, accounting or MPI: a container has none of them.
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none", "JobCompType": "jobcomp/none",
        "MpiDefault": "none", "SwitchType": "switch/none",
        "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU",
        # 2 CPUs for the 2 tasks whatever the machine has.
        "SlurmdParameters": "config_overrides", "ReturnToService": 2,
        "FirstJobId": first_job_id, "KillWait": 1,
    }
    lines = [f"{name}={value}" for name, value in settings.items()] + [
        f"NodeName=localhost NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs=2 "
        f"State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP"]
    with open(self.conf, "w") as f:
      f.write("\n".join(lines) + "\n")

  def _daemon(self, name: str, *args: str) -> None:
    with open(os.path.join(self.folder, f"{name}.out"), "w") as log:
      self.daemons.append(subprocess.Popen([shutil.which(name, path=self.env["PATH"]), *args],
                                           env=self.env, stdout=log, stderr=subprocess.STDOUT))

  def _wait_until_idle(self, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      state = self.command("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
      if state == "idle":
        return
      if any(daemon.poll() is not None for daemon in self.daemons):
        break
      time.sleep(0.2)
    pytest.skip(f"Slurm did not start (node state {state!r}): {self.logs_tail()}")

  def logs_tail(self, lines: int = 3) -> str:
    tails = []
    for name in ("munged.out", "slurmctld.log", "slurmd.log", "slurmd.out"):
      path = os.path.join(self.folder, name)
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          tails.append(f"{name}: " + " | ".join(f.read().splitlines()[-lines:]))
    return "; ".join(tails)

  def stop(self) -> None:
    """Cancels what still runs, then stops the daemons (slurmd first, munged last)."""
    if self.daemons and self.daemons[-1].poll() is None:
      self.command("scancel", "--user=root", check=False)
      deadline = time.monotonic() + 30
      while (time.monotonic() < deadline
             and self.command("squeue", "-h", "-t", "R,CG", check=False).stdout.strip()):
        time.sleep(0.2)
    for daemon in reversed(self.daemons):
      daemon.terminate()
      try:
        daemon.wait(timeout=15)
      except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()

  def command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=self.env, capture_output=True, text=True, check=check,
                          timeout=60)

  def job(self, job_id: str) -> dict[str, str]:
    """The job's fields as `scontrol show job` gives them (JobState, ExitCode, ...)."""
    line = self.command("scontrol", "show", "job", "-o", job_id).stdout
    return dict(field.split("=", 1) for field in line.split() if "=" in field)

  def wait_until_ended(self, job_id: str, timeout: float = 240) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      job = self.job(job_id)
      if job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        return job
      time.sleep(0.5)  # An `scontrol` each time: see _wait_for_line.
    raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout} s")

  def requeue(self, job_id: str) -> None:
    """Requeues an ended job, to start now: Slurm holds a requeued job back for 2 minutes.
    Returns once the job shows the restart (until then it shows its old end)."""
    restarts = int(self.job(job_id)["Restarts"])
    # slurmd refuses to start a job in the same second its last run was killed ("Job
    # credential revoked": it compares whole seconds).
    time.sleep(1.1)
    self.command("scontrol", "requeue", job_id)
    self.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    deadline = time.monotonic() + 30
    while int(self.job(job_id)["Restarts"]) == restarts:
      assert time.monotonic() < deadline, f"job {job_id} was not requeued"
      time.sleep(0.1)

  def task_pid(self, job_id: str, task: int) -> int:
    """The process id of task `task` of the job's srun step (the trainer: the script execs
    it)."""
    for line in self.command("scontrol", "listpids", job_id).stdout.splitlines()[1:]:
      pid, _, step, _, global_id = line.split()[:5]
      if step not in ("batch", "-") and global_id == str(task):
        return int(pid)
    raise LookupError(f"job {job_id} has no task {task}")


@contextlib.contextmanager
def _slurm_cluster():
  """A started Cluster in a temporary folder; everything stopped and removed after."""
  missing = _missing_commands()
  if missing:
    pytest.skip(f"Slurm is not installed (no {', '.join(missing)}): Debian's slurm-wlm and "
                f"munge, which `make test` installs with apt-get where it can")
  if os.geteuid() != 0:
    pytest.skip(f"slurmd must run as root to start tasks; this is uid {os.geteuid()}")
  folder = tempfile.mkdtemp(prefix="slurm-")  # Short: munge's socket path has a limit.
  cluster = Cluster(folder)
  try:
    cluster.start()
    yield cluster
  finally:
    cluster.stop()
    shutil.rmtree(folder, ignore_errors=True)


def _trainer_env(cluster: Cluster) -> dict[str, str]:
  """The environment of the job and of the reference run: the same XLA flags (the suite's),
  but each process's devices from --config.cpu_devices, not the suite's 8."""
  xla_flags = os.environ.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=8", "")
  return {**cluster.env, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu",
          "WANDB_MODE": "disabled",
          "PATH": os.pathsep.join([os.path.dirname(sys.executable), cluster.env["PATH"]])}


def _trainer_flags(data_dir: str) -> list[str]:
  # Dense attention: the launch does not depend on the layout, and each of the job's five
  # compiles (see the module's docstring) takes about two thirds of striped's.
  return ["configs/tiny_cpu.py", f"--config.data.data_dir={data_dir}",
          *(f"--config.{name}={value}" for name, value in _OVERRIDES.items())]


def _submit(cluster: Cluster, runs: str, workdir: str, data_dir: str) -> str:
  """sbatch of the script as a user would on a CPU allocation: 1 node, 2 tasks, no GPUs."""
  config, *flags = _trainer_flags(data_dir)
  result = subprocess.run(
      ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
       f"--output={runs}/slurm-%j.out", "scripts/slurm_train.sh", config, workdir,
       "--config.cpu_devices=4", *flags],
      cwd=ROOT, env=_trainer_env(cluster), capture_output=True, text=True, check=True,
      timeout=60)
  return result.stdout.strip().split(";")[0]


@contextlib.contextmanager
def _one_process_run(cluster: Cluster, runs: str, data_dir: str):
  """Starts the reference: the same command in one process of 8 devices, on JAX's
  multi-process runtime (so on Gloo, as the job is). Yields a function that waits for it
  and returns its losses; the process is killed if the test ends first."""
  workdir = os.path.join(runs, "one_process")
  config, *flags = _trainer_flags(data_dir)
  with open(os.path.join(runs, "one_process.out"), "w+") as log:
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "--config", config, "--workdir", workdir,
         "--config.cpu_devices=8", *flags, f"--coordinator_address=127.0.0.1:{_free_port()}",
         "--num_processes=1", "--process_id=0"],
        cwd=ROOT, env=_trainer_env(cluster), stdout=log, stderr=subprocess.STDOUT)

    def losses() -> list[tuple[int, float]]:
      proc.wait(timeout=240)
      log.seek(0)
      assert proc.returncode == 0, log.read()[-3000:]
      return _losses(workdir)

    try:
      yield losses
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def _output(runs: str, job_id: str) -> str:
  path = os.path.join(runs, f"slurm-{job_id}.out")
  if not os.path.exists(path):
    return ""
  with open(path, errors="replace") as f:
    return f.read()


def _wait_for_line(cluster: Cluster, runs: str, job_id: str, pattern: str, start: int) -> None:
  """Waits until the job's log, from offset `start` on, has a line that starts with the
  regular expression `pattern`."""
  line = re.compile(f"^{pattern}", re.MULTILINE)
  deadline = time.monotonic() + 240
  asked = 0.0
  while not line.search(_output(runs, job_id)[start:]):
    # The log every 0.1 s, the job's state once a second: each `scontrol` is a process and
    # an authenticated call to slurmctld (at 0.1 s they cost the suite seconds of CPU).
    if time.monotonic() - asked >= 1.0:
      job, asked = cluster.job(job_id), time.monotonic()
      assert job["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), (
          f"job {job_id} {job['JobState']} before a line {pattern!r}:\n"
          + _output(runs, job_id)[start:][-3000:] + cluster.logs_tail(15))
    assert time.monotonic() < deadline, _output(runs, job_id)[start:][-3000:]
    time.sleep(0.1)


def _saved_steps(workdir: str) -> list[int]:
  folder = os.path.join(workdir, "checkpoints")
  return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def _losses(workdir: str) -> list[tuple[int, float]]:
  """(step, loss) of every logged step, in the order logged (a resumed run appends)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def _log_since(runs: str, job_id: str, start: int) -> str:
  """The job's log from offset `start`: a requeued run appends to its predecessors'."""
  return _output(runs, job_id)[start:]


@pytest.mark.slow(90)
def test_a_slurm_job_preempted_killed_and_requeued_trains_the_losses_of_one_process(
    shared_data_dir):
  with contextlib.ExitStack() as stack:
    runs = stack.enter_context(tempfile.TemporaryDirectory(prefix="slurm-runs-"))
    cluster = stack.enter_context(_slurm_cluster())
    workdir = os.path.join(runs, "run")
    job = _submit(cluster, runs, workdir, shared_data_dir)
    _wait_for_line(cluster, runs, job, rf"step\s+1/{STEPS}\s", 0)
    cluster.command("scancel", "--signal=TERM", job)
    ended, preempted_log = cluster.wait_until_ended(job), _log_since(runs, job, 0)
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), preempted_log[-3000:]
    saved = _saved_steps(workdir)
    assert len(saved) == 1 and saved[0] < STEPS, (saved, preempted_log[-3000:])
    preempted = saved[0]
    # Both processes say it: the same step, agreed by JAX's preemption service.
    stop_line = (f"stopping at step {preempted} on preemption: saved a checkpoint; re-run with "
                 f"the same --workdir to resume\n")
    assert preempted_log.count(stop_line) == 2, preempted_log[-3000:]
    resume_line = f"resuming from step {preempted} ({workdir}/checkpoints/{preempted})\n"
    # The job has prepared the data: the reference runs from here on, beside the job.
    reference = stack.enter_context(_one_process_run(cluster, runs, shared_data_dir))

    cluster.requeue(job)
    start = len(preempted_log)
    _wait_for_line(cluster, runs, job, re.escape(resume_line), start)
    os.kill(cluster.task_pid(job, 1), signal.SIGKILL)
    ended, killed_log = cluster.wait_until_ended(job, timeout=60), _log_since(runs, job, start)
    assert resume_line in killed_log, killed_log[-3000:]
    assert ended["JobState"] == "FAILED", killed_log[-3000:]
    assert "srun: error: localhost: task 1: Killed\n" in killed_log, killed_log[-3000:]
    # The survivor names the dead process in one line (trainer/run/peers.py) and exits 1
    # before srun's --kill-on-bad-exit reaches it: no Gloo traceback, no C++ abort.
    survivor = [line for line in killed_log.splitlines() if "stopped answering" in line]
    assert len(survivor) == 1 and survivor[0].startswith(
        "error: process 1 of 2 stopped answering: it was killed"), killed_log[-3000:]
    for noise in ("Traceback", "Gloo AllGather failed", "Check failure"):
      assert noise not in killed_log, killed_log[-3000:]
    assert _saved_steps(workdir) == [preempted], killed_log[-3000:]

    cluster.requeue(job)
    start += len(killed_log)
    ended, resumed_log = cluster.wait_until_ended(job), _log_since(runs, job, start)
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), resumed_log[-3000:]
    assert resume_line in resumed_log, resumed_log[-3000:]
    _assert_losses_of_one_process(_losses(workdir), reference())


def _assert_losses_of_one_process(logged: list[tuple[int, float]],
                                  one_process: list[tuple[int, float]]) -> None:
  """Each step's loss is the one-process run's, bitwise (a step logged twice, by a run killed
  after it, both times)."""
  by_step = {}
  for step, loss in logged:
    assert by_step.setdefault(step, loss) == loss, (step, logged)
  assert sorted(by_step) == list(range(1, STEPS + 1)), logged
  assert sorted(by_step.items()) == one_process, "\n".join(
      f"step {step}: {loss!r} in the job, {expected!r} in one process"
      for (step, loss), (_, expected) in zip(sorted(by_step.items()), one_process))
