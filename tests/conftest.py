"""Gives JAX 8 simulated CPU devices before it starts, for every test."""

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile

# The suite spends most of its time compiling tiny programs, so it compiles them the cheaper
# way: LLVM at -O1 instead of -O2 (no fast-math; every comparison runs both sides in one
# session). JAX 0.11's XLA:CPU has only its MLIR fusion emitters (the flag that chose the
# elemental one is gone); its other compile-time flags (-O0, FAST_COMPILE, one codegen
# split) left tests/test_ring_attention.py within 3% of this.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=1"
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
# One persistent compilation cache for the session, shared with the trainer subprocesses that
# tests start (they inherit the environment): the many tiny runs compile the same programs.
# One known exception on XLA:CPU (tests/test_stages.py's config): a reloaded step may run a
# device's collectives in another order than its peers, and rendezvous.cc aborts.
_CACHE_DIR = tempfile.mkdtemp(prefix="jax-cache-")
atexit.register(shutil.rmtree, _CACHE_DIR, True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (must come after the flags above)

jax.config.update("jax_num_cpu_devices", 8)


import functools  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402

import pytest  # noqa: E402


# What the tests' tiny runs share, in this process and in the `python -m trainer` subprocesses
# they start (SHARED_FLAGS), so that they compile one program, which the persistent cache
# serves to every test after the first: the learning-rate schedule's length (a constant of the
# compiled step, so runs that differ only in their number of steps share one schedule), and a
# batch of 4 rows, not the config's 8 (one fsdp pair of 2 rows still; a step costs about 0.12
# CPU-s less on 2 cores, and the suite trains hundreds).
SCHEDULE_STEPS = 100
BATCH_SIZE = 4
SHARED_FLAGS = (f"--config.train.schedule_steps={SCHEDULE_STEPS}",
                f"--config.train.batch_size={BATCH_SIZE}")


def tiny_cpu_config(data_dir: str, attention: str | None = None, **overrides):
  """configs/tiny_cpu.py (optionally a layout variant) as the tests train it: on `data_dir`,
  no periodic eval, the shared schedule and batch; then `overrides` ("group.key": value)."""
  config = importlib.import_module("configs.tiny_cpu").get_config(attention)
  config.data.data_dir = data_dir
  config.train.eval_every = 0
  config.train.schedule_steps = SCHEDULE_STEPS
  config.train.batch_size = BATCH_SIZE
  for path, value in overrides.items():
    group, key = path.split(".")
    config[group][key] = value
  return config


@contextlib.contextmanager
def mounted_tmpfs(path, options: str):
  """A tmpfs mounted at `path` (made here) with mount `options` ("size=1M", "ro,size=1M")
  for as long as the block runs; the test skips where it cannot mount (needs root, as in CI's
  container)."""
  path.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                    capture_output=True).returncode:
    pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root)")
  try:
    yield path
  finally:
    subprocess.run(["umount", str(path)], check=False)


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory):
  """One prepared-data cache (dataset + tokenizer) for every test that trains."""
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture
def tiny_config(shared_data_dir):
  """Returns a fresh tiny_cpu config (optionally a layout variant) on the shared data cache."""
  return functools.partial(tiny_cpu_config, shared_data_dir)


def pytest_collection_finish(session):
  """What collection imported (JAX, flax, orbax, the project's modules: objects that live as
  long as the worker) is moved out of the garbage collector's reach, so a full collection
  scans only what the tests made since."""
  del session
  gc.freeze()


def pytest_collection_modifyitems(items):
  """Modules with slow tests first, the slowest module first, each module's slow tests at
  its head (`@pytest.mark.slow(SECONDS)`). `make test` hands whole modules to its xdist
  workers (`--dist loadscope`: a module-scoped fixture is set up once, on one worker), so a
  module of minutes that started last would leave the other worker idle for its length."""
  def seconds(item):
    marker = item.get_closest_marker("slow")
    return 0 if marker is None else marker.args[0] if marker.args else 60

  modules = {}
  for item in items:
    modules.setdefault(item.module.__name__, []).append(item)
  ordered = sorted(modules.values(), key=lambda group: -sum(map(seconds, group)))
  items[:] = [item for group in ordered for item in sorted(group, key=lambda i: -seconds(i))]


# `TEST_CPU_REPORT=FILE make test` appends a JSON line per test to FILE: the CPU seconds of
# its worker and of the subprocesses it waited for, setup included (the suite's time is its
# CPU: docs/development.md). Not the processes Slurm starts, nor a killed one never waited.
_CPU_REPORT = os.environ.get("TEST_CPU_REPORT")


def _cpu_seconds() -> tuple[float, float]:
  own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                        resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  before = _cpu_seconds() if _CPU_REPORT else None
  yield
  if before:
    after = _cpu_seconds()
    with open(_CPU_REPORT, "a", encoding="utf-8") as f:
      f.write(json.dumps({"test": item.nodeid, "cpu_s": round(after[0] - before[0], 2),
                          "subprocess_cpu_s": round(after[1] - before[1], 2)}) + "\n")
