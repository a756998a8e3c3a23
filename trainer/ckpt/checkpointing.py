"""Orbax checkpoints that resume exactly and never restore a damaged state silently.

One checkpoint (`<workdir>/checkpoints/<step>/`) holds three items: `state` (parameters,
optimizer state and step, as sharded arrays), `data` (the data iterator's position, JSON)
and `meta` (the resolved config, the tokenizer's hash, the seed, and a fingerprint of every
array and of the data position). Orbax writes into a temporary directory and renames it when
committed, so a crash mid-save leaves the previous checkpoint as the newest committed one.

Orbax does not checksum array data: a flipped bit restores silently. So each save records
a fingerprint per array, computed on the devices (no host copy of the state), and each
restore recomputes and compares them.

Restoring tells damage from incompatibility:
- a checkpoint whose files cannot be read or whose data fails its fingerprint is damaged: it
  is moved to `checkpoints_unusable/` and the previous one is tried;
- a readable checkpoint of another config (the caller's `check_compatible` refuses its
  stored config) or of other array shapes is incompatible: the run stops, naming what
  differs, and nothing is moved.
A run never starts from scratch while `checkpoints/` or `checkpoints_unusable/` holds
anything, unless the caller says so (`start_over`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from trainer.ckpt import orbax_reads  # noqa: F401  (Orbax reads that fail leave no task behind)

# Position weights 2 * i * M + 1 (M is Knuth's multiplier) are odd, so a position-weighted
# sum changes under any single flipped bit and under swapped elements.
_TWICE_MULTIPLIER = np.uint32(2 * 2654435761 % 2**32)




class CheckpointError(RuntimeError):
  """A checkpoint problem the run cannot continue past; the message says what to do."""


class _Damaged(CheckpointError):
  """A checkpoint's own files are unreadable or fail their fingerprints."""


class StepRemoved(CheckpointError):
  """A step vanished while a tool read it: the run training there deleted it (it keeps the
  newest `checkpoint.keep`). No damage: the tool reads a newer step instead."""


# Read failures that say nothing about a checkpoint's files: moving it aside would not help.
_NOT_DAMAGE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE,
                                errno.ENOMEM})


def _not_about_the_files(error: BaseException) -> bool:
  """Out of memory (host or device), permissions or file descriptors, anywhere in the chain."""
  while error is not None:
    if isinstance(error, MemoryError) or (isinstance(error, OSError)
                                          and error.errno in _NOT_DAMAGE_ERRNOS):
      return True
    text = str(error)
    if "RESOURCE_EXHAUSTED: Out of memory" in text or "Permission denied" in text:
      return True
    error = error.__cause__ or error.__context__
  return False


_TENSORSTORE_SPEC = re.compile(r" ?\[tensorstore_spec='(?:[^'\\]|\\.)*'\]")


def _first_line(error: BaseException, limit: int = 300) -> str:
  """An error's first line without TensorStore's spec, shortened in the middle: the OS's
  reason ("No space left on device") comes at the end of a long line of paths."""
  line = (str(error).splitlines() or [type(error).__name__])[0]
  # TensorStore ends some messages with a pybind11 repr of its spec, and puts the spec itself
  # (hundreds of characters) between the OS's reason and the error code: no reason, only noise.
  line = line.split(" See full TensorStore details:")[0]
  line = _TENSORSTORE_SPEC.sub("", line)
  return line if len(line) <= limit else f"{line[:limit // 2]} ... {line[-limit // 2:]}"


def data_fingerprint(data_state: dict) -> str:
  """SHA-256 of the data iterator's position, as canonical JSON."""
  return hashlib.sha256(json.dumps(data_state, sort_keys=True).encode()).hexdigest()


def _leaf_name(path) -> str:
  """'opt_state.1.0.count' for a leaf path, whether it reads attributes, keys or indices."""
  return ".".join(str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key))))
                  for key in path)


def _leaf_table(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  return {_leaf_name(path): (tuple(leaf.shape), str(leaf.dtype))
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@jax.jit
def _fingerprints(tree) -> Any:
  """Per array: sum over i of bits[i] * (2 * i * M + 1) mod 2^32, plus an all-finite flag.

  Integer sums are exact and order-independent, so the value does not depend on how the
  array is sharded across devices, and any single flipped bit changes it.
  """

  def one(x):
    if x.dtype.itemsize == 2:
      bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif x.dtype.itemsize == 4:
      bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
      bits = x.astype(jnp.uint32)
    position = jnp.arange(bits.size, dtype=jnp.uint32).reshape(bits.shape)
    weights = position * _TWICE_MULTIPLIER + 1
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else True
    return jnp.sum(bits * weights, dtype=jnp.uint32), jnp.asarray(finite)

  pairs = [one(x) for x in jax.tree.leaves(tree)]
  return [sum_ for sum_, _ in pairs], jnp.all(jnp.stack([ok for _, ok in pairs]))


def _fingerprint_table(state) -> tuple[dict[str, int], bool]:
  sums, finite = jax.device_get(_fingerprints(state))
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state)]
  return {path: int(value) for path, value in zip(paths, sums)}, bool(finite)


class _KeepNewestAndLastFollowed:
  """Orbax's preservation policy: the `keep` newest checkpoints, and beside them the newest one
  that a finite step followed.

  A checkpoint is not known to be usable until the step after it comes out finite: an update
  can blow the weights up without a NaN yet, and the next step then overflows. Keeping the
  newest followed one means a run stopped by a non-finite step always has a checkpoint to
  resume from (with `keep=1`, two exist while the newest is unproven)."""

  def __init__(self, keep: int):
    self.keep = keep
    self.followed: int | None = None  # The newest step whose next step came out finite.

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    del context
    steps = [info.step for info in checkpoints]
    newest = set(sorted(steps)[-self.keep:])
    followed = [s for s in steps if self.followed is not None and s <= self.followed]
    return [step in newest or step == max(followed, default=None) for step in steps]


class Checkpointer:
  """Saves every `every_steps` (and when forced; never with 0), keeps the newest `keep` (and
  the newest one a finite step followed), restores the newest good one."""

  def __init__(self, workdir: str, every_steps: int, keep: int, use_async: bool,
               read_only: bool = False):
    """`read_only` (exports, inspection) writes nothing and leaves a running save's temporary
    directory alone; a training run's checkpointer removes crashed saves' leftovers."""
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.every_steps = every_steps
    self._saving: int | None = None  # The step of the newest save started.
    self._confirmed: int | None = None  # The newest save `check` has seen committed.
    self._policy = _KeepNewestAndLastFollowed(keep)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=None if read_only else self._policy,
            enable_async_checkpointing=use_async,
            create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only,  # Leftovers of a crashed save are removed.
            save_interval_steps=1),  # The loop decides when; see `due`.
        item_handlers={"state": ocp.StandardCheckpointHandler(),  # Handlers, not names:
                       "data": ocp.JsonCheckpointHandler(),  # item_metadata reads shapes
                       "meta": ocp.JsonCheckpointHandler()})  # without a restore.

  @property
  def saves(self) -> bool:
    """Whether this run keeps checkpoints (`checkpoint.every_steps=0` keeps none)."""
    return self.every_steps > 0

  def due(self, step: int) -> bool:
    return self.saves and step % self.every_steps == 0

  def save(self, step: int, state, data_state: dict, meta: dict) -> None:
    """Starts a save (async when configured); raises if an earlier async save failed."""
    # Orbax waits for the previous save before it starts a new one anyway; waiting here first
    # makes a failure of that previous save surface under its own step number.
    self._surface_errors(self._manager.wait_until_finished)
    self._surface_errors(self._manager.check_for_errors)
    fingerprints, finite = _fingerprint_table(state)
    if not finite:
      raise CheckpointError(f"refusing to save step {step}: the state holds NaN or Inf")
    self._saving = step
    meta = {**meta, "step": step, "fingerprints": fingerprints,
            "data_fingerprint": data_fingerprint(data_state)}
    self._surface_errors(lambda: self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta))))

  def check(self) -> None:
    """Raises CheckpointError if the background save has failed; cheap, called every step so
    a failed save stops the run at once instead of at the next save.

    Single process only: each host would see its save end at its own step, and one host
    leaving while the others enter the next step's collectives hangs them. With several
    processes a failure surfaces at the next save, which every host waits for.
    """
    if self._saving is None or self._saving == self._confirmed or jax.process_count() > 1:
      return
    if self._manager.is_saving_in_progress():
      return
    self.wait()  # The save has ended: this returns at once, or raises its error.
    self._confirmed = self._saving

  def wait(self) -> None:
    """Blocks until every save has committed; raises CheckpointError if one failed."""
    self._surface_errors(self._manager.wait_until_finished)
    self._surface_errors(self._manager.check_for_errors)

  def step_was_finite(self, step: int) -> None:
    """Step `step` came out finite: the state it started from, step - 1's, is usable."""
    self._policy.followed = step - 1

  def finish(self) -> None:
    """Waits for every save of a run that ended cleanly, then keeps the newest `keep`: the
    run's last state is its result, so no older one need stay beside it."""
    self.wait()
    if self.saves:  # With saves off (benchmarks) the workdir's checkpoints are left alone.
      for step in self.steps()[:-self._policy.keep]:
        self._manager.delete(step)

  def set_aside_what_led_to(self, step: int) -> list[str]:
    """Moves aside the checkpoints from step `step - 1` on, after the non-finite step `step`:
    the state it started from may be what overflowed, and a re-run must not resume from it
    into the same failure. Waits for saves first; returns where each went."""
    self.wait()
    return [self._set_aside(other) for other in self.steps() if other >= step - 1]

  def _surface_errors(self, action) -> None:
    """Runs an Orbax call; a failed save (a full disk, say) becomes one clear error."""
    try:
      action()
    except CheckpointError:
      raise
    except Exception as error:  # noqa: BLE001  (Orbax and tensorstore raise many kinds)
      reason = _first_line(error)
      latest = self.latest_committed()
      raise CheckpointError(
          f"saving step {self._saving} failed ({reason}); the newest committed checkpoint "
          f"is {f'step {latest}' if latest is not None else 'none'} in {self.directory}"
      ) from error

  def has_checkpoints(self) -> bool:
    return bool(self._manager.all_steps())

  def reached_preemption(self, step: int) -> bool:
    """True at the step where all hosts agreed to stop (a multi-host preemption notice)."""
    return self._manager.reached_preemption(step)

  def latest_committed(self) -> int | None:
    return self._manager.latest_step()

  @property
  def unusable_directory(self) -> str:
    return os.path.join(os.path.dirname(self.directory), "checkpoints_unusable")

  def restore(self, abstract_state, check_compatible: Callable[[int, dict], None] | None = None,
              start_over: bool = False) -> tuple[int, Any, dict, dict] | None:
    """(step, state, data_state, meta) of the newest usable checkpoint, or None for a new run.

    `abstract_state` gives shapes, dtypes and the target shardings, which may differ from
    those the checkpoint was saved with (Orbax reshards on read); a function of the step
    when they depend on it (a staged run's stages). `check_compatible(step, meta)` raises
    if the checkpoint's stored config cannot be resumed with this one.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    for step in steps:
      target = abstract_state(step) if callable(abstract_state) else abstract_state
      try:
        meta = self._read(step, meta=ocp.args.JsonRestore()).meta
        if check_compatible:
          check_compatible(step, meta)  # Raises through: a config error, nothing moved.
        self._check_shapes(step, target)
        restored = self._read(step, state=ocp.args.StandardRestore(target),
                              data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        self._verify(step, restored.state, restored.meta, restored.data)
      except _Damaged as error:
        kept = self._set_aside(step)
        print(f"checkpoint {self.directory}/{step} is unusable ({error}); moved it to "
              f"{kept} and trying an older one", flush=True)
        continue
      return step, restored.state, restored.data, restored.meta
    set_aside = sorted(os.listdir(self.unusable_directory)) if os.path.isdir(
        self.unusable_directory) else []
    if set_aside and not start_over:
      raise CheckpointError(
          f"no usable checkpoint in {self.directory}, and {self.unusable_directory} holds "
          f"{len(set_aside)} damaged one(s) ({', '.join(set_aside[:3])}"
          f"{', ...' if len(set_aside) > 3 else ''}): refusing to start from step 0 without a "
          f"word; inspect them, then pass --start_over_from_step_0 to train from scratch here")
    return None

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def read_params(self, step: int, abstract_state_of: Callable[[dict], Any]) -> tuple[Any, dict]:
    """(params, meta) of one step, verified against their fingerprints; moves nothing, so a
    damaged step is an error here. `abstract_state_of(meta)` gives the target shapes and
    shardings from the step's stored config. Only the parameters are read: the optimizer's
    moments, twice their size, stay on disk (an export or a sampler never needs them)."""
    try:
      meta = self._read(step, meta=ocp.args.JsonRestore()).meta
      abstract_state = abstract_state_of(meta)
      self._check_shapes(step, abstract_state)
      wanted = {"params": abstract_state.params}
      restore = ocp.args.PyTreeRestore(  # Orbax's partial restore: the rest is not read.
          item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted),
          partial_restore=True)
      with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
        params = self._guard(step, lambda: reader.restore(
            os.path.join(self.directory, str(step), "state"), args=restore))["params"]
      # Only the parameters' leaves remain to fingerprint (None is no leaf).
      self._verify(step, abstract_state.replace(step=None, params=params, opt_state=None), meta,
                   only=".params")
    except _Damaged as error:
      if self._removed(step):
        raise StepRemoved(f"checkpoint {self.directory}/{step} was removed by the running job "
                          f"while it was read") from error
      others = [str(other) for other in self.steps() if other != step]
      pick = f"; --step picks another ({', '.join(others[-3:])})" if others else ""
      raise CheckpointError(f"checkpoint {self.directory}/{step} is damaged ({error}); "
                            f"nothing was moved{pick}") from error
    return params, meta

  def _removed(self, step: int, patience_s: float = 5.0) -> bool:
    """Whether `step` is gone, or going: a running job deletes a step beyond `checkpoint.keep`
    file by file once a newer one is committed, so for a moment a step being deleted still
    exists beside a newer one."""
    path = os.path.join(self.directory, str(step))
    deadline = time.monotonic() + patience_s
    while os.path.isdir(path):
      newer = [name for name in os.listdir(self.directory) if name.isdigit() and int(name) > step]
      if not newer or time.monotonic() > deadline:
        return False
      time.sleep(0.1)
    return True

  def _read(self, step: int, **items) -> Any:
    """Restores the named items of one step."""
    return self._guard(step, lambda: self._manager.restore(step,
                                                           args=ocp.args.Composite(**items)))

  def _guard(self, step: int, read: Callable[[], Any]) -> Any:
    """`read()`; a failure to read a step is damage, unless it says nothing about the files
    (permissions, memory, descriptors)."""
    try:
      return read()
    except Exception as error:  # noqa: BLE001  (Orbax and tensorstore raise many kinds)
      reason = _first_line(error)
      if _not_about_the_files(error):
        raise CheckpointError(
            f"cannot read checkpoint {self.directory}/{step} ({reason}); this is not damage "
            f"to it, so nothing was moved; fix the cause and run again") from error
      raise _Damaged(reason) from error

  def _check_shapes(self, step: int, abstract_state) -> None:
    """Stops (nothing moved) when the checkpoint's arrays are not this config's state."""
    try:
      saved = _leaf_table(self._manager.item_metadata(step)["state"])
    except Exception as error:  # noqa: BLE001
      raise _Damaged(f"its array metadata is unreadable: {_first_line(error, 200)}") from error
    if not saved:  # Orbax returns nothing, not an error, when the metadata file is gone.
      raise _Damaged("its array metadata is missing")
    wanted = _leaf_table(abstract_state)
    if saved == wanted:
      return
    missing, extra = sorted(wanted.keys() - saved.keys()), sorted(saved.keys() - wanted.keys())
    reshaped = sorted(name for name in wanted.keys() & saved.keys()
                      if wanted[name] != saved[name])
    what = (f"{reshaped[0]} is {saved[reshaped[0]]} there and {wanted[reshaped[0]]} here"
            if reshaped else f"this config's state has {len(missing)} array(s) it lacks "
            f"({', '.join(missing[:2]) or 'none'}) and lacks {len(extra)} it has "
            f"({', '.join(extra[:2]) or 'none'})")
    raise CheckpointError(
        f"checkpoint {self.directory}/{step} holds another config's state ({what}): a config "
        f"change, not damage, so nothing was moved; resume with the checkpoint's config or "
        f"use a new --workdir")

  def _set_aside(self, step: int) -> str:
    """Moves a damaged checkpoint out of Orbax's way (a later save reuses its step), keeping it
    for inspection rather than deleting anything. Process 0 moves it; all wait for that."""
    target = os.path.join(self.unusable_directory, f"{step}-{int(time.time())}")
    if jax.process_index() == 0:
      try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(os.path.join(self.directory, str(step)), target)
      except OSError as error:
        raise CheckpointError(f"checkpoint {self.directory}/{step} is damaged and cannot be "
                              f"moved aside to {target}: {error.strerror or error}") from error
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
    self._manager.reload()
    return target

  @staticmethod
  def _verify(step: int, state, meta: dict, data_state: dict | None = None,
              only: str = "") -> None:
    """Raises _Damaged when the restored arrays or data position fail their fingerprints.
    With `only`, `state` holds just the arrays under that path prefix (a partial read)."""
    try:
      actual, _ = _fingerprint_table(state)
    except Exception as error:  # noqa: BLE001  (an XLA error, e.g. out of device memory)
      raise CheckpointError(f"cannot fingerprint the restored step {step} to verify it "
                            f"({_first_line(error)}); nothing was moved") from error
    expected = {name: value for name, value in meta.get("fingerprints", {}).items()
                if name.startswith(only)}
    if set(actual) != set(expected):
      raise _Damaged(f"step {step}: arrays differ from the recorded fingerprints")
    damaged = [name for name, value in actual.items() if value != expected[name]]
    if damaged:
      raise _Damaged(f"step {step}: data of {damaged[0]} does not match its fingerprint"
                     f"{f' (and {len(damaged) - 1} more)' if len(damaged) > 1 else ''}")
    recorded = meta.get("data_fingerprint")  # Absent in checkpoints of older versions.
    if data_state is not None and recorded and data_fingerprint(data_state) != recorded:
      raise _Damaged(f"step {step}: the data position does not match its fingerprint")

  def close(self) -> None:
    self._manager.close()
