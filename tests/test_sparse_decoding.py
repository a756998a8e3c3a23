"""Sampling with a run-time mask (`model.sparse`: hash, qk_drop, sparsek): greedy decoding
over the KV cache sharded along the ring gives, at every decoded position, the logits of the
whole row's dense forward with the same mask (the row: the cache's capacity)."""

import dataclasses
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sample import _float32, tokenizer  # noqa: F401  (a fixture)

import parallelism
from model import Decoder
from trainer.core.training import model_config
from trainer.tools import sampling

_F32_TOL = dict(rtol=1e-5, atol=1e-5)
PROMPT, NEW_TOKENS = 29, 5
# Both layouts hold it; not a multiple of QK-dropping's 64-position chunk, so its last
# (here only) chunk is a short one, whose kept count depends on the row's length.
CAPACITY = 40
# Hash attention in local:global layers: the local layer's step reads the codes of the
# window's slots only (6 < a device's 10 slots), the global layer's those of every slot.
MASKS = {"hash": {"model.sparse": "hash", "model.hash_buckets": 4, "model.window": 6,
                  "model.layer_pattern": "LG"},
         "qk_drop": {"model.sparse": "qk_drop", "model.qk_drop_rate": 0.3},
         "sparsek": {"model.sparse": "sparsek", "model.sparsek_k": 4,
                     "model.sparsek_window": 3}}


def _params(config):
  """Random weights (numpy, drawn by shape: no init to compile), norm scales 1; SparseK's
  scorer wider, so that scores spread over a few units: some keys weigh 0, some 1, some in
  between."""
  model = Decoder(dataclasses.replace(model_config(config), attention="dense"))
  tokens_BS = jnp.zeros((1, 8), jnp.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens_BS, jnp.arange(8)[None],
                          jnp.ones_like(tokens_BS))["params"]
  rng = np.random.default_rng(1)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return np.ones(leaf.shape, np.float32)
    return rng.normal(0.0, 0.4 if "sparsek_score" in name else 0.02, leaf.shape).astype(
        np.float32)

  return jax.tree.map_with_path(draw, nn.meta.unbox(shapes))


def _dense_forward(model_cfg, params, row):
  """The reference: logits [C, V] of the row through dense attention with the mask, on one
  device, no cache."""
  model = Decoder(dataclasses.replace(model_cfg, attention="dense"))
  return jax.jit(model.apply)({"params": params}, row[None], np.arange(len(row))[None],
                              np.ones_like(row)[None])[0]


# Hash attention and QK-dropping decode over the dense model's cache (the ring's order,
# sharded over the 4 sequence devices: each slot written where it lies, the softmax merged
# across them), SparseK over zigzag's, where a slot's order is not its position's: its
# threshold reads the gathered scores back in position order, and its and the codes' slots
# are written and read through the same layout tables. (A dense sampler costs ~3.5 CPU-s to
# compile, a zigzag one ~7: every mask in both would double the test's time.)
@pytest.mark.parametrize("mask,attention", [("hash", "dense"), ("qk_drop", "dense"),
                                            ("sparsek", "zigzag")])
def test_decoding_gives_the_dense_masked_logits(tiny_config, tokenizer, mask,  # noqa: F811
                                                attention):
  """Greedy decoding's logits at each new position are those of the dense forward of the
  whole row (the cache's capacity: QK-dropping's codes depend on it) of the prompt plus the
  tokens chosen, at that position."""
  config = _float32(tiny_config(attention, **MASKS[mask]))
  params = _params(config)
  sampler = sampling.Sampler(config, parallelism.make_mesh(config.mesh), params, tokenizer)
  prompt = [int(i) for i in np.random.default_rng(PROMPT).integers(4, 500, PROMPT)]
  logits = []
  ours, _ = sampler.generate(prompt, NEW_TOKENS, capacity=CAPACITY, ignore_eos=True,
                             on_logits=logits.append)
  row = np.zeros(CAPACITY, np.int32)
  row[:PROMPT + NEW_TOKENS] = prompt + ours
  want = _dense_forward(sampler.model_cfg, params, row)[PROMPT - 1:PROMPT - 1 + NEW_TOKENS]
  np.testing.assert_allclose(np.stack(logits), np.asarray(want), **_F32_TOL)
  assert ours == [int(i) for i in np.argmax(np.asarray(want)[:, :tokenizer.vocab_size], -1)]


def test_the_words_say_every_mask_decodes():
  """configs/base.py's comments said "no decoding" of each mask and the manual's SparseK
  section "not built yet: decoding", beside the test above that decodes them (issue #57)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "configs", "base.py")) as f:
    assert "no decoding" not in f.read().lower()
  with open(os.path.join(root, "docs", "masks.md")) as f:
    manual = " ".join(f.read().split())
  assert not [s for s in re.findall(r"not built yet[^.]*", manual, re.I) if "decoding" in s]
