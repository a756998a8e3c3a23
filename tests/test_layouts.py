"""Sequence layouts: exact round trips and which original tokens each shard holds."""

import numpy as np
import pytest

from parallelism.layouts import LAYOUTS, check_seq_len, permutation, permute, unpermute
from parallelism.split import length_unit, shortest_ring_length


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_round_trip(layout, num_shards):
  x_BS = np.random.default_rng(0).standard_normal((3, 64))
  np.testing.assert_array_equal(unpermute(permute(x_BS, layout, num_shards), layout, num_shards),
                                x_BS)
  # Also along another axis and for the inverse-then-forward order.
  x_SB = x_BS.T
  np.testing.assert_array_equal(
      permute(unpermute(x_SB, layout, num_shards, axis=0), layout, num_shards, axis=0), x_SB)
  assert sorted(permutation(layout, 64, num_shards)) == list(range(64))


@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_ring_is_identity(num_shards):
  np.testing.assert_array_equal(permutation("ring", 32, num_shards), np.arange(32))


@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_striped_shard_holds_every_nth_token(num_shards):
  seq_len = 64
  shards = permute(np.arange(seq_len)[None], "striped", num_shards)[0].reshape(num_shards, -1)
  for d in range(num_shards):
    np.testing.assert_array_equal(shards[d], np.arange(d, seq_len, num_shards))


@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_zigzag_shard_holds_chunks_d_and_mirror(num_shards):
  seq_len = 64
  chunks = np.arange(seq_len).reshape(2 * num_shards, -1)
  shards = permute(np.arange(seq_len)[None], "zigzag", num_shards)[0].reshape(num_shards, -1)
  for d in range(num_shards):
    np.testing.assert_array_equal(shards[d],
                                  np.concatenate([chunks[d], chunks[2 * num_shards - 1 - d]]))


def test_permute_works_on_every_per_token_array_alike():
  tokens = np.arange(32)[None] * 10
  index = np.arange(32)[None]
  np.testing.assert_array_equal(permute(tokens, "zigzag", 4), permute(index, "zigzag", 4) * 10)


@pytest.mark.parametrize("layout,num_shards,seq_len", [
    ("ring", 4, 30), ("striped", 8, 60), ("zigzag", 4, 36), ("zigzag", 2, 6)])
def test_indivisible_lengths_raise(layout, num_shards, seq_len):
  with pytest.raises(ValueError, match="divisible"):
    check_seq_len(seq_len, layout, num_shards)
  with pytest.raises(ValueError, match="divisible"):
    permute(np.zeros((1, seq_len)), layout, num_shards)


def test_unknown_layout_raises():
  with pytest.raises(ValueError, match="unknown sequence layout"):
    permutation("spiral", 16, 2)


def test_one_rule_for_the_lengths_a_layout_takes():
  """`length_unit`: the layout's divisor, every sequence shard, and ring shards x tile once a
  block is longer than a tile; the sampler's cache and the planner's searches round by it."""
  assert length_unit("zigzag", 4, 32) == 128  # 2 x 4 shards, 4 x 32-token tiles
  assert length_unit("zigzag", 4, 32, seq_len=64) == 8  # 16-token blocks: one short tile
  assert length_unit("ring", 2, 32, ulysses=4, seq_len=0) == 8
  assert shortest_ring_length(100, "zigzag", 4, 32) == 104  # 26-token blocks
  assert shortest_ring_length(200, "striped", 4, 32) == 256  # 50 > 32: whole tiles
