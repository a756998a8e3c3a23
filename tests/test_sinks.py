"""Sink tokens of local layers (`parallelism.sinks`): the first k positions of each document
stay visible to every later query of it, beside the windowed ring, exact against a dense
masked reference (forward and gradients), in every layout, with GQA, packed documents (one
starting mid-row, one shorter than k), a window or per-head spans.

Shapes and tolerances as tests/test_windows.py and tests/test_head_spans.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallelism.masks import Mask, MaskSpec
from attention_helpers import (F32_TOL, assert_close, make_inputs, ring_in_layout,
                                       seq_mesh)

SINKS = 3
SPANS = (3, 17, 9, 40)  # per query head, as tests/test_head_spans.py


def _inputs(seq_len=128):
  """Row 0: documents [0, 37), [37, 39) (shorter than k), [39, 90), [90, S); row 1: one.
  Positions restart at 0 per document, as the data pipeline packs them."""
  seg = np.zeros((2, seq_len), np.int32)
  seg[0, 37:39], seg[0, 39:90], seg[0, 90:] = 1, 2, 3
  starts = np.maximum.accumulate(
      np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(seq_len), 0), axis=1)
  positions = (np.arange(seq_len) - starts).astype(np.int32)
  inputs = make_inputs(batch=2, seq_len=seq_len, num_heads=4, num_kv=2, segments=seg, seed=5)
  return inputs, positions


# Jitted: one compile per shape, where op-by-op dispatch compiled each of its ops; `sinks` is
# an operand, so the reference without them is the same program.
@functools.partial(jax.jit, static_argnames=("windows",))
def sink_reference(q, k, v, dout, index, seg, positions, windows, sinks=SINKS):
  """Dense attention, query head h seeing keys 0 <= i - j < windows[h] of its document, or
  any earlier key of it at a position below `sinks`: (out, dq, dk, dv)."""
  def attend(q, k, v):
    group = q.shape[2] // k.shape[2]
    kh, vh = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kh, precision="highest") * q.shape[-1] ** -0.5
    behind = (index[:, :, None] - index[:, None, :])[:, None]
    near = behind < jnp.asarray(windows)[None, :, None, None]
    sink = (positions[:, None, :] < sinks)[:, None]
    visible = (behind >= 0) & (seg[:, :, None] == seg[:, None, :])[:, None] & (near | sink)
    p = jnp.where(visible, jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vh, precision="highest")

  out, vjp = jax.vjp(attend, q, k, v)
  return (out, *vjp(dout))


def _ring(layout, num_shards, inputs, positions, window, narrowest=None, **kwargs):
  spec = MaskSpec(window=window, narrowest=narrowest, sink_tokens=SINKS)
  return ring_in_layout(layout, seq_mesh(num_shards), *inputs, tile_size=8,
                        positions=positions, spec=spec, **kwargs)


# The sinks' own code (`parallelism.sinks`) is the same in every layout but for the host-side
# order it is handed; the ring beside it is the windowed ring. So each layout runs once: ring
# (cut short) in test_ring_with_sinks_matches_dense_over_several_rounds; zigzag with spans,
# zigzag with w = 1 in the hybrid strategy and striped in allgather in tests/test_masks.py.



def test_ring_with_sinks_matches_dense_over_several_rounds():
  """The ring with sinks matches dense (forward and gradients, the sinks not ignored).
  Positions that restart every 5 tokens inside one segment (as with cross-document
  attention) make 77 sinks in row 1, over the capacity 3 * (128 // 10) = 36: three rounds,
  exact; row 0 needs one round (the rounds are one loop, its count the row's), in the ring
  layout cut short by the window. Each round's score table takes the 32 queries of a block
  8 at a time (at most the block's q in size: 8 x 36 <= 32 x 16)."""
  from parallelism import sinks  # pylint: disable=g-import-not-at-top
  assert sinks.query_chunk(32, 36, 16) == 8 and sinks.query_chunk(32768, 256, 128) == 16384
  inputs, positions = _inputs()
  positions = positions.copy()
  positions[1] = np.arange(128) % 5
  want = sink_reference(*inputs, positions, (9,) * 4)
  assert_close(_ring("ring", 4, inputs, positions, window=9), want, **F32_TOL)
  plain = sink_reference(*inputs, positions, (9,) * 4, sinks=0)
  assert np.abs(np.asarray(plain[0][0]) - np.asarray(want[0][0])).max() > 1e-2  # row 0 too


def test_sinks_need_a_window_and_positions():
  (q, k, v, *_), positions = _inputs(64)
  from parallelism import ring_attention  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"sink_tokens=2 needs a window \(mask.window\)"):
    ring_attention(q, k, v, Mask.of(MaskSpec(sink_tokens=2), positions=positions),
                   layout="ring")
  with pytest.raises(ValueError, match=r"sink tokens need positions .* \[B, S\]"):
    ring_attention(q, k, v, Mask.of(MaskSpec(window=8, sink_tokens=2)), layout="ring")
  with pytest.raises(ValueError, match="sink_tokens=-1 must be >= 0"):
    ring_attention(q, k, v, Mask.of(MaskSpec(window=8, sink_tokens=-1)), layout="ring")


@pytest.mark.parametrize("capacity", [64, 16])
def test_a_decode_step_reads_the_sinks_beyond_the_window(capacity):
  """Decoding a local layer reads the window's slots and the sinks' (capacity 64: gathered,
  16 per device; 16: 4 per device, every slot masked), each once, on 4 devices in zigzag."""
  from parallelism.layouts import permutation  # pylint: disable=g-import-not-at-top
  from tests.test_windows import _cache_sharding, _decode_step  # pylint: disable=g-import-not-at-top
  window, heads, kv, dim = 5, 4, 2, 8
  rng = np.random.default_rng(3)
  keys, values = (rng.standard_normal((2, capacity, kv, dim), np.float32) for _ in range(2))
  mesh, step = _decode_step("zigzag", 4, capacity, MaskSpec(window=window, sink_tokens=SINKS))
  order = permutation("zigzag", capacity, 4)
  for position in (1, 6, capacity - 1):
    q, k, v = (rng.standard_normal((2, 1, h, dim), np.float32) for h in (heads, kv, kv))
    positions = np.array([position, max(position - 4, 0)], np.int32)
    cache = [jax.device_put(c[:, order], _cache_sharding(mesh)) for c in (keys, values)]
    with jax.set_mesh(mesh):
      out, _, _ = step(q, k, v, *cache, positions)
    for row, p in enumerate(positions):
      k_all, v_all = keys[row].copy(), values[row].copy()
      k_all[p], v_all[p] = k[row, 0], v[row, 0]
      seen = sorted(set(range(max(p - window + 1, 0), p + 1)) | set(range(min(SINKS, p + 1))))
      scores = np.einsum("kgd,ckd->kgc", q[row, 0].reshape(kv, heads // kv, dim),
                         k_all[seen]) / np.sqrt(dim)
      weights = np.exp(scores - scores.max(-1, keepdims=True))
      want = np.einsum("kgc,ckd->kgd", weights / weights.sum(-1, keepdims=True), v_all[seen])
      np.testing.assert_allclose(np.asarray(out)[row, 0], want.reshape(heads, dim), **F32_TOL)


def test_the_model_dense_path_sees_the_sinks():
  """`model.dense_attention` (the `dense` attention and the model tests' reference)."""
  from model.attention import dense_attention as model_dense  # pylint: disable=g-import-not-at-top
  (q, k, v, dout, index, seg), positions = _inputs(64)
  want = sink_reference(q, k, v, dout, index, seg, positions, SPANS)[0]
  spec = MaskSpec(window=max(SPANS), narrowest=min(SPANS), sink_tokens=SINKS)
  got = model_dense(q, k, v, Mask.of(spec, seg, positions=jnp.asarray(positions),
                                     spans=jnp.asarray(SPANS)))
  np.testing.assert_allclose(got, want, **F32_TOL)


@pytest.mark.parametrize("fields,message", [
    (dict(window=8, sink_tokens=-1), "model.sink_tokens=-1 must be >= 0 (0: none)"),
    (dict(sink_tokens=4), "model.sink_tokens=4 needs local layers (model.window or "
                          "model.head_spans): a global layer already sees every earlier key")])
def test_a_bad_sink_config_is_one_line(fields, message):
  from model import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, d_ff=32,
                    vocab_size=64, **fields)
  assert cfg.pattern_problem() == message
