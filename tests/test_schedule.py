"""The static ring schedule against the elementwise rule it summarises.

For every layout, ring size and tile size, every device's block pair at every ring step is
rebuilt from the schedule's block-sparse metadata alone (runs of UNMASKED tiles, MASKED
tiles with their stored masks, nothing else visible) and compared with the elementwise rule
on the blocks' original token indices: the two must be equal, bit for bit.
"""

import subprocess
import sys

import numpy as np
import pytest

from parallelism import tiles
from parallelism.layouts import LAYOUTS, permutation
from parallelism.masks import Mask, visible
from parallelism.schedule import (critical_path, held_block, main, ring_schedule,
                                  schedule_of_order, MASK_SHAPES)


def _visible_from_lists(plan, lists, pair, outer_tile, inner_tile, block_len, transposed):
  """A block pair's visibility [Tq, Tk] rebuilt from one side's tile lists."""
  visible = np.zeros((block_len, block_len), bool)
  for row in range(block_len // outer_tile):
    tiles_seen = []
    for r in range(lists.num_runs[pair, row]):
      first, stop = lists.runs[pair, row, r]
      tiles_seen += [(j, None) for j in range(first, stop)]
    for n in range(lists.num_masked[pair, row]):
      tiles_seen.append((lists.masked[pair, row, n], lists.mask_id[pair, row, n]))
    for col, mask_id in tiles_seen:
      q_tile, k_tile = (col, row) if transposed else (row, col)
      cell = (slice(q_tile * plan.tile_q, (q_tile + 1) * plan.tile_q),
              slice(k_tile * plan.tile_k, (k_tile + 1) * plan.tile_k))
      assert not visible[cell].any(), "a tile is listed twice"
      visible[cell] = True if mask_id is None else plan.masks[mask_id]
  return visible


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_shards, tile_q, tile_k", [(1, 8, 8), (2, 8, 4), (3, 4, 8),
                                                         (4, 8, 8), (8, 2, 4)])
def test_metadata_rebuilds_the_elementwise_rule(layout, num_shards, tile_q, tile_k):
  seq_len = 48 * num_shards
  schedule = ring_schedule(layout, seq_len, num_shards)
  plan = schedule.tiles(tile_q, tile_k)
  block_len = schedule.block_len
  for device in range(num_shards):
    for step in range(num_shards):
      q_index = schedule.order[device]
      k_index = schedule.order[held_block(device, step, num_shards)]
      want = visible(Mask(), q_index[:, None] - k_index[None, :])
      pair = schedule.pair[device, step]
      by_query = _visible_from_lists(plan, plan.by_query, pair, tile_q, tile_k, block_len, False)
      by_key = _visible_from_lists(plan, plan.by_key, pair, tile_k, tile_q, block_len, True)
      np.testing.assert_array_equal(by_query, want, err_msg=f"device {device} step {step}")
      np.testing.assert_array_equal(by_key, want, err_msg=f"device {device} step {step}")
      assert schedule.empty[device, step] == (not want.any())
      assert schedule.shapes[pair] == _shape_of(want)


def _shape_of(visible_TT):
  """The mask shape by brute force, for the check above."""
  t = visible_TT.shape[0]
  if not visible_TT.any():
    return "empty"
  if visible_TT.all():
    return "full"
  for shape, offset in (("causal", 0), ("strictly_causal", -1)):
    if (visible_TT == np.tri(t, t, offset, dtype=bool)).all():
      return shape
  return "general"


def test_mask_shapes_of_the_layouts():
  """What a library kernel with a causal flag sees: striped is causal or strictly causal
  everywhere, ring causal, full or empty, zigzag causal on the diagonal only."""
  shapes = {layout: set(ring_schedule(layout, 4096, 8).shapes) for layout in LAYOUTS}
  assert shapes == {"ring": {"causal", "full", "empty"},
                    "striped": {"causal", "strictly_causal"},
                    "zigzag": {"causal", "general"}}
  assert set().union(*shapes.values()) <= set(MASK_SHAPES)
  # Few distinct pairs: the kernels' tables stay small at any ring size.
  assert [len(ring_schedule(layout, 4096, 8).shapes) for layout in LAYOUTS] == [3, 2, 3]


def test_striped_skips_the_upper_triangle_of_each_block():
  """Striped keeps the diagonal tiles masked and skips the upper triangle, in every pair."""
  plan = ring_schedule("striped", 256, 4).tiles(8)
  upper, lower = np.triu_indices(8, 1), np.tril_indices(8, -1)
  for classes in plan.classes:
    np.testing.assert_array_equal(classes[upper], tiles.SKIP)
    np.testing.assert_array_equal(np.diag(classes), tiles.MASKED)
    np.testing.assert_array_equal(classes[lower], tiles.UNMASKED)
  assert len(plan.masks) == 2  # the causal and the strictly causal diagonal tile
  assert plan.upper_right_empty  # so kernels skip a quarter of each diagonal tile
  assert not ring_schedule("striped", 96, 4).tiles(3).upper_right_empty  # no halves to take


def test_critical_path_balance():
  """Per ring step the busiest device sets the pace: striped and zigzag near N/2 blocks
  of work, ring near N - 1/2 (the theory for long blocks: ratio (N - 1/2) / (N / 2))."""
  n, tile = 8, 512
  paths = {layout: critical_path(ring_schedule(layout, n * 32768, n).computed_tiles(tile))
           for layout in LAYOUTS}
  assert paths["ring"] / paths["striped"] >= 1.84
  assert paths["ring"] / paths["zigzag"] >= 1.87


def test_any_order_and_errors():
  """A schedule of an arbitrary order is exact too; bad sizes fail in words."""
  order = np.random.default_rng(0).permutation(64)
  schedule = schedule_of_order(order, 4)
  plan = schedule.tiles(4)
  for device in range(4):
    for step in range(4):
      want = visible(Mask(), schedule.order[device][:, None]
                     - schedule.order[held_block(device, step, 4)][None, :])
      got = _visible_from_lists(plan, plan.by_query, schedule.pair[device, step], 4, 4, 16,
                                False)
      np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="not divisible by the query tile 5"):
    schedule.tiles(5)
  with pytest.raises(ValueError, match="must be divisible by 6"):
    ring_schedule("zigzag", 64, 3)
  np.testing.assert_array_equal(ring_schedule("striped", 64, 4).order.reshape(-1),
                                permutation("striped", 64, 4))


def test_command_line_prints_the_schedule(monkeypatch):
  out = subprocess.run([sys.executable, "-m", "parallelism", "--layout", "striped",
                        "--seq_len", "4096", "--shards", "4", "--tile", "256"],
                       capture_output=True, text=True, check=True).stdout
  assert "causal" in out and "strictly_causal" in out
  assert "critical path: 40 tiles" in out and "balance 1.000" in out
  bad = subprocess.run([sys.executable, "-m", "parallelism", "--layout", "zigzag",
                        "--seq_len", "100", "--shards", "8"], capture_output=True, text=True)
  assert bad.returncode != 0 and bad.stderr.strip() == (
      "error: seq_len=100 must be divisible by 16 (sequence shards=8 x 2 for zigzag)")
  # A length of 0 once made a tile of 0 and blamed it; each size is named (in-process: cheap).
  for flag, value in (("seq_len", "0"), ("seq_len", "-256"), ("shards", "0"), ("tile", "0"),
                      ("window", "-1")):
    monkeypatch.setattr(sys, "argv", ["parallelism", "--layout", "zigzag", "--shards", "4",
                                      f"--{flag}", value])
    with pytest.raises(SystemExit, match=f"^error: --{flag} must be positive \\(got {value}\\)$"):
      main()
