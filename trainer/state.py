"""Train state and its sharded initialisation, never materialising an unsharded parameter.

`eval_shape` gives the shapes and logical axis names, the rules table turns names into
mesh shardings, and a jitted init with those `out_shardings` writes each shard in place.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import parallelism
from model import Decoder


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: optax.OptState


def dummy_inputs(batch: int, seq_len: int) -> tuple[jax.Array, ...]:
  """Zero tokens and trivial indices of the right shapes, for init and eval_shape."""
  tokens_BS = jnp.zeros((batch, seq_len), jnp.int32)
  index_BS = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
  return tokens_BS, index_BS, index_BS, jnp.ones((batch, seq_len), jnp.int32)


def state_shardings(model: Decoder, optimizer: optax.GradientTransformation, mesh: Mesh,
                    rules, batch: int, seq_len: int) -> TrainState:
  """NamedShardings of every leaf of the train state, from the parameters' logical names."""
  boxed = jax.eval_shape(model.init, jax.random.key(0), *dummy_inputs(batch, seq_len))["params"]
  param_specs = jax.tree.map(
      lambda spec: parallelism.logical_to_spec(spec, rules), nn.get_partition_spec(boxed),
      is_leaf=lambda x: isinstance(x, P))
  abstract_opt_state = jax.eval_shape(lambda p: optimizer.init(nn.meta.unbox(p)), boxed)
  # Optimizer moments follow their parameter; counters and the like are replicated.
  opt_specs = optax.tree_map_params(
      optimizer, lambda _, spec: spec, abstract_opt_state, param_specs,
      transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
  specs = TrainState(step=P(), params=param_specs, opt_state=opt_specs)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))


def abstract_state(model: Decoder, optimizer: optax.GradientTransformation,
                   shardings: TrainState, batch: int, seq_len: int) -> TrainState:
  """Shapes, dtypes and target shardings of the state, allocating nothing (for restores)."""
  shapes = jax.eval_shape(
      lambda rng: _init(model, optimizer, rng, batch, seq_len), jax.random.key(0))
  return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                               sharding=sharding),
                      shapes, shardings)


def _init(model, optimizer, rng, batch, seq_len) -> TrainState:
  params = nn.meta.unbox(model.init(rng, *dummy_inputs(batch, seq_len))["params"])
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def init_state(model: Decoder, optimizer: optax.GradientTransformation, shardings: TrainState,
               seed: int, batch: int, seq_len: int) -> TrainState:
  return jax.jit(lambda rng: _init(model, optimizer, rng, batch, seq_len),
                 out_shardings=shardings)(jax.random.key(seed))
