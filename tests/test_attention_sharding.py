"""The ring's shardings come from the rules table, and `save_attention` keeps the ring
forward out of the backward: both read from the compiled HLO on 8 fake CPU devices."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

from configs import base
from model import Decoder, ModelConfig
import parallelism
from parallelism import logical_to_spec
from parallelism.layouts import permute
from parallelism.masks import Mask
from parallelism.ring_attention import KV_NAMES, Q_NAMES, SEGMENT_NAMES, ring_attention

_DEFAULT_RULES = base.get_config().mesh.rules
# Heads not over `tensor`, batch over `data` only.
_OTHER_RULES = tuple((name, {"activation_batch": "data", "activation_heads": None,
                             "activation_kv_heads": None}.get(name, target))
                     for name, target in _DEFAULT_RULES)
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")


def _mesh():
  return jax.make_mesh((1, 2, 2, 1, 2), parallelism.MESH_AXES,
                       axis_types=(AxisType.Auto,) * 5)


def _collectives(hlo: str) -> dict[str, list[str]]:
  """The collective instructions of a compiled module's text, by kind."""
  found = {kind: [] for kind in _COLLECTIVES}
  for line in hlo.splitlines():
    for kind in _COLLECTIVES:
      if re.search(rf"\s{kind}(-start)?\(", line):  # tuple-typed results have spaces
        found[kind].append(line)
  return found


def _attention_step_hlo(rules) -> str:
  """Forward and backward of ring attention with operands laid out by `rules`, as the
  decoder's activations around it are."""
  mesh = _mesh()
  batch, seq_len, heads, kv_heads, head_dim = 4, 64, 4, 2, 16
  sharding = lambda names: NamedSharding(mesh, logical_to_spec(names, rules))
  q = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.float32,
                           sharding=sharding(Q_NAMES))
  kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, head_dim), jnp.float32,
                            sharding=sharding(KV_NAMES))
  seg = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sharding(SEGMENT_NAMES))

  def loss(q, k, v, seg):
    out = ring_attention(q, k, v, Mask.of(segment_ids=seg), layout="striped", mesh=mesh,
                         rules=rules, tile_size=8)
    return jnp.sum(out * out)

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)),
                 out_shardings=(sharding(Q_NAMES), sharding(KV_NAMES), sharding(KV_NAMES)))
  return step.lower(q, kv, kv, seg).compile().as_text()


@pytest.mark.parametrize("rules", [_DEFAULT_RULES, _OTHER_RULES], ids=["default", "other"])
def test_ring_specs_follow_the_rules(rules):
  """Whatever the rules say, attention compiles to the ring's own transfers and nothing
  else: no all-gather or all-to-all re-lays the operands out around the shard_map."""
  found = _collectives(_attention_step_hlo(rules))
  extra = {kind: lines for kind, lines in found.items()
           if lines and kind != "collective-permute"}
  assert not extra, f"collectives beyond the ring's: {extra}"
  # 2 ring devices: the forward's K/V hop, the backward's K/V hop and its dK/dV hop (XLA
  # may merge the two K/V hops: they move the same bytes).
  assert 1 <= len(found["collective-permute"]) <= 3


def test_save_attention_runs_the_ring_forward_once():
  """`full` recomputes the layer in the backward, ring forward included; `save_attention`
  keeps the ring's out and lse, so the backward recomputes only the cheap rest: half the
  ring forwards of `full` (a policy that recomputed the ring too would give as many), counted
  as the ring forward's collective-permutes in the compiled gradient of a local:global model
  (its layers choose their attention in a `lax.cond`, which the saved names pass through).
  Both give the same gradients. (No remat at all is every training test's default.)"""
  mesh = jax.make_mesh((1, 1, 2, 1, 1), parallelism.MESH_AXES,
                       axis_types=(AxisType.Auto,) * 5)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 64)), jnp.int32)
  index = permute(jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (2, 64)), "striped", 2)
  segments = (index >= 25).astype(jnp.int32)  # two documents per row
  forwards, grads, params = {}, {}, None
  for remat in ("save_attention", "full"):
    model = Decoder(ModelConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=96,
                                vocab_size=64, attention="striped", attention_tile=8,
                                window=24, layer_pattern="LG", dtype="float32", remat=remat))
    with jax.set_mesh(mesh), nn.logical_axis_rules(_DEFAULT_RULES):
      if params is None:  # the policy does not change the parameters
        params = jax.jit(model.init)(jax.random.key(0), tokens, index, segments)
      loss = lambda p, tokens: model.apply(p, tokens, index, segments).sum()
      compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
      grads[remat] = compiled(params, tokens)
    permutes = _collectives(compiled.as_text())["collective-permute"]
    forwards[remat] = sum("ring_forward" in line for line in permutes)
  assert forwards["save_attention"] > 0
  assert forwards["full"] == 2 * forwards["save_attention"], forwards
  for got, want in zip(jax.tree.leaves(grads["save_attention"]), jax.tree.leaves(grads["full"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_model_hands_its_rules_to_the_ring(monkeypatch):
  """The decoder's attention passes the rules table its activations are pinned by, so the
  ring's specs and the activations around it cannot disagree."""
  import parallelism
  seen = []

  def spy(*args, **kwargs):
    seen.append(kwargs["rules"])
    return ring_attention(*args, **kwargs)

  monkeypatch.setattr(parallelism, "ring_attention", spy)
  model = Decoder(ModelConfig(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, d_ff=32,
                              vocab_size=16, attention="striped", attention_tile=8,
                              dtype="float32"))
  tokens = jnp.zeros((2, 64), jnp.int32)
  index = permute(jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (2, 64)), "striped", 2)
  mesh = jax.make_mesh((1, 2, 2, 1, 2), parallelism.MESH_AXES,
                       axis_types=(AxisType.Auto,) * 5)
  with jax.set_mesh(mesh), nn.logical_axis_rules(_OTHER_RULES):
    jax.eval_shape(model.init, jax.random.key(0), tokens, index, jnp.zeros_like(index))
  assert seen and all(tuple(rules) == _OTHER_RULES for rules in seen)
