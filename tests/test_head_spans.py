"""Per-head spans (MoA): each query head its own window, between the schedule's narrowest and
widest, exact against a dense reference that runs each head alone with its own window.

Shapes and tolerances as tests/test_windows.py (which these reuse), so that the compiles are
few and small.
"""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig
from parallelism import tiles
from parallelism.layouts import LAYOUTS
from parallelism.kernel_grads import Merged
from parallelism.masks import Mask, MaskSpec, Side, visible
from parallelism.schedule import held_block, ring_schedule
from attention_helpers import (F32_TOL, dense_attention)
from tests.test_schedule import _visible_from_lists
from tests.test_windows import (DECODER, _packed_inputs, decoder_batch, decoder_params,
                                under_zigzag)

SPANS = (3, 17, 9, 40)  # per query head; GQA pairs heads (0, 1) and (2, 3) on one kv head
SPEC = MaskSpec(window=max(SPANS), narrowest=min(SPANS))


# Jitted: one compile per shape, where op-by-op dispatch compiled each of its ops.
@functools.partial(jax.jit, static_argnames="spans")
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
          want = visible(Mask(MaskSpec(window=span)), q_index[:, None] - k_index[None, :])
          np.testing.assert_array_equal(got, want, err_msg=f"s={span} d={device} t={step}")



def test_spans_need_their_bounds_and_one_per_query_head():
  q, k, v, *_ = _packed_inputs(64)
  from parallelism import ring_attention  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"mask.q.spans \[query heads\] = \[4\]"):
    ring_attention(q, k, v, Mask.of(MaskSpec(8, 2), spans=jnp.asarray([2, 8])), layout="ring")
  with pytest.raises(ValueError, match=r"mask.q.spans \[query heads\] = \[4\]\) go with"):
    ring_attention(q, k, v, Mask.of(MaskSpec(8), spans=jnp.asarray([2, 8, 4, 4])),
                   layout="ring")
  with pytest.raises(ValueError, match=r"narrowest=9: .* at most the widest \(mask.window=8\)"):
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


def test_dense_attention_with_spans_is_each_head_alone():
  """The model's dense path (and the reference of the model test below)."""
  from model.attention import dense_attention as model_dense  # pylint: disable=g-import-not-at-top
  q, k, v, dout, index, seg = _packed_inputs(64)
  got = jax.jit(lambda q, k, v, seg, spans: model_dense(q, k, v, Mask.of(SPEC, seg, spans=spans)))(
      q, k, v, seg, jnp.asarray(SPANS))
  np.testing.assert_allclose(got, per_head_reference(q, k, v, dout, index, seg, SPANS)[0],
                             **F32_TOL)


def _plan(tmp_path, alpha, beta, name="plan.json"):
  path = tmp_path / name
  path.write_text(json.dumps({"alpha": alpha, "beta": beta}))
  return str(path)


def test_a_span_plan_resolves_at_the_row_length_and_a_bad_one_is_one_line(tmp_path):
  fields = dict(num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, d_ff=32, vocab_size=64,
                span_length=64)
  plan = _plan(tmp_path, [[1, 8], [100, 64]], [[1 / 32, 0.25], [0, 0]])
  cfg = ModelConfig(**fields, head_spans=plan)
  assert cfg.spans == ((3, 24), (64, 64)) and cfg.layer_kinds == "LG"
  assert (cfg.window_of("L"), cfg.narrowest_span, cfg.window_of("G")) == (24, 3, None)
  # JSON's Infinity (and an integer no float holds) is a span of the row or more: causal.
  endless = _plan(tmp_path, [[1, float("inf")], [10 ** 400, 64]], [[1 / 32, 0], [0, 0]])
  assert ModelConfig(**fields, head_spans=endless).spans == ((3, 64), (64, 64))
  for alpha, beta, match in (
      ([[1, 8]], [[0, 0]], "'alpha' must have one row per layer, 2 .* it has 1"),
      ([[1, 8], [1, 8]], [[0, 0], [0]], "'beta' row 1 must have one entry per query head, 2"),
      ([[1, 8], [0, 8]], [[0, 0], [0, 0]], "layer 1 head 0 has span 0 at length 64"),
      ([[1, 8], [1, "x"]], [[0, 0], [0, 0]], "'alpha' row 1 must hold numbers"),
      ([[1, 8], [1, float("nan")]], [[0, 0], [0, 0]], "layer 1 head 1 has alpha nan and beta 0"),
      ([[1, 8], [1, 8]], [[0, 0], [float("nan"), 0]], "layer 1 head 0 has alpha 1 and beta nan"),
      ([[1, 8], [-float("inf"), 8]], [[0, 0], [0, 0]], "layer 1 head 0 has span -inf")):
    problem = ModelConfig(**fields, head_spans=_plan(tmp_path, alpha, beta)).pattern_problem()
    assert re.search(match, problem) and "\n" not in problem, problem
  missing = ModelConfig(**fields, head_spans=str(tmp_path / "none.json")).pattern_problem()
  assert "cannot read the plan" in missing and "\n" not in missing
  assert "leave model.window at 0" in ModelConfig(**fields, head_spans=plan,
                                                  window=8).pattern_problem()


def test_a_decoder_with_a_span_plan_matches_dense_in_zigzag(tmp_path):
  """Three layers 'LGL' from a plan (a global layer: every span the row), per-head spans
  scanned with the blocks: zigzag on 4 devices gives dense's logits, and the spans change
  them. (Forward only: the ring tests above check the gradients of the same passes.)"""
  from model import Decoder  # pylint: disable=g-import-not-at-top

  tokens, positions, segments = decoder_batch()
  plan = _plan(tmp_path, [[3, 12, 9, 20], [64] * 4, [5, 5, 30, 2]], [[0] * 4] * 3)
  fields = dict(**DECODER, head_spans=plan, span_length=64)
  dense = Decoder(ModelConfig(**fields))
  assert dense.cfg.layer_kinds == "LGL" and dense.cfg.narrowest_span == 2
  # Jitted: one compile each, where op-by-op dispatch compiled every op of the decoder.
  params = decoder_params((tokens, positions, segments))
  want = np.asarray(jax.jit(dense.apply)(params, tokens, positions, segments))
  widest = _plan(tmp_path, [[20] * 4, [64] * 4, [30] * 4], [[0] * 4] * 3, "widest.json")
  one_window = Decoder(ModelConfig(**{**fields, "head_spans": widest}))
  assert np.abs(np.asarray(jax.jit(one_window.apply)(params, tokens, positions, segments))
                - want).max() > 1e-2

  logits, _ = under_zigzag(fields, params, (tokens, positions, segments))
  np.testing.assert_allclose(logits, want, **F32_TOL)


def test_a_decode_step_with_per_head_spans_matches_each_head_alone():
  """Zigzag cache on 4 devices, window 5 (the widest), heads of spans 2, 5, 3, 4; positions
  before, at and past the window."""
  from parallelism.layouts import permutation  # pylint: disable=g-import-not-at-top
  from tests.test_windows import _decode_step  # pylint: disable=g-import-not-at-top
  spans, heads, kv, dim, capacity = (2, 5, 3, 4), 4, 2, 8, 64
  mesh, step = _decode_step("zigzag", 4, capacity, MaskSpec(max(spans), min(spans)))
  rng = np.random.default_rng(7)
  keys, values = (rng.standard_normal((2, capacity, kv, dim), np.float32) for _ in range(2))
  order = permutation("zigzag", capacity, 4)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))
  for position in (1, 4, 40):
    q, k, v = (rng.standard_normal((2, 1, h, dim), np.float32) for h in (heads, kv, kv))
    positions = np.array([position, position + 3], np.int32)
    cache = [jax.device_put(c[:, order], sharding) for c in (keys, values)]
    with jax.set_mesh(mesh):
      out = np.asarray(step(q, k, v, *cache, positions, spans=jnp.asarray(spans))[0])
    for row, p in enumerate(positions):
      k_all, v_all = keys[row].copy(), values[row].copy()
      k_all[p], v_all[p] = k[row, 0], v[row, 0]
      for h, span in enumerate(spans):
        seen = slice(max(p - span + 1, 0), p + 1)
        scores = k_all[seen, h // 2] @ q[row, 0, h] / np.sqrt(dim)
        weights = np.exp(scores - scores.max())
        want = weights @ v_all[seen, h // 2] / weights.sum()
        np.testing.assert_allclose(out[row, 0, h], want, **F32_TOL)


def test_the_pallas_kernels_with_spans_lower_to_triton_for_cuda(monkeypatch):
  """Cross-lowering (no GPU needed), as tests/test_kernel_pallas.py does for windows: the
  per-head span test in MASKED tiles is a construct Triton's lowering takes."""
  from parallelism import kernel_pallas  # pylint: disable=g-import-not-at-top
  from tests.test_kernel_pallas import _export_for_cuda  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(kernel_pallas, "_interpret", lambda: False)
  schedule = ring_schedule("striped", 1024, 4, 300, 40)
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)

  def fwd_bwd(q, k, v, seg, pair, spans):
    attend = dict(schedule=schedule, pair=pair, tile=256)
    mask = Mask(MaskSpec(300, 40), Side(seg, spans=spans), Side(seg))
    out, lse = kernel_pallas.block_fwd(q, k, v, mask, **attend)
    return kernel_pallas.block_bwd(q, k, v, mask, Merged(out, lse, q, jnp.sum(out, axis=-1)),
                                   **attend)

  exported = _export_for_cuda(fwd_bwd, q, kv, kv, seg, jax.ShapeDtypeStruct((), jnp.int32),
                              jax.ShapeDtypeStruct((4,), jnp.int32))
  assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 3  # fwd, dK/dV, dQ
