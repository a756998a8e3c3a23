"""Per-head spans (MoA): each query head its own window, between the schedule's narrowest and
widest, exact against a dense reference that runs each head alone with its own window.

Shapes and tolerances as tests/test_windows.py (which these reuse), so that the compiles are
few and small.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallelism import tiles
from parallelism.layouts import LAYOUTS
from parallelism.schedule import held_block, ring_schedule
from tests.test_ring_attention import (_F32_TOL, assert_close, dense_attention, ring_in_layout,
                                       seq_mesh)
from tests.test_schedule import _visible_from_lists
from tests.test_windows import _packed_inputs

SPANS = (3, 17, 9, 40)  # per query head; GQA pairs heads (0, 1) and (2, 3) on one kv head


def per_head_reference(q, k, v, dout, index, seg, spans):
  """Each query head attends alone, with its kv head and its own window: (out, dq, dk, dv)."""
  def attend(q, k, v):
    group = q.shape[2] // k.shape[2]
    return jnp.concatenate([
        dense_attention(q[:, :, h:h + 1], k[:, :, h // group:h // group + 1],
                        v[:, :, h // group:h // group + 1], index, seg, window=int(span))
        for h, span in enumerate(spans)], axis=2)

  out, vjp = jax.vjp(attend, q, k, v)
  return (out, *vjp(dout))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_shards", [2, 3, 8])
def test_a_band_schedule_rebuilds_every_span_between_its_bounds(layout, num_shards):
  """What a kernel computes for a head of span s (the lists, MASKED tiles narrowed by the
  pair's distances to `q - k < s`) is the rule at s, on every device and step, for every s
  in the band; SKIP by the widest, UNMASKED by the narrowest."""
  tile, seq_len = 4, 16 * num_shards
  block = seq_len // num_shards
  for narrowest, widest in ((1, tile + 1), (tile - 1, block + 1), (block - 1, seq_len)):
    schedule = ring_schedule(layout, seq_len, num_shards, widest, narrowest)
    plan = schedule.tiles(tile)
    q_rep, k_rep = schedule.pair_index
    for device in range(num_shards):
      for step in range(num_shards):
        pair = schedule.pair[device, step]
        q_index = schedule.order[device]
        k_index = schedule.order[held_block(device, step, num_shards)]
        lists = _visible_from_lists(plan, plan.by_query, pair, tile, tile, block, False)
        masked = np.kron(plan.classes[pair] == tiles.MASKED, np.ones((tile, tile), bool))
        behind = q_rep[pair][:, None] - k_rep[pair][None, :]
        for span in sorted({narrowest, (narrowest + widest) // 2, widest}):
          got = lists & np.where(masked, behind < span, True)
          want = tiles.visible(q_index[:, None], k_index[None, :], span)
          np.testing.assert_array_equal(got, want, err_msg=f"s={span} d={device} t={step}")


@pytest.mark.parametrize("layout,num_shards,kernel", [
    ("ring", 4, "xla"), ("zigzag", 4, "xla"), ("striped", 4, "xla"), ("zigzag", 2, "pallas")])
def test_ring_with_per_head_spans_matches_each_head_alone(layout, num_shards, kernel):
  """Forward and gradients with GQA and packed rows: each query head its own span (spans of
  one kv head differ), the ring cut short where the widest allows; the Pallas kernel too."""
  inputs = _packed_inputs(128)
  want = per_head_reference(*inputs, SPANS)
  got = ring_in_layout(layout, seq_mesh(num_shards), *inputs, tile_size=8, kernel=kernel,
                       window=max(SPANS), narrowest=min(SPANS), spans=jnp.asarray(SPANS))
  assert_close(got, want, **_F32_TOL)
  # The spans are not ignored: every head at the widest gives another output.
  widest = per_head_reference(*inputs, (max(SPANS),) * len(SPANS))
  assert np.abs(np.asarray(widest[0]) - np.asarray(want[0])).max() > 1e-2


def test_spans_need_their_bounds_and_one_per_query_head():
  q, k, v, *_ = _packed_inputs(64)
  with pytest.raises(ValueError, match=r"must be \[query heads\] = \[4\]"):
    from parallelism import ring_attention  # pylint: disable=g-import-not-at-top
    ring_attention(q, k, v, layout="ring", window=8, spans=jnp.asarray([2, 8]))
  with pytest.raises(ValueError, match="narrowest span 9 must not exceed the widest 8"):
    ring_schedule("ring", 64, 2, 8, 9)


def test_tile_counts_of_a_band_lie_between_its_bounds():
  """32k tokens on 8 devices, tiles of 512: spans 256..2,048 compute the widest's tiles
  (SKIP by the widest), run its ring steps, and mask more tiles than it."""
  seq_len, n, tile = 32768, 8, 512
  band = ring_schedule("ring", seq_len, n, 2048, 256)
  widest = ring_schedule("ring", seq_len, n, 2048)
  np.testing.assert_array_equal(band.computed_tiles(tile), widest.computed_tiles(tile))
  assert band.masked_tiles(tile).sum() > widest.masked_tiles(tile).sum()
  assert band.needed_steps == widest.needed_steps == (0, 1)
