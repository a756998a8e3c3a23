"""Trains the tiny config in a process of its own, optionally SIGKILLing itself mid-save.

    python tests/crash_driver.py --workdir=W --data_dir=D [--kill=PHASE --kill_step=N]

Used by tests/test_crash.py. With `--kill`, Orbax is patched (in this process only) so that
during the async save of step N the process sends itself SIGKILL at one moment:

- `start`:  the step's temporary directory has just been created; nothing else written.
- `write`:  some arrays have been handed to TensorStore and written, others not yet.
- `commit`: every item is written and finalized and `commit_success.txt` is in the temporary
            directory, but it has not been renamed to its final name yet.
- `delete`: step N has committed, and the garbage collection of an older step (beyond
            `keep`) has unlinked about half of that step's files.

The process prints `crash_driver: SIGKILL <phase> ...` just before the kill, so the test
knows the patch fired (and a return code of -9 that the kill was real).

The patch points were read from orbax-checkpoint 0.12.8: `AtomicRenameTemporaryPath.create`
and `async_path.rename` (the commit of a local step is that rename), TensorStore's writes
through `serialization.async_serialize_from_host`, and `StandardCheckpointDeleter.delete`
(also behind Orbax's background deleter). If Orbax renames one, the driver fails loudly
(AttributeError, or "the patch never fired") rather than testing nothing.
"""

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import argparse  # noqa: E402
import importlib  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from orbax.checkpoint._src.path import async_path, atomicity, deleter  # noqa: E402
from orbax.checkpoint._src.serialization import serialization  # noqa: E402

PHASES = ("start", "write", "commit", "delete")


def _kill(phase: str, what: str) -> None:
  print(f"crash_driver: SIGKILL {phase} ({what})", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def _patch_start(step: int) -> None:
  """Kills right after the step's temporary directory is created (the save's first effect)."""
  real = atomicity.AtomicRenameTemporaryPath.create

  async def create(self):
    path = await real(self)
    if self.get_final().name == str(step):  # Not an item's ("state") temporary directory.
      _kill("start", f"created {path}")
    return path

  atomicity.AtomicRenameTemporaryPath.create = create


def _patch_write(step: int, after_arrays: int = 3) -> None:
  """Kills once a few arrays of the step have been written by TensorStore, the rest pending."""
  real = serialization.async_serialize_from_host
  written = {"n": 0}
  lock = threading.Lock()

  async def async_serialize_from_host(rslices_on_host, tensorstore_spec, **kwargs):
    await real(rslices_on_host, tensorstore_spec, **kwargs)
    if f"/{step}{atomicity.TMP_DIR_SUFFIX}/" in str(tensorstore_spec):
      with lock:
        written["n"] += 1
        if written["n"] == after_arrays:
          _kill("write", f"{written['n']} arrays written")

  serialization.async_serialize_from_host = async_serialize_from_host


def _patch_commit(step: int) -> None:
  """Kills just before the rename of `<step>.orbax-checkpoint-tmp` to `<step>` (the commit)."""
  real = async_path.rename

  async def rename(src, dst):
    if (os.path.basename(str(dst)) == str(step)
        and os.path.basename(str(src)).endswith(atomicity.TMP_DIR_SUFFIX)):
      _kill("commit", f"about to rename {src} to {dst}")
    return await real(src, dst)

  async_path.rename = rename


def _patch_delete(step: int) -> None:
  """Kills halfway through Orbax's own removal of the first old step it deletes after `step`
  committed (in Orbax's finalize thread, or its deleter thread if background delete is on)."""
  real_delete = deleter.StandardCheckpointDeleter.delete
  real_unlink = os.unlink
  state = {"armed": False, "left": 0, "victim": None}
  lock = threading.Lock()

  def delete(self, old_step: int) -> None:
    final = os.path.join(str(self._directory), str(step))
    if not state["victim"] and old_step < step and os.path.isdir(final):
      files = [f for _, _, fs in os.walk(os.path.join(str(self._directory), str(old_step)))
               for f in fs]
      with lock:
        state.update(armed=True, left=max(1, len(files) // 2), victim=old_step)
      print(f"crash_driver: deleting step {old_step} ({len(files)} files)", flush=True)
    return real_delete(self, old_step)

  def unlink(path, *args, **kwargs):
    result = real_unlink(path, *args, **kwargs)
    with lock:
      if state["armed"]:
        state["left"] -= 1
        if state["left"] == 0:
          _kill("delete", f"step {state['victim']} partially deleted")
    return result

  deleter.StandardCheckpointDeleter.delete = delete
  os.unlink = unlink


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--data_dir", required=True)
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--every_steps", type=int, default=4)
  parser.add_argument("--keep", type=int, default=1)
  parser.add_argument("--kill", choices=PHASES)
  parser.add_argument("--kill_step", type=int)
  args = parser.parse_args()

  if args.kill:
    globals()[f"_patch_{args.kill}"](args.kill_step)
  from trainer.run.loop import train  # pylint: disable=g-import-not-at-top

  config = importlib.import_module("configs.tiny_cpu").get_config()
  config.data.data_dir = args.data_dir
  config.train.eval_every = 0
  config.train.log_every = 1
  config.train.steps = args.steps
  # tests/conftest.py's SCHEDULE_STEPS and BATCH_SIZE: the step the other tests compile.
  config.train.schedule_steps = 100
  config.train.batch_size = 4
  config.checkpoint.every_steps = args.every_steps
  config.checkpoint.keep = args.keep
  train(config, args.workdir)
  if args.kill:
    sys.exit(f"crash_driver: the {args.kill} patch never fired at step {args.kill_step}")


if __name__ == "__main__":
  main()
