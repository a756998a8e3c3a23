"""The decoder on its own: shapes, dtypes, RoPE relativity, causality, GQA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import Decoder, ModelConfig, dense_attention
from model.decoder import Block
from parallelism.masks import Mask

B, S = 2, 32


def _config(**overrides) -> ModelConfig:
  fields = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96, vocab_size=101,
                dtype="float32")
  return ModelConfig(**{**fields, **overrides})


def _inputs(seed=0, offset=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, 101, (B, S)), jnp.int32)
  index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  return tokens, index + offset, jnp.ones((B, S), jnp.int32)


def _init_apply(cfg, *inputs):
  """The model's apply and its parameters, both jitted (one compile each, where op-by-op
  dispatch compiled every op of the decoder)."""
  model = Decoder(cfg)
  return jax.jit(model.apply), jax.jit(model.init)(jax.random.key(0), *inputs)


def test_shapes_and_dtypes():
  cfg = _config(dtype="bfloat16")
  apply, variables = _init_apply(cfg, *_inputs())
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
  logits = apply(variables, *_inputs())
  assert logits.shape == (B, S, cfg.vocab_size) and logits.dtype == jnp.float32
  # The residual stream and every block's output are computed in bf16.
  x_BSE = jnp.ones((B, S, cfg.d_model), jnp.bfloat16)
  block_vars = jax.jit(Block(cfg).init)(jax.random.key(1), x_BSE, *_inputs()[1:])
  out_BSE, _ = jax.jit(Block(cfg).apply)(block_vars, x_BSE, *_inputs()[1:])
  assert out_BSE.dtype == jnp.bfloat16


def test_every_parameter_has_logical_axis_names():
  import flax.linen as nn
  boxed = jax.eval_shape(Decoder(_config(tie_embeddings=True)).init, jax.random.key(0),
                         *_inputs())["params"]
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert leaves and all(isinstance(leaf, nn.Partitioned) for leaf in leaves)
  assert all(len(leaf.names) == leaf.value.ndim for leaf in leaves)


def test_rope_depends_only_on_relative_position():
  cfg = _config()
  apply, variables = _init_apply(cfg, *_inputs())
  base = apply(variables, *_inputs())
  shifted = apply(variables, *_inputs(offset=7))
  # Angles are position * frequency in float32: a shift of 7 changes them by rounding only.
  np.testing.assert_allclose(shifted, base, atol=2e-5, rtol=1e-5)


def test_changing_a_future_token_never_changes_earlier_logits():
  cfg = _config()
  tokens, positions, segments = _inputs()
  apply, variables = _init_apply(cfg, tokens, positions, segments)
  base = apply(variables, tokens, positions, segments)
  t = 20
  changed = apply(variables, tokens.at[:, t].set((tokens[:, t] + 1) % 101), positions,
                  segments)
  np.testing.assert_array_equal(changed[:, :t], base[:, :t])
  assert not np.allclose(changed[:, t:], base[:, t:])


# Jitted: one compile per group, where op-by-op dispatch compiled each op.
@jax.jit
def _gqa_and_multihead(q, k, v, segments):
  groups = q.shape[2] // k.shape[2]
  mask = Mask.of(segment_ids=segments)
  return dense_attention(q, k, v, mask), dense_attention(
      q, jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2), mask)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gqa_equals_multihead_with_repeated_kv(groups):
  rng = np.random.default_rng(groups)
  heads, kv_heads, dim = 4, 4 // groups, 16
  q = jnp.asarray(rng.normal(size=(B, S, heads, dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, S, kv_heads, dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, S, kv_heads, dim)), jnp.float32)
  segments = jnp.asarray(np.repeat([[1, 2]], S // 2, axis=1), jnp.int32).repeat(B, 0)
  gqa, mha = _gqa_and_multihead(q, k, v, segments)
  np.testing.assert_allclose(gqa, mha, atol=1e-6, rtol=1e-6)


def test_packed_documents_do_not_see_each_other():
  cfg = _config()
  tokens, positions, _ = _inputs()
  segments = jnp.where(positions < 12, 1, 2)
  apply, variables = _init_apply(cfg, tokens, positions, segments)
  base = apply(variables, tokens, positions, segments)
  changed = apply(variables, tokens.at[:, 3].set((tokens[:, 3] + 1) % 101), positions,
                  segments)
  np.testing.assert_array_equal(changed[:, 12:], base[:, 12:])


@pytest.mark.parametrize("attention, remat, strategy, mesh_shape, ulysses", [
    ("striped", "save_attention", "ring", (1, 2, 4, 1), 1),
    ("zigzag", "full", "hybrid", (1, 1, 4, 1), 2),
    ("ring", "offload", "allgather", (2, 1, 2, 2), 1),
])
def test_the_init_gives_the_parameters_of_the_model_that_trains(attention, remat, strategy,
                                                                  mesh_shape, ulysses):
  """`init_state` inits a dense, remat-free model on a few tokens (trainer/core/state.py); the
  parameters equal, bit for bit and sharding for sharding, those of the model's own init
  on a whole training batch."""
  import importlib

  import flax.linen as nn

  import parallelism
  from trainer.core.optimizer import make_optimizer
  from trainer.core.state import abstract_state, init_state, shardings_of
  from trainer.core.training import model_config

  config = importlib.import_module("configs.tiny_cpu").get_config(attention)
  config.train.remat, config.model.sequence_parallel = remat, strategy
  config.mesh.data, config.mesh.fsdp, config.mesh.sequence, config.mesh.tensor = mesh_shape
  config.mesh.ulysses = ulysses
  model, optimizer = Decoder(model_config(config)), make_optimizer(config.train)
  mesh = parallelism.make_mesh(config.mesh)
  rows, seq_len = config.train.batch_size, config.data.seq_len
  index = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (rows, seq_len))
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    shardings = shardings_of(abstract_state(model, optimizer, mesh, config.mesh.rules))
    params = init_state(model, optimizer, shardings, seed=3).params
    trained_init = jax.jit(lambda rng: nn.meta.unbox(model.init(
        rng, jnp.zeros_like(index), index, jnp.ones_like(index))["params"]),
                           out_shardings=shardings.params)(jax.random.key(3))
  assert jax.tree.structure(params) == jax.tree.structure(trained_init)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(trained_init)):
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
