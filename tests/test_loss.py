"""Chunked cross-entropy: the losses, hits and gradients of the whole logits, without them.

What it saves, the float32 copies of a device's logits at a wide vocabulary, is a memory
target: `python scripts/bench_memory.py --loss_chunking` (results/bench_memory.jsonl)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallelism
from model import Decoder, ModelConfig
from model.loss import chunk_length
from trainer.core.optimizer import make_optimizer
from trainer.core.state import abstract_state, init_state, shardings_of

RULES = (("layers", None), ("embed", ("fsdp", "sequence")), ("vocab", "tensor"),
         ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("head_dim", None),
         ("norm", None), ("activation_batch", ("data", "fsdp")), ("activation_seq", "sequence"),
         ("activation_embed", None), ("activation_heads", "tensor"),
         ("activation_kv_heads", "tensor"), ("activation_mlp", "tensor"),
         ("activation_vocab", "tensor"))


def test_chunk_length_divides_the_local_sequence():
  assert [chunk_length(64, c) for c in (16, 24, 64, 4096, 1)] == [16, 16, 64, 64, 1]


@pytest.mark.parametrize("tie, mesh_shape, chunk", [
    (False, (1, 2, 2, 2), 24),  # 64 local tokens in 4 chunks of 16; vocabulary over `tensor`.
    (True, (1, 1, 4, 2), 8),  # Tied head; four chunks per device.
    (False, (2, 1, 4, 1), 4096),  # One chunk: the whole local sequence.
])
def test_chunked_scores_and_gradients_equal_the_full_logits(tie, mesh_shape, chunk):
  # float32 compute: the two differ only by float32 rounding (summation order).
  cfg = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
                    vocab_size=256, tie_embeddings=tie, dtype="float32", loss_chunk=chunk)
  batch, seq_len = 4, 128
  mesh = parallelism.make_mesh(dict(zip(("data", "fsdp", "sequence", "tensor"), mesh_shape)))
  model = Decoder(cfg)
  rng = np.random.default_rng(0)
  tokens, targets = (jnp.asarray(rng.integers(0, 256, (batch, seq_len)), jnp.int32)
                     for _ in range(2))
  index = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
  segments = jnp.ones((batch, seq_len), jnp.int32)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    optimizer = _optimizer()
    state = init_state(model, optimizer,
                       shardings_of(abstract_state(model, optimizer, mesh, RULES)), 0)

    def full(params):
      logits = model.apply({"params": params}, tokens, index, segments)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
      return jnp.mean(losses), (losses, jnp.argmax(logits, -1) == targets)

    def chunked(params):
      scores = model.apply({"params": params}, tokens, index, segments, targets, True)
      return jnp.mean(scores["loss"]), (scores["loss"], scores["correct"])

    # One program for the two: one compile, not two (a fifth of each case's CPU).
    both = jax.jit(lambda params: (jax.value_and_grad(full, has_aux=True)(params),
                                   jax.value_and_grad(chunked, has_aux=True)(params)))
    ((_, (want, want_hits)), want_grads), ((_, (got, got_hits)), got_grads) = both(state.params)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
  np.testing.assert_array_equal(got_hits, want_hits)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                          jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _optimizer():
  import ml_collections
  return make_optimizer(ml_collections.ConfigDict({
      "grad_clip": 1.0, "lr": 1e-3, "b1": 0.9, "b2": 0.95, "weight_decay": 0.1,
      "warmup_steps": 1, "steps": 2, "schedule_steps": 0, "min_lr_ratio": 0.1}))
