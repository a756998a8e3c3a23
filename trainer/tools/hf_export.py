"""One checkpoint step as a Hugging Face LLaMA directory that `transformers` loads.

    python -m trainer.export --workdir runs/tiny_cpu --out /tmp/tiny_hf [--step 100]
        [--dtype bfloat16|float32] [--tokenizer PATH] [--max_shard_gib 5]

Writes config.json (the current `rope_parameters` form, with the run's RoPE scaling and its
trained length as max_position_embeddings), the weights as model.safetensors or as shards
with model.safetensors.index.json, and the run's SentencePiece tokenizer.model (checked
against the hash the checkpoint recorded). The step is read with a read-only checkpointer
and verified against its fingerprints; a run training in the same workdir is not disturbed.
Everything is written into a temporary sibling `<out>.partial-<pid>` and renamed into place at
the end; an error, Ctrl-C or SIGTERM removes it, and the next export to `--out` removes those
of processes that are gone (SIGKILL), so no half-written directory stays behind.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import sys
import time

import flax.linen as nn
import jax
import ml_collections
import ml_dtypes
import numpy as np
import safetensors
import sentencepiece
from absl import app, flags, logging
from flax import traverse_util
from safetensors.numpy import save_file

import data
import parallelism
from model import Decoder
from model.hf_format import export_problem, hf_config_of, hf_shapes, tensor_names, to_hf
from trainer.ckpt.checkpointing import CheckpointError
from trainer.ckpt.tool_reads import read_step
from trainer.ckpt.resume import tokenizer_problem
from trainer.config import span_plan, stages
from trainer.core.optimizer import make_optimizer
from trainer.core.state import abstract_state
from trainer.core.training import data_config, model_config
from trainer.track import console

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
_OUT = flags.DEFINE_string("out", None, "Directory to write (must not exist, or be empty).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Stored weight dtype.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "SentencePiece model to ship; default the run's own (data.tokenizer, or "
    "the one preparation trained under data.data_dir).")
_MAX_SHARD_GIB = flags.DEFINE_float("max_shard_gib", 5.0, "Largest safetensors file.")


class ExportError(RuntimeError):
  """An export that cannot be done; the message names the flag or file to fix."""


class Terminated(BaseException):
  """SIGTERM while the files are written, raised as Ctrl-C's KeyboardInterrupt is, so that
  the partial directory is removed (SIGTERM's default action ends the process on the spot)."""


def export(workdir: str, out: str, step: int | None = None, dtype: str = "bfloat16",
           tokenizer: str | None = None, max_shard_bytes: int = 5 << 30,
           log=print) -> str:
  """Writes step `step` (default the newest) of `workdir` to `out`; returns a summary line."""
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ExportError(f"--out={out} already exists and is not an empty directory")
  parent = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK):  # Before minutes of reading.
    raise ExportError(f"cannot write --out={out}: its folder {parent} "
                      + ("does not exist" if not os.path.isdir(parent) else
                         "is not writable (permissions, or a read-only file system)"))
  if max_shard_bytes <= 0:
    raise ExportError("--max_shard_gib must be positive")
  # Every local device on fsdp: what the parameters need, whatever mesh trained them.
  mesh = parallelism.make_mesh({"data": 1, "fsdp": -1, "sequence": 1, "tensor": 1})
  found = {}

  def read(checkpointer, step):
    def abstract_state_of(meta):
      # A staged run's step exports with its stage's RoPE and length.
      config = stages.holding(stages.resolve(ml_collections.ConfigDict(meta["config"])), step).config
      span_plan.for_tools(config, workdir)  # The plan the run trained with, not its path's.
      rules = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                    for name, axes in config.mesh.rules)
      # The tokenizer is checked before the arrays are read: minutes for a large model.
      path = tokenizer or _run_tokenizer(data.tokenizer_path(data_config(config)),
                                         meta.get("tokenizer_sha256"))
      found.update(config=config, rules=rules, tokenizer=path,
                   pieces=_checked_tokenizer(path, config.model.vocab_size))
      problem = export_problem(model_config(config))  # Before the arrays too.
      if problem:
        raise ExportError(problem)
      with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return abstract_state(Decoder(model_config(config)), make_optimizer(config.train),
                              mesh, rules)

    log(f"reading {checkpointer.directory}/{step}")
    return checkpointer.read_params(step, abstract_state_of)

  (params, meta), step = read_step(workdir, step, read, ExportError)

  config, tokenizer, pieces = found["config"], found["tokenizer"], found["pieces"]
  cfg = model_config(config)
  np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32

  def hf_tensors():
    """(name, array) of every tensor, one parameter leaf on the host at a time."""
    flat = traverse_util.flatten_dict(params)
    for tensor in tensor_names(cfg):
      host = np.asarray(jax.device_get(flat[tensor.path]))
      layers = list(host) if tensor.layered else [host]
      for name, layer in zip(tensor.hf_names(cfg.num_layers), layers):
        yield name, to_hf(layer, tensor.in_dims).astype(np_dtype)

  plan = _shard_plan(hf_shapes(cfg), np.dtype(np_dtype).itemsize, max_shard_bytes)
  hf_config = hf_config_of(cfg, config.data.seq_len, pieces.bos_id(), pieces.eos_id(), dtype)
  total = write_directory(out, hf_tensors(), plan, hf_config, tokenizer, log)
  return (f"exported step {step} of {workdir} to {out}: {len(set(plan.values()))} "
          f"safetensors file(s), "
          f"{total / 2**20:.1f} MiB {dtype}, tokenizer {tokenizer}")


def write_directory(out: str, tensors, plan: dict[str, str], hf_config: dict, tokenizer: str,
                    log=print) -> int:
  """Writes the (name, array) pairs as `plan` shards them, config.json and tokenizer.model
  into `<out>.partial-<pid>`, then renames it to `out`; returns the tensor bytes written.
  An error, Ctrl-C or SIGTERM removes the partial directory before it passes on."""
  partial = f"{out.rstrip('/')}.partial-{os.getpid()}"
  _remove_stale_partials(out)
  with console.signals_handled_by({signal.SIGTERM: _raise_terminated}), \
      console.ctrl_c_unwinds():
    try:
      os.makedirs(partial)
      total = _write_shards(tensors, plan, partial, log)
      with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
      # safetensors creates its files 0600: give them config.json's mode (the umask's).
      mode = os.stat(os.path.join(partial, "config.json")).st_mode & 0o777
      for file in set(plan.values()):
        os.chmod(os.path.join(partial, file), mode)
      shutil.copyfile(tokenizer, os.path.join(partial, "tokenizer.model"))
      if os.path.isdir(out):
        os.rmdir(out)  # Empty, checked by `export` before reading.
      os.rename(partial, out)
    except BaseException as error:
      shutil.rmtree(partial, ignore_errors=True)
      # A full disk, say: safetensors reports its own write errors as SafetensorError.
      if isinstance(error, (OSError, safetensors.SafetensorError)):
        raise ExportError(f"writing {out} failed ({error}); nothing was left there") from error
      raise
  return total


def _raise_terminated(signum, frame):
  """SIGTERM's handler while the files are written (`write_directory`)."""
  del signum, frame
  raise Terminated()


def _remove_stale_partials(out: str) -> None:
  """Removes the `<out>.partial-<pid>` directories of processes that no longer run here
  (an export killed by SIGKILL, which no handler sees), and this process's own."""
  prefix = f"{out.rstrip('/')}.partial-"
  for path in glob.glob(glob.escape(prefix) + "*"):
    pid = path[len(prefix):]
    if pid.isdigit() and (int(pid) == os.getpid() or not _is_running(int(pid))):
      shutil.rmtree(path, ignore_errors=True)


def _is_running(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # Signal 0: only asks whether the process exists.
  except ProcessLookupError:
    return False
  except PermissionError:  # Another user's process.
    return True
  return True


def _checked_tokenizer(path: str, vocab_size: int) -> sentencepiece.SentencePieceProcessor:
  """The SentencePiece model at `path`, if it is one whose ids the model's vocabulary holds
  (`transformers` would index past its embedding with a larger one)."""
  if not os.path.isfile(path):
    raise ExportError(f"tokenizer {path} does not exist")
  try:
    pieces = sentencepiece.SentencePieceProcessor(model_file=path)
  except (OSError, RuntimeError) as error:
    raise ExportError(f"tokenizer {path} is not a SentencePiece model ({str(error).strip()})"
                      ) from None
  if pieces.get_piece_size() > vocab_size:
    raise ExportError(f"tokenizer {path} has {pieces.get_piece_size()} pieces, more than the "
                      f"model's vocabulary ({vocab_size}); pass the run's, or a smaller one")
  return pieces


def _run_tokenizer(path: str, recorded_sha256: str | None) -> str:
  problem = tokenizer_problem(path, recorded_sha256)
  if problem:
    raise ExportError(f"{problem}; pass --tokenizer=PATH")
  return path


def _shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int,
                max_shard_bytes: int) -> dict[str, str]:
  """Tensor name -> file, in writing order, files of at most `max_shard_bytes` (a tensor
  larger than that gets its own), named as `transformers` names them."""
  shard_of, shard, size = {}, 0, 0
  for name, shape in shapes.items():
    nbytes = int(np.prod(shape)) * itemsize
    if size and size + nbytes > max_shard_bytes:
      shard, size = shard + 1, 0
    shard_of[name] = shard
    size += nbytes
  count = shard + 1
  if count == 1:
    return {name: "model.safetensors" for name in shard_of}
  return {name: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for name, i in shard_of.items()}


def _write_shards(tensors, plan: dict[str, str], directory: str, log) -> int:
  """Streams (name, array) pairs into the planned files, holding one file's tensors at a
  time; returns the bytes written."""
  shard: dict[str, np.ndarray] = {}
  total, start = 0, time.perf_counter()

  def flush():
    file = plan[next(iter(shard))]
    save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
    log(f"  wrote {file} ({len(shard)} tensors, {time.perf_counter() - start:.1f} s)")
    shard.clear()

  for name, array in tensors:
    if shard and plan[name] != plan[next(iter(shard))]:
      flush()
    shard[name] = array
    total += array.nbytes
  flush()
  if len(set(plan.values())) > 1:
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": plan}, f, indent=2)
  return total


def main(argv: list[str]) -> None:
  del argv
  # Orbax announces a read-only manager with warnings; the export says what it does itself.
  logging.set_verbosity(logging.ERROR)
  console.install_reader_hooks()  # A failed checkpoint read's echoes, folded.
  console.exit_at_ctrl_c()  # While it reads; writing, it removes what it wrote first.
  if not _MAX_SHARD_GIB.value * 2**30 >= 1:  # nan too.
    console.exit_with_error(f"--max_shard_gib={_MAX_SHARD_GIB.value:g} must be positive")
  try:
    print(export(_WORKDIR.value, _OUT.value, _STEP.value, _DTYPE.value, _TOKENIZER.value,
                 int(_MAX_SHARD_GIB.value * 2**30)), flush=True)
  except KeyboardInterrupt:
    console.exit_interrupted()
  except Terminated:
    print(f"stopped by SIGTERM; nothing was left at --out={_OUT.value}", file=sys.stderr,
          flush=True)
    sys.exit(128 + signal.SIGTERM)
  except (ExportError, CheckpointError) as error:
    console.exit_with_error(str(error))


def run() -> None:
  """The command: `python -m trainer.export`."""
  flags.mark_flags_as_required(["workdir", "out"])
  app.run(main)


if __name__ == "__main__":
  run()
