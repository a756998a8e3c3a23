"""The device mesh and the logical-axis rules that map array names onto it."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# `sequence` is the ring; `ulysses` the all-to-all of Ulysses attention (size 1 unless
# model.sequence_parallel uses it), inside the ring so that a node's devices share it.
MESH_AXES = ("data", "fsdp", "sequence", "ulysses", "tensor")
BATCH_AXES = ("data", "fsdp")
SEQUENCE_AXES = ("sequence", "ulysses")
Rules = Sequence[tuple[str, str | Sequence[str] | None]]


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Axis sizes in MESH_AXES order, with at most one -1 filled from the device count. An
  axis `sizes` leaves out has size 1 (a run's stored config from before the axis existed)."""
  shape = [int(sizes.get(name, 1)) for name in MESH_AXES]
  unknown = [name for name, size in zip(MESH_AXES, shape) if size == -1]
  if len(unknown) > 1 or any(size == 0 or size < -1 for size in shape):
    raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, shape))}: each must be >= 1, "
                     f"and at most one may be -1")
  known = math.prod(size for size in shape if size != -1)
  if unknown:
    if num_devices % known:
      raise ValueError(f"mesh.{unknown[0]}=-1 cannot be filled: {num_devices} devices are not "
                       f"divisible by the other axes' product {known}")
    shape[MESH_AXES.index(unknown[0])] = num_devices // known
  if math.prod(shape) != num_devices:
    # Name the single-axis changes that would fit, so the fix is one override away.
    fixes = []
    for i, name in enumerate(MESH_AXES):
      if name == "ulysses":  # Only Ulysses strategies use it; it is never the quick fix.
        continue
      others = math.prod(shape) // shape[i]
      if num_devices % others == 0:
        fixes.append(f"mesh.{name}={num_devices // others}")
    hint = f"{' or '.join(fixes)} would fit" if fixes else "set one axis to -1 to fill the rest"
    there = "is 1 device" if num_devices == 1 else f"are {num_devices} devices"
    raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, shape))} multiply to {math.prod(shape)}, "
                     f"but there {there}; {hint}")
  return tuple(shape)


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  shape = resolve_mesh_shape(sizes, len(devices))
  return jax.make_mesh(shape, MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def check_rules(rules: Rules) -> None:
  """Each logical name is mapped once and only onto mesh axes that exist."""
  seen = set()
  for name, target in rules:
    if name in seen:
      raise ValueError(f"mesh.rules maps logical axis '{name}' more than once")
    seen.add(name)
    for axis in as_axes(target):
      if axis not in MESH_AXES:
        raise ValueError(f"mesh.rules maps '{name}' to unknown mesh axis '{axis}'")


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> P:
  """PartitionSpec for an array with these logical axis names; errors on a reused mesh axis."""
  table = dict(rules)
  spec, used = [], []
  for name in names:
    target = table.get(name) if name is not None else None
    axes = as_axes(target)
    for axis in axes:
      if axis in used:
        raise ValueError(f"logical axes {tuple(names)} collide: mesh axis '{axis}' is used "
                         f"twice under mesh.rules")
      used.append(axis)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def spec_on_mesh(spec: P, mesh) -> P:
  """`spec` without the mesh axes `mesh` does not have."""
  kept = [tuple(a for a in as_axes(entry) if a in mesh.axis_names) for entry in spec]
  return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in kept))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Per-token batch arrays [batch, seq]: rows over data+fsdp, sequence over the ring and,
  within each ring block, over `ulysses`."""
  return NamedSharding(mesh, P(BATCH_AXES, SEQUENCE_AXES))


def batch_shards(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))


def as_axes(target) -> tuple[str, ...]:
  """A rules-table target (None, an axis name or a sequence of names) as a tuple of axes."""
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)
