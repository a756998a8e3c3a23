"""Orbax checkpoints that resume exactly and never restore a damaged state silently.

One checkpoint (`<workdir>/checkpoints/<step>/`) holds three items: `state` (parameters,
optimizer state and step, as sharded arrays), `data` (the data iterator's position, JSON)
and `meta` (the resolved config, the seed, and a fingerprint of every array). Orbax writes
into a temporary directory and renames it when committed, so a crash mid-save leaves the
previous checkpoint as the newest committed one.

Orbax does not checksum array data: a flipped bit restores silently. So each save records
a fingerprint per array, computed on the devices (no host copy of the state), and each
restore recomputes and compares them. A checkpoint that fails to restore or to match is
reported and the previous one is tried; if checkpoints exist but none is usable the run
stops rather than silently starting from scratch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

# Position weights 2 * i * M + 1 (M is Knuth's multiplier) are odd, so a position-weighted
# sum changes under any single flipped bit and under swapped elements.
_TWICE_MULTIPLIER = np.uint32(2 * 2654435761 % 2**32)


class CheckpointError(RuntimeError):
  """A checkpoint problem the run cannot continue past; the message says what to do."""


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


class Checkpointer:
  """Saves every `every_steps` (and when forced), keeps the newest `keep`, restores the newest
  good one."""

  def __init__(self, workdir: str, every_steps: int, keep: int, use_async: bool):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.every_steps = every_steps
    self._saving: int | None = None  # The step of the newest save started.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=use_async, create=True,
            cleanup_tmp_directories=True,  # Leftovers of a crashed save are removed.
            save_interval_steps=1),  # The loop decides when; see `due`.
        item_names=("state", "data", "meta"))

  def due(self, step: int) -> bool:
    return step % self.every_steps == 0

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
    self._surface_errors(lambda: self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave({**meta, "step": step, "fingerprints": fingerprints}))))

  def wait(self) -> None:
    """Blocks until every save has committed; raises CheckpointError if one failed."""
    self._surface_errors(self._manager.wait_until_finished)
    self._surface_errors(self._manager.check_for_errors)

  def _surface_errors(self, action) -> None:
    """Runs an Orbax call; a failed save (a full disk, say) becomes one clear error."""
    try:
      action()
    except CheckpointError:
      raise
    except Exception as error:  # noqa: BLE001  (Orbax and tensorstore raise many kinds)
      reason = (str(error).splitlines() or [type(error).__name__])[0][:300]
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

  def restore(self, abstract_state) -> tuple[int, Any, dict, dict] | None:
    """(step, state, data_state, meta) of the newest usable checkpoint, or None if there is none.

    `abstract_state` gives shapes, dtypes and the target shardings, which may differ from
    those the checkpoint was saved with (Orbax reshards on read).
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    for step in steps:
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        self._verify(step, restored.state, restored.meta)
      except Exception as error:  # noqa: BLE001  (any failure means: try the previous one)
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        kept = self._set_aside(step)
        print(f"checkpoint {self.directory}/{step} is unusable ({reason[:300]}); moved it to "
              f"{kept} and trying an older one", flush=True)
        continue
      return step, restored.state, restored.data, restored.meta
    if steps:
      raise CheckpointError(
          f"none of the checkpoints {steps} in {self.directory} could be restored; refusing to "
          f"start from scratch over them (move the directory away to start a new run)")
    return None

  def _set_aside(self, step: int) -> str:
    """Moves a damaged checkpoint out of Orbax's way (a later save reuses its step), keeping it
    for inspection rather than deleting anything."""
    target = os.path.join(os.path.dirname(self.directory), "checkpoints_unusable",
                          f"{step}-{int(time.time())}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(os.path.join(self.directory, str(step)), target)
    self._manager.reload()
    return target

  @staticmethod
  def _verify(step: int, state, meta: dict) -> None:
    actual, _ = _fingerprint_table(state)
    expected = meta.get("fingerprints", {})
    if set(actual) != set(expected):
      raise CheckpointError(f"step {step}: arrays differ from the recorded fingerprints")
    damaged = [name for name, value in actual.items() if value != expected[name]]
    if damaged:
      raise CheckpointError(f"step {step}: data of {damaged[0]} does not match its fingerprint"
                            f"{f' (and {len(damaged) - 1} more)' if len(damaged) > 1 else ''}")

  def close(self) -> None:
    self._manager.close()
