"""Local attention (sliding windows) inside the ring: the rule, the schedule, the ring cut
short, and the model's local:global layers, each against a dense reference.

The schedule tests rebuild every block pair's visibility from the tile lists alone over the
whole grid the rule's edge cases live on (windows of 1, a tile and a block, each +-1, and
the whole row; ring sizes 1, 2, 3, 4, 8); the ring tests compile fewer cases, chosen so that
each truncation (`ring`: steps 0 and 1; `zigzag`: 0, 1 and N-1) and the whole ring (striped,
wide windows) runs forward and backward. Tolerances as in tests/test_ring_attention.py.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig
from parallelism import tiles, traffic
from parallelism.layouts import LAYOUTS
from parallelism.masks import Mask, MaskSpec, Side, visible
from parallelism.schedule import compare_layouts, held_block, ring_schedule
from attention_helpers import (F32_TOL, make_inputs)
from tests.test_schedule import _shape_of, _visible_from_lists


def _windows(seq_len, num_shards, tile):
  block = seq_len // num_shards
  return sorted({1, tile - 1, tile, tile + 1, block - 1, block, block + 1, seq_len} - {0})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
def test_schedule_with_a_window_rebuilds_the_elementwise_rule(layout, num_shards):
  tile = 4
  seq_len = 16 * num_shards
  for window in _windows(seq_len, num_shards, tile):
    schedule = ring_schedule(layout, seq_len, num_shards, window)
    plan = schedule.tiles(tile)
    needed = set()
    for device in range(num_shards):
      for step in range(num_shards):
        q_index = schedule.order[device]
        k_index = schedule.order[held_block(device, step, num_shards)]
        want = visible(Mask(MaskSpec(window=window)), q_index[:, None] - k_index[None, :])
        pair = schedule.pair[device, step]
        for lists, outer, inner, transposed in ((plan.by_query, tile, tile, False),
                                                (plan.by_key, tile, tile, True)):
          got = _visible_from_lists(plan, lists, pair, outer, inner, schedule.block_len,
                                    transposed)
          np.testing.assert_array_equal(got, want, err_msg=f"w={window} d={device} s={step}")
        assert schedule.shapes[pair] == _shape_of(want)
        if want.any():
          needed.add(step)
        # No listed tile is all invisible: SKIP means skipped, never computed for nothing.
        classes = plan.classes[pair]
        cells = want.reshape(schedule.block_len // tile, tile, -1, tile).any(axis=(1, 3))
        np.testing.assert_array_equal(classes != tiles.SKIP, cells)
    assert schedule.needed_steps == tuple(sorted(needed | {0}))


def test_window_of_a_block_cuts_ring_and_zigzag_short_and_leaves_striped_whole():
  """The steps each layout runs with w <= S/N, and the issue's tile counts at 256k tokens on
  8 devices, tiles of 512, w = 1,024 (striped causal: 16,640)."""
  n, seq_len = 8, 8 * 64
  assert ring_schedule("ring", seq_len, n, 64).needed_steps == (0, 1)
  assert ring_schedule("zigzag", seq_len, n, 32).needed_steps == (0, 1, n - 1)
  assert ring_schedule("striped", seq_len, n, 64).needed_steps == tuple(range(n))
  assert ring_schedule("ring", seq_len, n, 65).needed_steps == (0, 1)  # 64 back: block d-1
  assert ring_schedule("ring", seq_len, n, 66).needed_steps == (0, 1, 2)
  table, best = compare_layouts(262144, 8, 512, (1024,))
  paths = {line.split()[0]: line.split()[1] for line in table.splitlines()[1:]}
  assert paths == {"ring": "192", "striped": "1,016", "zigzag": "195"} and best == "ring"
  table, best = compare_layouts(262144, 8, 512, (None,))
  assert "16,640" in table and best == "zigzag"


def _packed_inputs(seq_len):
  seg = np.zeros((2, seq_len), np.int32)
  seg[0, 37:90] = 1  # Documents whose edges fall inside tiles and inside windows.
  seg[0, 90:] = 2
  return make_inputs(batch=2, seq_len=seq_len, num_heads=4, num_kv=2, segments=seg, seed=11)

# Windows against dense attention, in every layout, with the other strategies and the fused
# kernel: the contract table of tests/test_masks.py.


@pytest.mark.parametrize("layout,window,steps", [("zigzag", 8, 3)])
def test_a_ring_cut_short_sends_each_needed_block_once_each_way(layout, window, steps):
  """Counted in the compiled program: one K/V transfer per step run (not N - 1 hops), the
  backward's dK/dV back the same way, and XLA sends the forward's blocks once for both."""
  shapes = traffic.Shapes(rows=2, seq_len=128, heads=4, kv_heads=2, head_dim=16, itemsize=4,
                          packed=True)
  assert ring_schedule(layout, 128, 8, window).needed_steps.__len__() == steps
  counted = traffic.compiled_bytes("ring", shapes, 8, layout=layout, tile_size=8,
                                   window=window)
  expected = traffic.formula("ring", shapes, 8, steps=steps)
  whole = traffic.formula("ring", shapes, 8)
  assert traffic.sent_total(counted["forward"]) == pytest.approx(expected["forward"])
  assert traffic.sent_total(counted["gradient"]) == pytest.approx(
      expected["forward"] + expected["backward"] - expected["reused"])
  assert expected["forward"] == whole["forward"] * (steps - 1) / 7


def test_window_and_pattern_errors_name_the_field():
  fields = dict(num_layers=6, d_model=32, num_heads=2, num_kv_heads=2, d_ff=32, vocab_size=64)
  assert ModelConfig(**fields, window=8, layer_pattern="LLLLLG").layer_kinds == "LLLLLG"
  assert ModelConfig(**fields, window=8).layer_kinds == "LLLLLL"  # Mistral: every layer
  assert ModelConfig(**fields).layer_kinds == "GGGGGG"
  assert ModelConfig(**{**fields, "num_layers": 5}, window=8, layer_pattern="LG").layer_kinds \
      == "LGLGL"
  for bad, match in ((dict(layer_pattern="LX", window=4), "must be letters L"),
                     (dict(layer_pattern="LG"), "set model.window"),
                     (dict(window=4, layer_pattern="G"), "has no local layer"),
                     (dict(window=-1), "model.window=-1 must be >= 0"),
                     (dict(window=4, local_rope_theta=-1.0), "local_rope_theta"),
                     (dict(attention_softcap=-1.0),
                      "attention_softcap=-1.0 must be a finite number >= 0")):
    assert match in ModelConfig(**fields, **bad).pattern_problem()
  with pytest.raises(ValueError, match="window=0 must be a whole number"):
    ring_schedule("ring", 64, 2, 0)


# The decoders of the model tests here and in tests/test_head_spans.py: one shape, one batch.
DECODER = dict(num_layers=3, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, vocab_size=101,
               dtype="float32", attention_tile=8)


def decoder_batch():
  """(tokens, positions, segment ids) [2, 64]: two documents a row, the first 20 long."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 101, (2, 64)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (2, 64))
  segments = jnp.asarray(np.where(np.arange(64) < 20, 0, 1)[None].repeat(2, 0), jnp.int32)
  return tokens, positions, segments


def decoder_params(batch):
  """Parameters of a `DECODER`, initialised by the plain (all global) decoder: windows, spans
  and caps add no parameter, and one init program serves every test (the compile cache)."""
  from model import Decoder  # pylint: disable=g-import-not-at-top
  return jax.jit(Decoder(ModelConfig(**DECODER)).init)(jax.random.key(0), *batch)


def logits_and_loss(model, loss):
  """`(params, *batch) -> (loss(logits), logits)`: one compile gives both, with
  `jax.value_and_grad(..., has_aux=True)` the gradients too."""
  def run(params, *batch):
    logits = model.apply(params, *batch)
    return loss(logits), logits
  return run


def under_zigzag(fields: dict, params, batch, loss=None):
  """A decoder of `fields` under zigzag on 4 devices (xla kernel): its logits of `batch`
  (tokens, positions, segment ids) back in the row's order and, given `loss(logits)` (a
  function of the logits that ignores their order), the loss and its gradients (else
  None)."""
  import flax.linen as nn
  from jax.sharding import AxisType
  from model import Decoder
  from parallelism.layouts import permute, unpermute

  mesh = jax.make_mesh((4,), ("sequence",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:4])
  zigzag = Decoder(ModelConfig(**fields, attention="zigzag", kernel="xla"))
  permuted = [permute(x, layout="zigzag", num_shards=4) for x in batch]
  with jax.set_mesh(mesh), nn.logical_axis_rules((("activation_seq", "sequence"),)):
    if loss is None:
      logits, graded = jax.jit(zigzag.apply)(params, *permuted), None
    else:
      (value, logits), grads = jax.jit(jax.value_and_grad(logits_and_loss(zigzag, loss),
                                                          has_aux=True))(params, *permuted)
      graded = value, grads
  return unpermute(np.asarray(logits), "zigzag", 4), graded


def test_local_and_global_layers_in_one_scan_match_dense_in_a_ring_cut_short():
  """A decoder of local (window 5, own RoPE base) and global layers, 'LG' over 3 layers,
  logits soft-capped (Gemma 2): zigzag on 4 devices (local layers' ring cut short) gives
  dense's logits and gradients, and the window changes them (it is not ignored)."""
  from model import Decoder

  tokens, positions, segments = decoder_batch()
  fields = dict(**DECODER, window=5, layer_pattern="LG", local_rope_theta=100.0,
                attention_softcap=3.0)
  dense = Decoder(ModelConfig(**fields))
  params = decoder_params((tokens, positions, segments))
  loss = lambda logits: jnp.sum(jnp.sin(logits))
  (want, want_logits), want_grads = jax.jit(jax.value_and_grad(logits_and_loss(dense, loss),
                                                               has_aux=True))(
      params, tokens, positions, segments)
  everywhere_global = Decoder(ModelConfig(**{**fields, "window": 0, "layer_pattern": ""}))
  assert abs(float(jax.jit(logits_and_loss(everywhere_global, loss))(
      params, tokens, positions, segments)[0]) - float(want)) > 1e-2

  logits, (got, grads) = under_zigzag(fields, params, (tokens, positions, segments), loss)
  np.testing.assert_allclose(logits, np.asarray(want_logits), **F32_TOL)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  # Each gradient sums 2 x 64 x 101 terms: float32 rounding relative to the largest entry.
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    scale = float(np.abs(np.asarray(w)).max())
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * scale)


def _decode_step(layout, num_shards, capacity, spec):
  """`decode_attention` under the mask `spec` on a sequence mesh of `num_shards`, jitted,
  for a cache in layout: step(q, k, v, key cache, value cache, positions, spans=None) ->
  (out, key cache, value cache)."""
  from parallelism import decoding  # pylint: disable=g-import-not-at-top
  rules = decoding.decode_rules((("activation_batch", None), ("activation_seq", "sequence"),
                                 ("activation_heads", None), ("activation_kv_heads", None)))
  mesh = jax.make_mesh((num_shards,), ("sequence",), (jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:num_shards])  # as parallelism.make_mesh's

  def step(q, k, v, key_cache, value_cache, positions, spans=None):
    out, (keys, values, _) = decoding.decode_attention(
        q, k, v, (key_cache, value_cache, Side()), positions, Mask(spec, Side(spans=spans)),
        layout=layout, rules=rules, mesh=mesh)
    return out, keys, values

  return mesh, jax.jit(step)


def _cache_sharding(mesh):
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))


# The layout reaches a decode step only as host-side tables (`decoding.cache_positions`, its
# inverse), so one runs: striped, whose window is spread over every device. Zigzag decodes
# with sinks and with per-head spans (tests/test_sinks.py, tests/test_head_spans.py).
@pytest.mark.parametrize("layout", ["striped"])
def test_a_local_decode_step_reads_the_window_and_matches_dense(layout):
  """A decode step of a local layer, at positions before, at and well past the window, sees
  exactly the w positions up to its own (the cache in the layout's order, 4 devices); its
  compiled cost does not grow with the cache's capacity."""
  from parallelism.layouts import permutation  # pylint: disable=g-import-not-at-top
  window, heads, kv, dim, capacity = 5, 4, 2, 8, 64
  rng = np.random.default_rng(7)
  keys, values = (rng.standard_normal((2, capacity, kv, dim), np.float32) for _ in range(2))
  mesh, step = _decode_step(layout, 4, capacity, MaskSpec(window=window))
  order = permutation(layout, capacity, 4)
  for position in (0, 3, 4, 5, 30, 63):
    q, k, v = (rng.standard_normal((2, 1, h, dim), np.float32) for h in (heads, kv, kv))
    positions = np.array([position, max(position - 2, 0)], np.int32)  # rows differ
    cache = [jax.device_put(c[:, order], _cache_sharding(mesh)) for c in (keys, values)]
    with jax.set_mesh(mesh):
      out, key_cache, _ = step(q, k, v, *cache, positions)
    for row, p in enumerate(positions):
      k_all, v_all = keys[row].copy(), values[row].copy()
      k_all[p], v_all[p] = k[row, 0], v[row, 0]
      seen = slice(max(p - window + 1, 0), p + 1)
      scores = np.einsum("kgd,ckd->kgc", q[row, 0].reshape(kv, heads // kv, dim),
                         k_all[seen]) / np.sqrt(dim)
      weights = np.exp(scores - scores.max(-1, keepdims=True))
      want = np.einsum("kgc,ckd->kgd", weights / weights.sum(-1, keepdims=True), v_all[seen])
      np.testing.assert_allclose(np.asarray(out)[row, 0], want.reshape(heads, dim), **F32_TOL)
      np.testing.assert_array_equal(np.asarray(key_cache)[row, np.argsort(order)[p]], k[row, 0])

  def flops(capacity):
    mesh, step = _decode_step(layout, 4, capacity, MaskSpec(window=window))
    token, cache = ((2, 1, h, dim) for h in (heads, kv, kv)), (2, capacity, kv, dim)
    args = [*(jax.ShapeDtypeStruct(s, jnp.float32) for s in token),
            *(jax.ShapeDtypeStruct(cache, jnp.float32, sharding=_cache_sharding(mesh))
              for _ in range(2)), jax.ShapeDtypeStruct((2,), jnp.int32)]
    with jax.set_mesh(mesh):
      return step.lower(*args).compile().cost_analysis()["flops"]

  assert flops(1024) == flops(64)
