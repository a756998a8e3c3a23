"""QK-dropping (SCFA, issue #38; model/dropping.py): each chunk of CHUNK original positions
keeps exactly floor((1 - rate) * n + 1/2) queries and as many keys per head, the same tokens
in every layout; kept/dropped codes through hash attention's code contract give the dense
masked reference's output and gradients in a ring, a dropped query's output is 0 and nothing
is NaN; the model's dense and zigzag (8 devices) logits agree; config errors are one line.

Shapes and tolerances as tests/test_hash_attention.py.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from model import Decoder, ModelConfig
from model.dropping import CHUNK, drop_codes, kept_count
from parallelism.layouts import permute, unpermute
from tests.test_hash_attention import assert_one_line_config_error
from attention_helpers import F32_TOL, seq_mesh


_drop_codes = jax.jit(drop_codes, static_argnums=(0, 1, 2, 3, 4, 6))


def _codes(seq_len, rate, layer=0, layout="ring", heads=(4, 2)):
  """Query and key codes [S, H] of one row, in the layout of the mesh in context."""
  q, k = _drop_codes(1, seq_len, *heads, rate, jnp.int32(layer), layout)
  return np.asarray(q[0]), np.asarray(k[0])


def test_each_chunk_keeps_its_count_per_head_in_every_layout():
  """160 positions: chunks of 64, 64 and a short one of 32. Each keeps its count per head (q
  and k apart; rates 0.3 and 0.5); ring, striped and zigzag on 8 devices drop the same tokens
  as the row in its own order; the pattern differs by layer, head, q or k, and not by the
  row's length."""
  seq_len = 160
  for rate in (0.3, 0.5):
    q, k = _codes(seq_len, rate)
    assert set(np.unique(q)) == {0, 1} and set(np.unique(k)) == {0, 2}
    for codes in (q, k):
      for start in range(0, seq_len, CHUNK):
        kept = (codes[start:start + CHUNK] == 0).sum(axis=0)
        np.testing.assert_array_equal(kept, kept_count(rate, min(CHUNK, seq_len - start)))
  assert kept_count(0.3) == 45 and kept_count(0.5, 32) == 16
  assert not np.array_equal(q[:, 0], q[:, 1]) and not np.array_equal(q[:, :2] == 0, k == 0)
  assert not np.array_equal(q, _codes(seq_len, rate, layer=1)[0])
  np.testing.assert_array_equal(_codes(128, rate)[0], q[:128])
  with jax.set_mesh(seq_mesh(8)):
    for layout in ("ring", "striped", "zigzag"):
      got = _codes(seq_len, rate, layout=layout)
      assert not np.array_equal(got[0], q) or layout == "ring"
      for mine, want in zip(got, (q, k)):
        np.testing.assert_array_equal(unpermute(mine, layout, 8, axis=0), want)



def test_the_model_gives_the_same_logits_dense_and_zigzag():
  """Two layers (each its own pattern), rate 0.3, two documents per row: the dense path and a
  zigzag ring on 8 devices (the batch permuted as the data pipeline does) drop the same
  tokens, so the same logits; dropping changes them (it is not ignored). (Forward only: the
  ring test above checks the gradients and that none is NaN.)"""
  fields = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, vocab_size=101,
                dtype="float32", sparse="qk_drop", qk_drop_rate=0.3, attention_tile=4)
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, 101, (2, 64)), jnp.int32)
  first = np.arange(64) < 29
  segments = jnp.asarray(np.where(first, 0, 1)[None].repeat(2, 0), jnp.int32)
  positions = jnp.asarray(np.where(first, np.arange(64), np.arange(64) - 29)[None].repeat(2, 0),
                          jnp.int32)
  batch = (tokens, positions, segments)
  dense = Decoder(ModelConfig(**fields))
  params = jax.jit(dense.init)(jax.random.key(0), *batch)
  want = np.asarray(jax.jit(dense.apply)(params, *batch))
  plain = Decoder(ModelConfig(**{**fields, "sparse": "none", "qk_drop_rate": 0.0}))
  assert np.abs(np.asarray(jax.jit(plain.apply)(params, *batch)) - want).max() > 1e-2

  zigzag = Decoder(ModelConfig(**fields, attention="zigzag", kernel="xla"))
  mesh = jax.make_mesh((8,), ("sequence",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh), nn.logical_axis_rules((("activation_seq", "sequence"),)):
    logits = jax.jit(zigzag.apply)(params, *[permute(x, "zigzag", 8) for x in batch])
  np.testing.assert_allclose(unpermute(np.asarray(logits), "zigzag", 8), want, **F32_TOL)


@pytest.mark.parametrize("overrides,field", [
    ({"model.sparse": "qk_drop"}, "model.qk_drop_rate=0 must be in (0, 1)"),
    ({"model.sparse": "qk_drop", "model.qk_drop_rate": 1.0}, "model.qk_drop_rate=1 must be"),
    ({"model.qk_drop_rate": 0.3}, "model.qk_drop_rate=0.3 is set but model.sparse='none'"),
    ({"model.sparse": "hash", "model.hash_buckets": 4, "model.qk_drop_rate": 0.3},
     "model.qk_drop_rate=0.3 is set but model.sparse='hash'"),
    ({"model.sparse": "qk_drop", "model.qk_drop_rate": 0.3, "model.hash_buckets": 4},
     "model.hash_buckets=4 is set but model.sparse='qk_drop'"),
    ({"model.sparse": "qk_drop", "model.qk_drop_rate": 0.3, "model.window": 16,
      "model.sink_tokens": 2}, "model.sink_tokens=2 does not combine with model.sparse='qk_drop'"),
])
def test_config_errors_are_one_line(overrides, field):
  assert_one_line_config_error(overrides, field)
