"""Hash attention (SCFA, issue #38): a query sees a key iff causal, same document and same
bucket (per head; under GQA its kv head's key code). Exact against a dense masked reference
given the same codes, forward, lse and gradients, in every layout, with GQA, packed documents
and rows that see nothing; the model's dense and ring paths agree; config errors are one line.

Shapes and tolerances as tests/test_ring_attention.py and tests/test_sinks.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.hashing import bucket_codes, projections
from parallelism import kernel_xla, kernels
from parallelism.kernel_grads import Merged
from parallelism.masks import Mask, MaskSpec
from parallelism.schedule import ring_schedule
from attention_helpers import (F32_TOL, assert_close, make_inputs)

BUCKETS = 4


def _packed_inputs(num_kv=2, buckets=BUCKETS, seq_len=128):
  """Row 0: documents [0, 37), [37, 90), [90, S); row 1: one. Codes from the model's hash."""
  seg = np.zeros((2, seq_len), np.int32)
  seg[0, 37:90], seg[0, 90:] = 1, 2
  inputs = make_inputs(batch=2, seq_len=seq_len, num_heads=4, num_kv=num_kv, segments=seg,
                       seed=11)
  return inputs, _codes(inputs, buckets)


def _codes(inputs, buckets):
  q, k = inputs[:2]
  proj_KDR = jnp.asarray(projections(1, k.shape[2], k.shape[3], buckets)[0])
  return np.asarray(bucket_codes(q, proj_KDR)), np.asarray(bucket_codes(k, proj_KDR))


def _visible(index, seg, q_codes, k_codes, window=None):
  """[B, Hq, Sq, Sk]: causal (within `window` keys), same document, same bucket (query head
  h, kv head h // G)."""
  group = q_codes.shape[2] // k_codes.shape[2]
  k_codes_BSH = np.repeat(k_codes, group, axis=2)
  behind = index[:, :, None] - index[:, None, :]
  causal = (behind >= 0) & (behind < (window or np.inf)) & (seg[:, :, None] == seg[:, None, :])
  same = q_codes.transpose(0, 2, 1)[..., None] == k_codes_BSH.transpose(0, 2, 1)[:, :, None]
  return causal[:, None] & same


def hash_reference(q, k, v, dout, index, seg, q_codes, k_codes, window=None):
  """Dense masked attention: (out, dq, dk, dv) and lse [B, S, Hq] (-inf where nothing is seen)."""
  return _masked_reference(q, k, v, dout, _visible(index, seg, q_codes, k_codes, window))


@jax.jit  # One compile per shape, where op-by-op dispatch compiled each of its ops.
def _masked_reference(q, k, v, dout, visible):
  """`hash_reference` given the mask `visible` [B, Hq, Sq, Sk]."""
  def attend(q, k, v):
    group = q.shape[2] // k.shape[2]
    kh, vh = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kh, precision="highest") * q.shape[-1] ** -0.5
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(total > 0, total, 1.0), vh,
                     precision="highest")
    lse = jnp.where(total[..., 0] > 0, jnp.log(jnp.where(total > 0, total, 1.0))[..., 0]
                    + jnp.where(jnp.isfinite(m), m, 0.0)[..., 0], -jnp.inf)
    return out, lse.transpose(0, 2, 1)

  (out, lse), vjp = jax.vjp(attend, q, k, v)
  return (out, *vjp((dout, jnp.zeros_like(lse)))), lse


def _empty_rows(index, seg, q_codes, k_codes):
  """[B, S, Hq] where the query sees no key."""
  return ~_visible(index, seg, q_codes, k_codes).any(-1).transpose(0, 2, 1)



def test_the_hash_is_argmax_over_plus_and_minus_projections():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, 5, 4, 16), np.float32)  # 4 query heads over 2 kv heads
  proj = projections(3, 2, 16, 6)
  assert proj.shape == (3, 2, 16, 3)
  np.testing.assert_allclose(np.linalg.norm(proj, axis=2), 1.0, rtol=1e-6)
  assert not np.allclose(proj[0], proj[1])  # each layer its own projection
  codes = np.asarray(bucket_codes(jnp.asarray(x), jnp.asarray(proj[0])))
  for h in range(4):
    xr = x[0, :, h] @ proj[0, h // 2]
    np.testing.assert_array_equal(codes[0, :, h], np.argmax(np.c_[xr, -xr], axis=-1))
  # A positive scale (the paper's normalization) leaves every bucket where it was.
  np.testing.assert_array_equal(bucket_codes(jnp.asarray(3.5 * x), jnp.asarray(proj[0])), codes)



@pytest.mark.parametrize("side_by_side", [None, 3])
def test_block_kernel_lse_and_gradients_with_buckets(side_by_side, monkeypatch):
  """One whole block (its lse is the global one): out, lse (-inf where empty) and the
  backward from that lse, against dense; walking the tiles one at a time (a CPU's way) and
  3 side by side (a GPU's, in batches whose shorter lists are masked; 3 leaves a remainder)."""
  from parallelism import row_tiles  # pylint: disable=g-import-not-at-top
  walks = []  # Each walk asks while the kernels trace: once each, in this test's own jit.
  if side_by_side:
    monkeypatch.setattr(row_tiles, "tiles_side_by_side",
                        lambda count, tile: walks.append(count) or min(count, side_by_side))
  (q, k, v, dout, index, seg), codes = _packed_inputs(seq_len=32)
  schedule = ring_schedule("ring", 32, 1)
  at = dict(schedule=schedule, pair=schedule.pair[0, 0], tile=8)

  @jax.jit  # One compile; op by op, each of the kernels' loops compiled on its own (2x CPU).
  def forward_and_backward(q, k, v, dout, seg, codes):
    mask = Mask.of(MaskSpec(sparse="hash", hash_buckets=BUCKETS), seg, codes=codes)
    out, lse = kernel_xla.block_fwd(q, k, v, mask, **at)
    return out, lse, kernel_xla.block_bwd(q, k, v, mask, Merged.of(out, lse, dout), **at)

  out, lse, grads = forward_and_backward(q, k, v, dout, seg, codes)
  want, want_lse = hash_reference(q, k, v, dout, index, seg, *codes)
  assert_close((out, *grads), want, **F32_TOL)
  assert len(walks) == (3 if side_by_side else 0)  # the forward, dq, and dk with dv
  empty = _empty_rows(index, seg, *codes)
  assert empty.any()
  assert np.all(np.asarray(lse)[empty] == -np.inf)
  np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(want_lse)[~empty], **F32_TOL)


def test_the_kernel_skips_tiles_by_bucket_at_run_time():
  """One causal block of 256 tokens, a ring tile of 8, per (query head, 8 x 8 pair). With
  one bucket the ranges are the static schedule's causal rule at the kernel's own tiles
  (`kernel_hash.tiles`: 4 x 4); with 8 buckets of the model's hash the kernel computes
  under 0.25 of causal's (ideal 1/8: sorted, a bucket's 32 queries and keys are 8 tiles,
  its first and last partly its neighbours')."""
  from parallelism import kernel_hash  # pylint: disable=g-import-not-at-top
  inputs = make_inputs(batch=2, seq_len=256, num_heads=4, num_kv=2, seed=13)
  schedule = ring_schedule("ring", 256, 1)
  index = schedule.pair_index[0][0]
  causal = int(schedule.computed_tiles(8)[0, 0]) * 2 * 4
  spec = MaskSpec(sparse="hash", hash_buckets=8)
  count = lambda q_codes, k_codes: float(kernel_hash.computed_tiles(
      Mask.of(spec, codes=(q_codes, k_codes)), 8, index, index))
  codes = _codes(inputs, 8)
  own = int(schedule.computed_tiles(4)[0, 0]) * 2 * 4 / 4  # in 8 x 8 pairs
  assert count(np.zeros_like(codes[0]), np.zeros_like(codes[1])) == own < causal
  assert count(*codes) < 0.25 * causal


def test_the_model_dense_path_applies_the_buckets():
  from model.attention import dense_attention as model_dense  # pylint: disable=g-import-not-at-top
  (q, k, v, dout, index, seg), codes = _packed_inputs(seq_len=64)
  got = jax.jit(lambda q, k, v, seg, codes: model_dense(  # one compile, not op by op
      q, k, v, Mask.of(MaskSpec(sparse="hash", hash_buckets=BUCKETS), seg, codes=codes)))(
          q, k, v, seg, codes)
  want = hash_reference(q, k, v, dout, index, seg, *codes)[0][0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


def test_only_xla_applies_buckets():
  """`auto` goes on to xla; a named kernel that cannot is one line naming the field."""
  shape, spec = (1, 64, 4, 16), MaskSpec(sparse="hash", hash_buckets=4)
  assert kernels.choose("xla", spec, shape, shape, 16, jnp.float32) == ("xla", None)
  with kernels.target.compiling_for("gpu"):
    chosen, reason = kernels.choose("auto", spec, shape, shape, 16, jnp.float32)
  assert chosen == "xla" and "no run-time mask" in reason
  with pytest.raises(ValueError, match=r"model.kernel='pallas' cannot run this attention: "
                                       r"the pallas kernel has no run-time mask"):
    kernels.check_spec("pallas", spec, "model.kernel")


@pytest.mark.parametrize("overrides,field", [
    ({"model.sparse": "lsh"}, "model.sparse='lsh' must be one of"),
    ({"model.sparse": "hash"}, "model.hash_buckets=0 must be even and >= 2"),
    ({"model.sparse": "hash", "model.hash_buckets": 3}, "model.hash_buckets=3 must be even"),
    # At most twice the head size (32): the 2^40 failed allocating 512 TiB of them.
    ({"model.sparse": "hash", "model.hash_buckets": 66},
     "model.hash_buckets=66 must be at most twice the head size, 64"),
    ({"model.sparse": "hash", "model.hash_buckets": 1 << 40}, "model.hash_buckets=1099511627776"),
    ({"model.hash_buckets": 4}, "but model.sparse='none'"),
    ({"model.sparse": "hash", "model.hash_buckets": 4, "model.window": 16,
      "model.sink_tokens": 2}, "model.sink_tokens=2 does not combine"),
    ({"model.sparse": "hash", "model.hash_buckets": 4, "model.kernel": "pallas"},
     "model.kernel='pallas' cannot run this attention: the pallas kernel has no run-time"),
])
def test_config_errors_are_one_line(overrides, field):
  assert_one_line_config_error(overrides, field)


def assert_one_line_config_error(overrides: dict, field: str) -> None:
  """The zigzag tiny config with `overrides` ("group.key": value) stops the config check
  with one line naming `field` (also tests/test_qk_drop.py's)."""
  import importlib  # pylint: disable=g-import-not-at-top
  from trainer.config.config_check import ConfigError, check_config  # pylint: disable=g-import-not-at-top
  config = importlib.import_module("configs.tiny_cpu").get_config("zigzag")
  for path, value in overrides.items():
    group, key = path.split(".")
    config[group][key] = value
  with pytest.raises(ConfigError) as error:
    check_config(config, num_devices=8)
  assert field in str(error.value) and "\n" not in str(error.value)


def test_the_model_gives_the_same_logits_dense_and_zigzag():
  """The model hashes its roped q and k per layer (a projection scanned with the blocks): the
  dense path and a zigzag ring on 4 devices see the same buckets, so the same logits, and
  the buckets change them. (Forward only: the ring tests above check the gradients.)"""
  from model import Decoder, ModelConfig  # pylint: disable=g-import-not-at-top
  from tests.test_windows import under_zigzag  # pylint: disable=g-import-not-at-top
  fields = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, vocab_size=101,
                dtype="float32", sparse="hash", hash_buckets=BUCKETS, attention_tile=8)
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, 101, (2, 64)), jnp.int32)
  segments = jnp.asarray(np.where(np.arange(64) < 29, 0, 1)[None].repeat(2, 0), jnp.int32)
  positions = jnp.asarray(np.where(np.arange(64) < 29, np.arange(64), np.arange(64) - 29)
                          [None].repeat(2, 0), jnp.int32)
  dense = Decoder(ModelConfig(**fields))
  # Jitted: one compile each, where op-by-op dispatch compiled every op of the decoder.
  params = jax.jit(dense.init)(jax.random.key(0), tokens, positions, segments)
  want = np.asarray(jax.jit(dense.apply)(params, tokens, positions, segments))
  plain = Decoder(ModelConfig(**{**fields, "sparse": "none", "hash_buckets": 0}))
  assert np.abs(np.asarray(jax.jit(plain.apply)(params, tokens, positions, segments))
                - want).max() > 1e-2

  logits, _ = under_zigzag(fields, params, (tokens, positions, segments))
  np.testing.assert_allclose(logits, want, **F32_TOL)
