"""The pure train and eval steps: (state, batch) -> (state, metrics). Jitted by the loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from model import Decoder
from trainer.state import TrainState


def _logits(model: Decoder, params, batch: dict[str, jax.Array]) -> jax.Array:
  return model.apply({"params": params}, batch["tokens"], batch["positions"],
                     batch["token_index"], batch["segment_ids"])


def token_losses(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
  """Per-token cross-entropy in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_BSV.astype(jnp.float32),
                                                         targets_BS)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, model: Decoder,
               optimizer: optax.GradientTransformation,
               schedule: optax.Schedule) -> tuple[TrainState, dict[str, jax.Array]]:
  """One AdamW update on the masked mean token loss of the batch."""
  mask_BS = batch["loss_mask"].astype(jnp.float32)
  num_tokens = jnp.maximum(jnp.sum(mask_BS), 1.0)

  def loss_fn(params):
    losses_BS = token_losses(_logits(model, params, batch), batch["targets"])
    return jnp.sum(losses_BS * mask_BS) / num_tokens

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_state = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state)
  metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": schedule(state.step),
             "loss_tokens": jnp.sum(mask_BS)}
  return new_state, metrics


def eval_step(params, batch: dict[str, jax.Array], *, model: Decoder) -> dict[str, jax.Array]:
  """Sums (not means) so that batches of an eval add up exactly."""
  mask_BS = batch["loss_mask"].astype(jnp.float32)
  logits_BSV = _logits(model, params, batch)
  sums = {"loss_sum": jnp.sum(token_losses(logits_BSV, batch["targets"]) * mask_BS),
          "tokens": jnp.sum(mask_BS)}
  if "answer_distance" in batch:
    # Retrieval: an answer token counts when the model's top guess is the right token.
    answer_BS = (batch["answer_distance"] > 0).astype(jnp.float32) * mask_BS
    correct_BS = (jnp.argmax(logits_BSV, -1) == batch["targets"]).astype(jnp.float32)
    sums.update(answers=jnp.sum(answer_BS), answers_correct=jnp.sum(answer_BS * correct_BS))
  return sums
