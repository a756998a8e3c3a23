"""The static ring schedule: what every device computes at every ring step, built on the host.

    python -m parallelism --layout striped --seq_len 32768 --shards 8 [--tile 512] [--window W]

prints it, its critical path and every layout's. Token indices are fixed by (layout,
seq_len, ring size), so this module works out once, with NumPy and `parallelism.tiles`'s
rule, which keys each query sees at each step:

- At step s, device d holds its query block and the K/V block that started on d - s
  (`held_block`). Distinct (device, step) block pairs are kept once, with a table
  `pair[device, step]` into them that kernels index at run time.
- Each pair has a mask shape a library kernel can use: `empty`, `full`, `causal`,
  `strictly_causal` or `general`. A step at which no device has work is not run.
- `RingSchedule.tiles(tile_q, tile_k)` gives block-sparse metadata (as splash attention's
  MaskInfo): per query tile the runs of UNMASKED key tiles and the MASKED ones with the id of
  their elementwise mask, and the same per key tile for dK/dV. SKIP tiles appear nowhere.

Segment ids are not part of the schedule (they change per batch). The schedule is cached per
(layout, seq_len, shards, window, narrowest) and tile size: built once per compile. With
per-head spans (`narrowest` < `window`) one schedule covers every span between the two, and
block pairs are told apart by their token distances, so that `pair_index` gives every
device's distances for the kernels' per-head masks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
from typing import NamedTuple

import numpy as np
from jax import lax

from parallelism import tiles
from parallelism.layouts import LAYOUTS, permutation
from parallelism.masks import FIELDS, Mask, MaskSpec, check, visible

MASK_SHAPES = ("empty", "full", "causal", "strictly_causal", "general")


def held_block(device: int, step: int, num_shards: int) -> int:
  """At ring step s, device d holds the K/V block that started on device d - s."""
  return (device - step) % num_shards


class TileLists(NamedTuple):
  """Block-sparse metadata of each distinct pair, one row per tile of the outer side.

  Arrays are [pairs, outer tiles, ...] int32, padded past their counts: `runs` holds
  (first, stop) of each run of consecutive UNMASKED inner tiles, `masked` the MASKED inner
  tiles in order and `mask_id` their masks (rows of `TileTables.masks`).
  """
  runs: np.ndarray  # [P, n, R, 2]
  num_runs: np.ndarray  # [P, n]
  masked: np.ndarray  # [P, n, M]
  mask_id: np.ndarray  # [P, n, M]
  num_masked: np.ndarray  # [P, n]


@dataclasses.dataclass(frozen=True, eq=False)
class TileTables:
  """The schedule at one tile granularity (query tiles of `tile_q`, key tiles of `tile_k`)."""
  tile_q: int
  tile_k: int
  classes: np.ndarray  # [P, nq, nk] int8: tiles.SKIP / UNMASKED / MASKED
  by_query: TileLists  # outer = query tiles, inner = key tiles (forward, dQ)
  by_key: TileLists  # outer = key tiles, inner = query tiles (dK/dV)
  masks: np.ndarray  # [U, tile_q, tile_k] bool: the distinct masks of MASKED tiles

  @functools.cached_property
  def upper_right_empty(self) -> bool:
    """Whether in every mask the first half of queries sees none of the second half of
    keys (a causal diagonal tile; true of every layout here, not of any order): kernels
    may then compute a MASKED tile without that quarter."""
    half_q, half_k = self.tile_q // 2, self.tile_k // 2
    return (self.tile_q % 2 == 0 and self.tile_k % 2 == 0 and half_q > 0
            and not self.masks[:, :half_q, half_k:].any())


@dataclasses.dataclass(frozen=True, eq=False)
class RingSchedule:
  """Who computes what, for every device and ring step. Hashable by identity (a static
  argument to jit and custom_vjp); `ring_schedule` caches one per configuration."""
  layout: str
  seq_len: int
  num_shards: int
  order: np.ndarray  # [N, T]: original token index at each position of each device's block
  pair: np.ndarray  # [N devices, N steps] int32: the distinct block pair computed there
  pair_blocks: tuple[tuple[int, int], ...]  # a (query block, key block) of each distinct pair
  shapes: tuple[str, ...]  # the mask shape of each distinct pair, one of MASK_SHAPES
  window: int | None = None  # keys each query sees, itself included (`parallelism.tiles`)
  narrowest: int | None = None  # per-head spans: the narrowest (the widest is `window`)
  _tables: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def block_len(self) -> int:
    return self.seq_len // self.num_shards

  @property
  def empty(self) -> np.ndarray:
    """[N devices, N steps] bool: nothing to compute (the ring skips the kernel)."""
    return np.asarray([s == "empty" for s in self.shapes])[self.pair]

  @functools.cached_property
  def needed_steps(self) -> tuple[int, ...]:
    """The ring steps at which some device has work, step 0 (the own block) always."""
    busy_S = ~self.empty.all(axis=0)
    busy_S[0] = True
    return tuple(int(s) for s in np.flatnonzero(busy_S))

  def tiles(self, tile_q: int, tile_k: int | None = None) -> TileTables:
    """Block-sparse metadata at these tile sizes (built on first use, then cached)."""
    key = (tile_q, tile_q if tile_k is None else tile_k)
    if key not in self._tables:
      self._tables[key] = _tile_tables(self.order, self.pair_blocks, *key, self.window,
                                       self.narrowest)
    return self._tables[key]

  @functools.cached_property
  def pair_index(self) -> tuple[np.ndarray, np.ndarray]:
    """([P, T], [P, T]) int32: the original token index of each query and key position of
    each distinct pair (its representative blocks); with per-head spans, the distances
    `q - k` kernels compare with each head's span are the same for every device and step
    that computes the pair."""
    blocks_P2 = np.asarray(self.pair_blocks)
    return tuple(self.order[blocks_P2[:, side]].astype(np.int32) for side in (0, 1))

  @property
  def span_text(self) -> str:
    """'causal', 'window 64' or 'spans 16..64'."""
    if self.window is None:
      return "causal"
    if self.narrowest is None:
      return f"window {self.window}"
    return f"spans {self.narrowest}..{self.window}"

  def computed_tiles(self, tile: int) -> np.ndarray:
    """[N steps, N devices]: tile pairs each device computes (not SKIP) at each step."""
    per_pair = (self.tiles(tile).classes != tiles.SKIP).sum(axis=(1, 2))
    return per_pair[self.pair].T

  def masked_tiles(self, tile: int) -> np.ndarray:
    """[N steps, N devices]: of those, the ones computed with the elementwise mask."""
    per_pair = (self.tiles(tile).classes == tiles.MASKED).sum(axis=(1, 2))
    return per_pair[self.pair].T


def critical_path(work_SN) -> float:
  """The ring synchronises every step: the sum over steps of the busiest device's work."""
  return float(np.asarray(work_SN).max(axis=1).sum())


@functools.lru_cache(maxsize=32)
def ring_schedule(layout: str, seq_len: int, num_shards: int, window: int | None = None,
                  narrowest: int | None = None) -> RingSchedule:
  """The schedule of a named layout (`parallelism.layouts`); `window` and `narrowest` (per-head
  spans between them) as in `parallelism.tiles`."""
  return schedule_of_order(permutation(layout, seq_len, num_shards), num_shards, layout, window,
                           narrowest)


def schedule_of_order(order_S: np.ndarray, num_shards: int, name: str = "custom",
                      window: int | None = None, narrowest: int | None = None) -> RingSchedule:
  """The schedule of any order of the sequence (`order_S[p]`: original index at position p)."""
  check(MaskSpec(window=window, narrowest=narrowest))
  narrowest = None if narrowest == window else narrowest
  order_S = np.asarray(order_S)
  seq_len = order_S.shape[0]
  if seq_len % num_shards:
    raise ValueError(f"sequence length {seq_len} must be divisible by {num_shards} shards")
  order_NT = order_S.reshape(num_shards, -1).astype(np.int64)
  # Which keys a query sees depends only on the keys' sorted order and on how many keys lie
  # at or before each query and before its window, so those arrays identify a block pair's
  # mask without building it ([T, T] would not fit at a million tokens).
  key_order = [np.argsort(k_T, kind="stable") for k_T in order_NT]
  distinct: dict[bytes, int] = {}
  pair_blocks, shapes = [], []
  pair = np.zeros((num_shards, num_shards), np.int32)
  for device in range(num_shards):
    for step in range(num_shards):
      kb = held_block(device, step, num_shards)
      sorted_keys = order_NT[kb][key_order[kb]]
      seen = np.searchsorted(sorted_keys, order_NT[device], side="right")
      gone = (np.zeros_like(seen) if window is None else
              np.searchsorted(sorted_keys, order_NT[device] - window, side="right"))
      gone_narrow = gone
      key = key_order[kb].tobytes() + seen.tobytes() + gone.tobytes()
      if narrowest is not None and (seen > gone).any():
        gone_narrow = np.searchsorted(sorted_keys, order_NT[device] - narrowest, side="right")
        # Pairs alike under both bounds may still differ in the spans between: tell them
        # apart by their distances (equal iff both blocks' indices differ by one shift).
        shift = order_NT[device][0]
        key += hashlib.blake2b((order_NT[device] - shift).tobytes()
                               + (order_NT[kb] - shift).tobytes()).digest()
      if key not in distinct:
        distinct[key] = len(pair_blocks)
        pair_blocks.append((device, kb))
        shapes.append(_mask_shape(seen, gone, key_order[kb], gone_narrow))
      pair[device, step] = distinct[key]
  for array in (order_NT, pair):
    array.setflags(write=False)
  return RingSchedule(name, seq_len, num_shards, order_NT, pair, tuple(pair_blocks),
                      tuple(shapes), window, narrowest)


def _mask_shape(seen_T: np.ndarray, gone_T: np.ndarray, key_order_T: np.ndarray,
                gone_narrow_T: np.ndarray) -> str:
  """The block pair's mask as a library kernel names it, from the count of keys at or
  before each query (`seen_T`), of those before its window (`gone_T`; before the narrowest
  span, `gone_narrow_T`), and the keys' sorted order: each query sees the keys [gone, seen)
  of that order (with per-head spans, some heads fewer: then it is `general`)."""
  num_keys = key_order_T.shape[0]
  if (seen_T == gone_T).all():
    return "empty"
  if gone_narrow_T.any():
    return "general"
  if (seen_T == num_keys).all():
    return "full"
  position = np.arange(num_keys)
  if seen_T.shape[0] == num_keys and (key_order_T == position).all():
    if (seen_T == position + 1).all():
      return "causal"
    if (seen_T == position).all():
      return "strictly_causal"
  return "general"


def _tile_tables(order_NT: np.ndarray, pair_blocks, tile_q: int, tile_k: int,
                 window: int | None, narrowest: int | None) -> TileTables:
  block_len = order_NT.shape[1]
  for name, tile in (("query", tile_q), ("key", tile_k)):
    if tile <= 0 or block_len % tile:
      raise ValueError(f"block length {block_len} is not divisible by the {name} tile {tile}")
  classes, mask_ids, masks = [], [], {}
  for q_block, k_block in pair_blocks:
    q_T, k_T = order_NT[q_block], order_NT[k_block]
    classes_QK = tiles.classify_all(q_T, k_T, tile_q, tile_k, window, narrowest)
    ids_QK = np.full(classes_QK.shape, -1, np.int32)
    for i, j in zip(*np.nonzero(classes_QK == tiles.MASKED)):
      q_t1, k_1t = q_T[i * tile_q:(i + 1) * tile_q, None], k_T[None, j * tile_k:(j + 1) * tile_k]
      mask = visible(Mask(MaskSpec(window=window)), q_t1 - k_1t)
      # The ranges the classes read can straddle a window that no token pair meets. With
      # per-head spans a tile is UNMASKED only if the narrowest head sees every key.
      every = mask.all() if narrowest is None else visible(Mask(MaskSpec(window=narrowest)),
                                                           q_t1 - k_1t).all()
      if not mask.any() or every:
        classes_QK[i, j] = tiles.UNMASKED if every else tiles.SKIP
        continue
      ids_QK[i, j] = masks.setdefault(np.packbits(mask).tobytes(), len(masks))
    classes.append(classes_QK)
    mask_ids.append(ids_QK)
  classes_PQK, ids_PQK = np.stack(classes), np.stack(mask_ids)
  unique = np.zeros((max(len(masks), 1), tile_q, tile_k), bool)  # never an empty array
  for packed, index in masks.items():
    unique[index] = np.unpackbits(np.frombuffer(packed, np.uint8),
                                  count=tile_q * tile_k).reshape(tile_q, tile_k)
  tables = TileTables(tile_q, tile_k, classes_PQK, _tile_lists(classes_PQK, ids_PQK),
                      _tile_lists(classes_PQK.swapaxes(1, 2), ids_PQK.swapaxes(1, 2)), unique)
  for array in (tables.classes, tables.masks, *tables.by_query, *tables.by_key):
    array.setflags(write=False)  # cached and shared by every compile that asks for it
  return tables


def _tile_lists(classes_PON: np.ndarray, ids_PON: np.ndarray) -> TileLists:
  """Runs of UNMASKED and lists of MASKED inner tiles for every outer tile of every pair."""
  num_pairs, num_outer, num_inner = classes_PON.shape
  unmasked = np.pad(classes_PON == tiles.UNMASKED, [(0, 0), (0, 0), (1, 1)]).astype(np.int8)
  edges = np.diff(unmasked, axis=2)
  starts, stops = np.nonzero(edges == 1), np.nonzero(edges == -1)
  runs_per_row = np.count_nonzero(edges == 1, axis=2)
  masked = np.nonzero(classes_PON == tiles.MASKED)
  masked_per_row = np.count_nonzero(classes_PON == tiles.MASKED, axis=2)

  def padded(rows, per_row, values, trailing=()):
    """Scatter `values` (in row order) into [P, n, max count, *trailing], zero-padded.

    At least 2 entries per row: with 1, a loop's counter indexes a length-1 axis, which XLA
    clamps to a constant, so the loop body becomes loop-invariant and XLA hoists the whole
    tile computation out of its loop and runs it even where the loop runs 0 times (the xla
    kernel's backward then slows down on a block with no MASKED tiles)."""
    out = np.zeros((num_pairs, num_outer, max(int(per_row.max(initial=0)), 2), *trailing),
                   np.int32)
    first = np.cumsum(per_row.reshape(-1)) - per_row.reshape(-1)
    flat_row = rows[0] * num_outer + rows[1]
    out[rows[0], rows[1], np.arange(flat_row.size) - first[flat_row]] = values
    return out

  # np.nonzero lists entries row by row, inner index ascending: runs and lists are in order.
  runs = padded(starts, runs_per_row, np.stack([starts[2], stops[2]], axis=-1), (2,))
  return TileLists(runs, runs_per_row.astype(np.int32), padded(masked, masked_per_row, masked[2]),
                   padded(masked, masked_per_row, ids_PON[masked]),
                   masked_per_row.astype(np.int32))


def over_tiles(lists: TileLists, row, visit, carry):
  """How every kernel walks one row of a pair's tile lists (JAX arrays or Pallas refs):
  `visit(inner_tile, carry, None)` over the runs of UNMASKED tiles, then
  `visit(inner_tile, carry, mask_id)` over the MASKED tiles; returns the carry."""
  def run(r, carry):
    return lax.fori_loop(lists.runs[row, r, 0], lists.runs[row, r, 1],
                         lambda j, c: visit(j, c, None), carry)

  carry = lax.fori_loop(0, lists.num_runs[row], run, carry)
  return lax.fori_loop(
      0, lists.num_masked[row],
      lambda n, c: visit(lists.masked[row, n], c, lists.mask_id[row, n]), carry)


def describe(schedule: RingSchedule, tile: int) -> str:
  """A readable account: distinct pairs, the step x device table, the critical path."""
  n = schedule.num_shards
  computed_SN = schedule.computed_tiles(tile)
  masked_SN = schedule.masked_tiles(tile)
  per_block = (schedule.block_len // tile) ** 2
  lines = [f"{schedule.layout}: {schedule.seq_len} tokens on {n} devices, "
           f"{schedule.span_text}, blocks of "
           f"{schedule.block_len}, tiles of {tile} ({per_block} tile pairs per block pair)",
           "", "distinct block pairs (query block, key block), each with its mask shape and "
           "tiles computed (of them masked):"]
  tables = schedule.tiles(tile)
  for p, (blocks, shape) in enumerate(zip(schedule.pair_blocks, schedule.shapes)):
    computed = int((tables.classes[p] != tiles.SKIP).sum())
    masked = int((tables.classes[p] == tiles.MASKED).sum())
    lines.append(f"  {p}: {blocks} {shape:<16} {computed:>8} ({masked})")
  lines += ["", "step x device: distinct pair / tiles computed"]
  lines.append("step " + "".join(f"{f'dev {d}':>14}" for d in range(n)) + f"{'busiest':>10}")
  for s in range(n):
    cells = "".join(f"{f'{schedule.pair[d, s]} / {computed_SN[s, d]}':>14}" for d in range(n))
    lines.append(f"{s:>4} {cells}{computed_SN[s].max():>10}")
  total, critical = int(computed_SN.sum()), critical_path(computed_SN)
  steps = schedule.needed_steps
  lines += ["", f"critical path: {critical:.0f} tiles (sum over steps of the busiest device); "
                f"all devices compute {total} ({int(masked_SN.sum())} masked); balance "
                f"{total / (n * critical):.3f} (1.0 = every device busy at every step)",
            f"ring steps run: {len(steps)} of {n}"
            + ("" if len(steps) == n else f" ({', '.join(map(str, steps))}; each K/V block "
                                          f"is sent straight to the device that needs it)")]
  return "\n".join(lines)


def compare_layouts(seq_len: int, num_shards: int, tile: int,
                    windows: tuple = (None,)) -> tuple[str, str]:
  """Each layout's critical path (tiles, summed over `windows`: one per layer of a model's
  pattern, each a window, None, or (widest, narrowest) of per-head spans) as a table, and
  the layout with the shortest."""
  bands = [w if isinstance(w, tuple) else (w, None) for w in windows]
  paths = {}
  for layout in LAYOUTS:
    paths[layout] = sum(critical_path(ring_schedule(layout, seq_len, num_shards, *band)
                                      .computed_tiles(tile)) for band in bands)
  best = min(paths, key=paths.get)
  rows = [f"{'layout':<9}{'critical path (tiles)':>24}{'vs best':>10}"]
  rows += [f"{layout:<9}{path:>24,.0f}{path / paths[best]:>9.2f}x"
           for layout, path in paths.items()]
  return "\n".join(rows), best


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m parallelism",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--layout", choices=LAYOUTS, default="striped")
  parser.add_argument("--seq_len", type=int, default=32768)
  parser.add_argument("--shards", type=int, default=8)
  parser.add_argument("--tile", type=int, default=512, help="clipped to the block")
  parser.add_argument("--window", type=int, default=None,
                      help="keys each query sees, itself included (default: causal); with "
                           "per-head spans the widest")
  parser.add_argument("--narrowest", type=int, default=None,
                      help="per-head spans: the narrowest (default: every head sees --window)")
  args = parser.parse_args()
  # Here, not in the errors below: a length of 0 made a tile of 0 and blamed that instead.
  for flag in ("seq_len", "shards", "tile", "window", "narrowest"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise SystemExit(f"error: --{flag} must be positive (got {value})")
  try:
    check(MaskSpec(window=args.window, narrowest=args.narrowest),
          FIELDS | dict(window="--window", narrowest="--narrowest"))
    schedule = ring_schedule(args.layout, args.seq_len, args.shards, args.window,
                             args.narrowest)
    tile = min(args.tile, schedule.block_len)
    print(describe(schedule, tile))
    table, best = compare_layouts(args.seq_len, args.shards, tile,
                                  ((args.window, args.narrowest),))
    print(f"\nevery layout at these sizes:\n{table}\nshortest: {best}")
  except ValueError as error:
    raise SystemExit(f"error: {error}") from None


def by_pair_shape(schedule: RingSchedule, pair, branch):
  """`branch(shape, p)` of the traced `pair`: one static branch per distinct pair of
  `schedule` (`lax.switch`), or the one pair's without a switch. How the kernels that call
  a library per mask shape (cudnn, splash) pick theirs."""
  branches = [functools.partial(branch, shape, p) for p, shape in enumerate(schedule.shapes)]
  return branches[0]() if len(branches) == 1 else lax.switch(pair, branches)


if __name__ == "__main__":
  main()  # also `python -m parallelism`, which Python runs without a RuntimeWarning

