"""Train state and its sharded initialisation, never materialising an unsharded parameter.

`eval_shape` gives the shapes and logical axis names, the rules table turns names into
mesh shardings, and a jitted init with those `out_shardings` writes each shard in place.

Both trace the init of `_param_model`: the model with dense attention and no remat, on the
smallest batch the mesh shards. A parameter's name, shape and random value depend on the
module tree and the rng only, not on the attention, remat or sequence length (checked bit
for bit in `tests/test_model.py` for ring, all-gather and hybrid runs under three remat
policies), so the init need not trace or compile a ring for a 256k-token forward whose
output it throws away.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import parallelism
from model import Decoder


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: optax.OptState


def _param_model(model: Decoder) -> Decoder:
  return Decoder(dataclasses.replace(model.cfg, attention="dense", remat="none"))


def _param_inputs(mesh) -> tuple[jax.Array, ...]:
  """Zero tokens, trivial positions and one document, one row per batch shard and one token
  per sequence shard."""
  shape = (parallelism.batch_shards(mesh),
           int(np.prod([mesh.shape[axis] for axis in parallelism.SEQUENCE_AXES])))
  index_BS = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
  return jnp.zeros(shape, jnp.int32), index_BS, jnp.ones(shape, jnp.int32)


def abstract_state(model: Decoder, optimizer: optax.GradientTransformation, mesh: Mesh,
                   rules) -> TrainState:
  """Shape, dtype and target sharding of every state leaf, allocating nothing (restores,
  AOT compiles). One trace of the init gives the shapes and the parameters' logical names;
  the rules table turns the names into shardings."""
  # The key and inputs are made inside the trace too: no array is placed on any device, so
  # the mesh may be of devices that are described but not attached (a GPU plan on a CPU).
  boxed = jax.eval_shape(
      lambda: _param_model(model).init(jax.random.key(0), *_param_inputs(mesh)))["params"]
  param_specs = jax.tree.map(
      lambda spec: parallelism.logical_to_spec(spec, rules), nn.get_partition_spec(boxed),
      is_leaf=lambda x: isinstance(x, P))

  def params_and_moments(boxed_params):
    # Unboxed inside a trace: under a mesh, unboxing applies the sharding constraint.
    params = nn.meta.unbox(boxed_params)
    return params, optimizer.init(params)

  params, abstract_opt_state = jax.eval_shape(params_and_moments, boxed)
  # Optimizer moments follow their parameter; counters and the like are replicated.
  opt_specs = optax.tree_map_params(
      optimizer, lambda _, spec: spec, abstract_opt_state, param_specs,
      transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
  shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                      opt_state=abstract_opt_state)
  specs = TrainState(step=P(), params=param_specs, opt_state=opt_specs)
  return jax.tree.map(
      lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
      shapes, specs)


def shardings_of(state: TrainState) -> TrainState:
  """The sharding of every leaf of an abstract (or real) state."""
  return jax.tree.map(lambda leaf: leaf.sharding, state)


def _init(model, optimizer, rng, mesh) -> TrainState:
  params = nn.meta.unbox(_param_model(model).init(rng, *_param_inputs(mesh))["params"])
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def state_from_params(params, optimizer: optax.GradientTransformation,
                      shardings: TrainState) -> TrainState:
  """Step 0's state around given parameters (an import): fresh optimizer moments, sharded."""
  opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)


def jit_init(model: Decoder, optimizer: optax.GradientTransformation, shardings: TrainState):
  """The jitted init: a PRNG key -> step 0's state, each leaf written in its shard."""
  mesh = shardings.step.mesh
  return jax.jit(lambda rng: _init(model, optimizer, rng, mesh), out_shardings=shardings)


def init_state(model: Decoder, optimizer: optax.GradientTransformation, shardings: TrainState,
               seed: int) -> TrainState:
  return jit_init(model, optimizer, shardings)(jax.random.key(seed))


def shard_bytes(leaf) -> int:
  """Bytes of one device's shard (the largest) of a sharded ShapeDtypeStruct."""
  return math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def carry_over_stage(state, optimizer: optax.GradientTransformation, shardings,
                     keep_optimizer: bool):
  """The first state of a stage from the last state of the one before: its parameters, and
  its AdamW moments and their bias-correction count when `keep_optimizer` (the new schedule
  still starts at 0), else fresh moments.

  Consumes `state`'s optimizer state (donated or deleted), so a stage change never holds two
  sets of moments on the devices.
  """
  params = jax.device_put(state.params, shardings.params)
  step = jnp.asarray(state.step, jnp.int32)
  if not keep_optimizer:
    for leaf in jax.tree.leaves(state.opt_state):
      leaf.delete()
    return TrainState(step=step, params=params,
                      opt_state=state_from_params(params, optimizer, shardings).opt_state)
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  kept = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(s)]
  if len(kept) != 1:
    raise ValueError(f"expected one AdamW state in the optimizer state, found {len(kept)}")

  def rebuilt(params, adam):
    # The fresh moments are dead code here: only the schedule's count (0) and the like remain.
    return jax.tree.map(lambda s: adam if is_adam(s) else s, optimizer.init(params),
                        is_leaf=is_adam)

  opt_state = jax.jit(rebuilt, out_shardings=shardings.opt_state, donate_argnums=1)(
      params, kept[0])
  return TrainState(step=step, params=params, opt_state=opt_state)
