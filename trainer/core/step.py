"""The pure train and eval steps: (state, batch) -> (state, metrics). Jitted by the loop."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import data
from model import Decoder
from trainer.core import xla_options
from trainer.core.state import TrainState


def _token_scores(model: Decoder, params, batch: dict[str, jax.Array],
                  predictions: bool = False) -> dict[str, jax.Array]:
  """Per-token float32 losses (and argmax hits), in sequence chunks: never the whole logits."""
  return model.apply({"params": params}, batch["tokens"], batch["positions"],
                     batch["segment_ids"], batch["targets"], predictions)


def _micro_batches(batch: dict[str, jax.Array], count: int) -> dict[str, jax.Array]:
  """[B, S] -> [count, B // count, S], micro-batch i holding rows i, i + count, ...

  Strided rather than contiguous rows so that each micro-batch spreads over every batch
  shard of the mesh (rows are sharded in contiguous runs) instead of sitting on a few.
  """
  def split(x_BS):
    x_MbS = x_BS.reshape(x_BS.shape[0] // count, count, *x_BS.shape[1:]).swapaxes(0, 1)
    return nn.with_logical_constraint(x_MbS, (None, "activation_batch", "activation_seq"))

  return jax.tree.map(split, batch)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, model: Decoder,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               micro_batches: int = 1) -> tuple[TrainState, dict[str, jax.Array]]:
  """One AdamW update on the masked mean token loss of the batch.

  With `micro_batches` > 1 the gradient is accumulated over that many slices of the batch
  (a `lax.scan`, so activations of one slice are live at a time) and normalised by the
  whole batch's token count: the update equals one step on the whole batch.
  """
  mask_BS = batch["loss_mask"].astype(jnp.float32)
  num_tokens = jnp.maximum(jnp.sum(mask_BS), 1.0)

  def loss_sum_fn(params, part):
    losses_BS = _token_scores(model, params, part)["loss"]
    return jnp.sum(losses_BS * part["loss_mask"].astype(jnp.float32)) / num_tokens

  if micro_batches == 1:
    loss, grads = jax.value_and_grad(loss_sum_fn)(state.params, batch)
  else:
    def accumulate(carry, part):
      loss_part, grads_part = jax.value_and_grad(loss_sum_fn)(state.params, part)
      return jax.tree.map(jnp.add, carry, (loss_part, grads_part)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, _micro_batches(batch, micro_batches))
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  # A NaN/Inf loss or gradient leaves parameters and optimizer state untouched, so no
  # non-finite value ever reaches the state (or a checkpoint); the host decides what next.
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep_old = lambda new, old: jnp.where(finite, new, old)
  new_state = TrainState(
      step=state.step + 1,
      params=jax.tree.map(keep_old, optax.apply_updates(state.params, updates), state.params),
      opt_state=jax.tree.map(keep_old, opt_state, state.opt_state))
  metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(_schedule_count(state.opt_state)),
             "loss_tokens": jnp.sum(mask_BS), "finite": finite}
  return new_state, metrics


def _schedule_count(opt_state) -> jax.Array:
  """The update count AdamW's learning-rate schedule reads: it does not advance on a skipped
  (non-finite) step, so after a skip it trails `state.step`, and the lr logged is the one
  applied."""
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
  counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
  return counts[0]


def jit_train_step(model: Decoder, optimizer: optax.GradientTransformation,
                   schedule: optax.Schedule, micro_batches: int, state_shardings: TrainState,
                   batch_sharding: jax.sharding.Sharding):
  """The train step jitted once: sharded in and out, the old state donated to the new;
  compiled with the XLA options of JAX's backend (`xla_options`: on GPUs, the ring's
  transfers overlap its kernels)."""
  return jax.jit(
      functools.partial(train_step, model=model, optimizer=optimizer, schedule=schedule,
                        micro_batches=micro_batches),
      in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None),
      donate_argnums=0, compiler_options=xla_options.for_platform(jax.default_backend()))


def eval_step(params, batch: dict[str, jax.Array], *, model: Decoder,
              evaluator: data.Evaluator | None = None) -> dict[str, jax.Array]:
  """Sums (not means) so that batches of an eval add up exactly; plus the dataset's own."""
  mask_BS = batch["loss_mask"].astype(jnp.float32)
  scores = _token_scores(model, params, batch, predictions=evaluator is not None)
  sums = {"loss_sum": jnp.sum(scores["loss"] * mask_BS), "tokens": jnp.sum(mask_BS)}
  if evaluator is not None:
    sums.update(evaluator.sums(scores["correct"], batch))
  return sums
