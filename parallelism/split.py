"""What a sequence-parallel setup may be, checked once: `split_attention` turns a strategy,
a layout, a sequence length and a mesh with its rules into each device's `Strategy`, with
the block kernel resolved once for its blocks, or says in one line why it cannot.

`ring_attention` builds its passes with it while tracing, and the trainer's config check
calls it before any device work (with `Names` of config fields in its messages), so a config
that passes there cannot fail in the ring.
"""

from __future__ import annotations

import dataclasses
import math

from parallelism import kernels, strategies
from parallelism.layouts import check_seq_len, required_divisor
from parallelism.masks import MaskSpec
from parallelism.mesh import Rules, as_axes, logical_to_spec, spec_on_mesh
from parallelism.schedule import ring_schedule
from parallelism.strategies import STRATEGIES, ULYSSES, Strategy

Q_NAMES = ("activation_batch", "activation_seq", "activation_heads", None)
KV_NAMES = ("activation_batch", "activation_seq", "activation_kv_heads", None)


@dataclasses.dataclass(frozen=True)
class Names:
  """How the caller's users know each quantity, in the error messages: `ring_attention`'s
  callers by its arguments and mesh axes (these defaults), the trainer by config fields."""
  seq_len: str = "sequence length"
  tile: str = "tile_size"
  kernel: str = "kernel"
  strategy: str = "strategy"
  heads: str = "query heads"
  rules: str = "rules"
  axis: str = "mesh axis '{}'"  # formatted with the axis name

  def of_axis(self, name: str) -> str:
    return self.axis.format(name)


def block_tile(seq_len: int, num_shards: int, tile_size: int) -> int:
  """The tile the kernels use: `tile_size` clipped to the per-device block."""
  return min(tile_size, seq_len // num_shards)


def length_unit(layout: str, num_shards: int, tile_size: int, ulysses: int = 1,
                seq_len: int | None = None) -> int:
  """What a sequence length of `layout` on a ring of `num_shards` devices times `ulysses`
  must be a multiple of (what `split_attention` checks): the layout's divisor, every
  sequence shard, and ring shards x tile where a ring block (of `seq_len`; None: of a length
  long enough) is longer than one tile. The one rule; `shortest_ring_length`, the planner's
  searches and the sampler's cache read it."""
  unit = math.lcm(required_divisor(layout, num_shards), num_shards * ulysses)
  if seq_len is None or seq_len // num_shards > tile_size:
    unit = math.lcm(unit, num_shards * tile_size)
  return unit


def shortest_ring_length(length: int, layout: str, num_shards: int, tile_size: int,
                         ulysses: int = 1) -> int:
  """The smallest sequence length >= `length` that attention of `layout` takes on a ring of
  `num_shards` devices times `ulysses` (`length_unit`)."""
  up = lambda unit: -(-length // unit) * unit
  seq_len = up(length_unit(layout, num_shards, tile_size, ulysses, seq_len=0))
  if seq_len // num_shards > tile_size:
    seq_len = up(length_unit(layout, num_shards, tile_size, ulysses))
  return seq_len


def split_attention(strategy: str, layout: str, tile_size: int, kernel: str, mesh,
                    rules: Rules, q, k, names: Names = Names(),
                    spec: MaskSpec = MaskSpec()) -> Strategy:
  """Each device's side of `strategy` for `layout` on `mesh` (concrete or abstract), its
  sequence over the axes `rules` map `activation_seq` to, of q [B, S, Hq, D] on k [B, S,
  Hkv, D] (arrays or `jax.ShapeDtypeStruct`s: only their shapes and dtype are read) under the
  mask `spec` (`parallelism.masks`, checked by its caller; SparseK's on the ring strategy
  only); a ValueError says why not."""
  seq_len, num_heads, head_dim = q.shape[1:]
  num_kv_heads, dtype = k.shape[2], q.dtype
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown sequence-parallel strategy '{strategy}' ({names.strategy}); "
                     f"choose one of {STRATEGIES}")
  kernels.check_spec(kernel, spec.on_ring, names.kernel)
  axis, ulysses_axis = _sequence_axes(mesh, rules, strategy, names)
  num_shards = mesh.shape[axis]
  if spec.selects and (ulysses_axis or (strategy == "allgather" and num_shards > 1)):
    raise ValueError(f"{names.strategy}='{strategy}' does not carry SparseK's scores and "
                     f"their gradients yet: use 'ring'")
  ulysses = mesh.shape[ulysses_axis] if ulysses_axis else 1
  check_seq_len(seq_len, layout, num_shards, name=names.seq_len)
  if seq_len % (num_shards * ulysses):
    raise ValueError(f"{names.seq_len}={seq_len} must be divisible by the sequence shards "
                     f"{names.of_axis(axis)} x {names.of_axis(ulysses_axis or axis)} = "
                     f"{num_shards} x {ulysses}")
  tile = block_tile(seq_len, num_shards, tile_size)
  if seq_len % (num_shards * tile):
    raise ValueError(f"{names.seq_len}={seq_len} must be divisible by sequence shards x tile "
                     f"= {num_shards} x {tile} = {num_shards * tile} ({names.of_axis(axis)}, "
                     f"{names.tile})")
  head_axes, kv_axes = (spec_on_mesh(logical_to_spec(names_, rules), mesh)[2]
                        for names_ in (Q_NAMES, KV_NAMES))
  if head_axes != kv_axes:
    raise ValueError(f"{names.rules} maps activation_heads to {as_axes(head_axes)} but "
                     f"activation_kv_heads to {as_axes(kv_axes)}: they must shard over the "
                     f"same mesh axes, so that each device's query heads find their kv heads")
  head_shards = math.prod(mesh.shape[a] for a in as_axes(head_axes))
  local_heads, local_kv = num_heads // head_shards, num_kv_heads // head_shards
  repeat = 1
  if ulysses_axis:
    if local_heads % ulysses:
      raise ValueError(f"{names.heads}={num_heads} over {head_shards} head shard(s) leaves "
                       f"{local_heads} heads per device, which {names.of_axis(ulysses_axis)}="
                       f"{ulysses} must divide (Ulysses splits the heads)")
    repeat = strategies.kv_repeat(local_kv, ulysses)
  # Each device's blocks as the kernel sees them: the ring's block of the whole sequence's
  # tokens over the ring, of the heads Ulysses leaves it.
  block = seq_len // num_shards
  schedule = ring_schedule(layout, seq_len, num_shards, spec.window, spec.narrowest)
  chosen, fallback = kernels.choose(
      kernel, spec.on_ring, (1, block, local_heads // ulysses, head_dim),
      (1, block, local_kv * repeat // ulysses, head_dim), tile, dtype,
      "general" in schedule.shapes)
  return Strategy(strategy, schedule, axis, tile, chosen, ulysses_axis, repeat, fallback)


def local_strategy(layout: str, seq_len: int, tile_size: int, kernel: str, q_shape, k_shape,
                   dtype, spec: MaskSpec = MaskSpec()) -> Strategy:
  """Without a mesh: the whole row as one block, in its original order (a ring of one)."""
  kernels.check_spec(kernel, spec.on_ring)
  check_seq_len(seq_len, layout, 1)
  tile = block_tile(seq_len, 1, tile_size)
  if seq_len % tile:
    raise ValueError(f"sequence length {seq_len} must be divisible by sequence shards x tile "
                     f"= 1 x {tile} = {tile}")
  schedule = ring_schedule(layout, seq_len, 1, spec.window, spec.narrowest)
  chosen, fallback = kernels.choose(kernel, spec.on_ring, q_shape, k_shape, tile, dtype,
                                    "general" in schedule.shapes)
  return Strategy("ring", schedule, "sequence", tile, chosen, kernel_fallback=fallback)


def _sequence_axes(mesh, rules: Rules, strategy: str, names: Names) -> tuple[str, str | None]:
  """The mesh axes the rules put `activation_seq` on: the ring's, then (Ulysses strategies)
  the all-to-all's. A second axis the mesh lacks, or of size 1 under a strategy without
  Ulysses, is no axis."""
  seq_axes = as_axes(dict(rules).get("activation_seq"))
  if len(seq_axes) not in (1, 2):
    raise ValueError(f"{names.rules} must map activation_seq to the ring's mesh axis, then "
                     f"optionally the Ulysses all-to-all's (got {seq_axes or 'nothing'})")
  if seq_axes[0] not in mesh.axis_names:
    raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no sequence axis "
                     f"'{seq_axes[0]}' (pass mesh=..., or set one with jax.set_mesh)")
  axis, ulysses_axis = seq_axes[0], (seq_axes[1:] or (None,))[0]
  if ulysses_axis not in mesh.axis_names:
    ulysses_axis = None
  if strategy in ULYSSES:
    if ulysses_axis is None:
      raise ValueError(f"{names.strategy}='{strategy}' all-to-alls over a second sequence "
                       f"axis: {names.rules} must map activation_seq to (ring axis, Ulysses "
                       f"axis) of the mesh (got {seq_axes} on mesh axes "
                       f"{tuple(mesh.axis_names)})")
    if strategy == "ulysses" and mesh.shape[axis] > 1:
      raise ValueError(f"{names.strategy}='ulysses' splits the sequence over "
                       f"{names.of_axis(ulysses_axis)} only, but {names.of_axis(axis)}="
                       f"{mesh.shape[axis]}: use 'hybrid' for Ulysses times a ring, or set "
                       f"{names.of_axis(axis)} to 1")
    return axis, ulysses_axis
  if ulysses_axis is not None and mesh.shape[ulysses_axis] > 1:
    raise ValueError(f"{names.strategy}='{strategy}' splits the sequence over "
                     f"{names.of_axis(axis)} only, but {names.of_axis(ulysses_axis)}="
                     f"{mesh.shape[ulysses_axis]}: use 'ulysses' or 'hybrid', or set "
                     f"{names.of_axis(ulysses_axis)} to 1")
  return axis, None
