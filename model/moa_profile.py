"""MoA's attention-influence profile: how much the loss depends on each attention value.

MoA (Fu et al. 2024; thu-nics/MoA `MoA/models/llama/modify_llama_profile.py`,
`LlamaModel_get_attention_matrix_log`) scores the (query i, key j) value A_ij of each head by
the first-order change of the loss when that value is masked and the row renormalised:
masking sets A_ij to 0 and scales the rest of row i by 1 / (1 - A_ij), so with G = dL/dA

    dL_ij = A_ij * (sum_k A_ik G_ik - G_ij) / (1 - A_ij),

a row's only key (a document's first token) giving -A_ij G_ij; MoA keeps |dL_ij|, summed over
the calibration rows. An elastic span of w keys drops the pairs at distance i - j >= w, so
what the rules need of a head is the influence summed per distance: a [heads, length]
histogram per layer, whose suffix sums are the influence each span loses. G needs only the
gradient at the attention's output (dL/dO_i . v_j), so one backward pass serves every layer,
and the [queries, keys] matrices are formed `chunk` queries at a time, never whole.

The model is profiled with full causal attention (as MoA profiles the dense model) by its own
blocks and the run's attention (a ring's layout too), one block at a time, so each layer's
roped q, k, v and output gradient can be read.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.decoder import Block
from model.layers import RMSNorm, constrain
from model.loss import chunked_token_scores
from model.rope import apply_rope, frequencies

_CAPTURED = ("query", "key", "value")
_ACTIVATION_BSE = ("activation_batch", "activation_seq", "activation_embed")  # The decoder's.


def pair_effects(q_BCHD, k_BSKD, v_BSKD, dout_BCHD, visible_BCS, softcap: float = 0.0):
  """MoA's signed effect [B, H, C, S] of masking each (query, key) value for C queries
  against S keys (`visible_BCS` says which pairs attention sees), from roped q, k, v and the
  loss gradient at the attention's output; 0 where a pair is not seen."""
  groups = q_BCHD.shape[2] // k_BSKD.shape[2]
  k_BSHD, v_BSHD = (jnp.repeat(x, groups, axis=2).astype(jnp.float32) for x in (k_BSKD, v_BSKD))
  scores_BHCS = jnp.einsum("bchd,bshd->bhcs", q_BCHD.astype(jnp.float32), k_BSHD)
  scores_BHCS *= q_BCHD.shape[-1] ** -0.5
  if softcap:
    scores_BHCS = softcap * jnp.tanh(scores_BHCS / softcap)
  seen_B1CS = visible_BCS[:, None]
  probs_BHCS = jax.nn.softmax(jnp.where(seen_B1CS, scores_BHCS, -jnp.inf), axis=-1)
  probs_BHCS = jnp.where(seen_B1CS, probs_BHCS, 0.0)  # A query that sees nothing: no NaN.
  grad_BHCS = jnp.einsum("bchd,bshd->bhcs", dout_BCHD.astype(jnp.float32), v_BSHD)
  expected_BHC1 = jnp.sum(probs_BHCS * grad_BHCS, axis=-1, keepdims=True)
  # MoA's guard against 1 - A = 0 (a row's only key): that row takes -A G instead.
  eps = jnp.finfo(jnp.float32).eps
  effect = probs_BHCS * (expected_BHC1 - grad_BHCS) / (eps + 1.0 - probs_BHCS)
  alone_B11C1 = (jnp.sum(visible_BCS, axis=-1) == 1)[:, None, :, None]
  return jnp.where(alone_B11C1, -probs_BHCS * grad_BHCS, effect)


def influence_by_distance(q_BSHD, k_BSKD, v_BSKD, dout_BSHD, segment_ids_BS, index_BS,
                          chunk: int, softcap: float = 0.0) -> jax.Array:
  """[H, N]: |MoA effect| summed over rows and queries, per distance d = i - j of key j
  behind query i (causal pairs of one document), computed `chunk` queries at a time. The row
  may be in any layout's order: `index_BS` is each token's original place, as the ring's
  layouts keep it (`token_index`), so the distance and the causal rule are the original's."""
  batch, seq, heads, _ = q_BSHD.shape
  if seq % chunk:
    raise ValueError(f"a profile's query chunk ({chunk}) must divide its length ({seq})")

  def one_chunk(start, total_HS):
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start * chunk, chunk, axis=1)
    behind_BCS = take(index_BS)[:, :, None] - index_BS[:, None, :]
    visible_BCS = (behind_BCS >= 0) & (
        take(segment_ids_BS)[:, :, None] == segment_ids_BS[:, None, :])
    effect_BHCS = pair_effects(take(q_BSHD), k_BSKD, v_BSKD, take(dout_BSHD), visible_BCS,
                               softcap)
    # Unseen pairs hold 0, so sending every key ahead of its query to distance 0 adds nothing.
    distance_BCS = jnp.maximum(behind_BCS, 0)
    summed_HX = jnp.moveaxis(jnp.abs(effect_BHCS), 1, 0).reshape(heads, -1)
    return total_HS.at[:, distance_BCS.reshape(-1)].add(summed_HX)

  return jax.lax.fori_loop(0, seq // chunk, one_chunk, jnp.zeros((heads, seq), jnp.float32))


def all_global(cfg: ModelConfig) -> ModelConfig:
  """`cfg` with full causal attention in every layer, what MoA profiles: no window, layer
  pattern or span plan (a run trained with them is profiled as its causal model), no remat.
  Its layout and kernel stay the run's, so a row that trains on its ring profiles on it."""
  return dataclasses.replace(cfg, window=0, layer_pattern="", head_spans="", sink_tokens=0,
                             local_rope_theta=0.0, remat="none")


def _interceptor(cfg: ModelConfig, positions_BS, dout_BSHD, captured: dict):
  """Reads the attention's q, k, v projections (roped here, as a global layer ropes them)
  and adds `dout_BSHD` (zeros: its gradient is dL/dO) to the output projection's input."""
  inv_freq_F, factor = frequencies(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if module.parent is None or getattr(module.parent, "name", None) != "attention":
      return next_fun(*args, **kwargs)
    if module.name == "out":
      return next_fun(args[0] + dout_BSHD.astype(args[0].dtype), *args[1:], **kwargs)
    out = next_fun(*args, **kwargs)
    if module.name in _CAPTURED:
      captured[module.name] = out if module.name == "value" else apply_rope(
          out, positions_BS, inv_freq_F, factor)
    return out

  return intercept


def _loss_and_captures(cfg: ModelConfig, params: dict, douts, batch: dict):
  """(the masked mean token loss, each layer's captured q, k, v) of the model's own blocks
  run one at a time; `douts` ([L] zeros like each layer's attention output) is where the
  loss's gradient at every attention output is read."""
  # As the decoder embeds: the table's `embed` shards gathered before the lookup.
  table_VE = constrain(params["embedding"].astype(cfg.dtype), ("vocab", None))
  x_BSE = constrain(jnp.take(table_VE, batch["tokens"], axis=0), _ACTIVATION_BSE)
  captures = []
  for layer in range(cfg.num_layers):
    captured = {}
    layer_params = jax.tree.map(lambda p, layer=layer: p[layer], params["blocks"])
    with nn.intercept_methods(_interceptor(cfg, batch["positions"], douts[layer], captured)):
      x_BSE, _ = Block(cfg).apply({"params": layer_params}, x_BSE, batch["positions"],
                                  batch["segment_ids"])
    captures.append(captured)
  x_BSE = RMSNorm(cfg).apply({"params": params["final_norm"]}, x_BSE)
  head_EV = params["embedding"].T if cfg.tie_embeddings else params["lm_head"]["kernel"]
  losses_BS = chunked_token_scores(x_BSE, head_EV, batch["targets"], cfg.loss_chunk)["loss"]
  mask_BS = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(losses_BS * mask_BS) / jnp.maximum(jnp.sum(mask_BS), 1.0), captures


def profile_batch(cfg: ModelConfig, params: dict, batch: dict, chunk: int):
  """(mean loss, [L, H, S] influence per layer, head and distance) of one batch of rows in
  `cfg`'s layout (with its `token_index`); `cfg` as `all_global` makes it. Jit it with `cfg`
  and `chunk` static."""
  batch_size, seq = batch["tokens"].shape
  douts = jnp.zeros((cfg.num_layers, batch_size, seq, cfg.num_heads, cfg.head_size),
                    jnp.float32)
  (loss, captures), grads = jax.value_and_grad(
      lambda d: _loss_and_captures(cfg, params, d, batch), has_aux=True)(douts)
  per_layer = [influence_by_distance(c["query"], c["key"], c["value"], grads[layer],
                                     batch["segment_ids"], batch["token_index"], chunk,
                                     cfg.attention_softcap)
               for layer, c in enumerate(captures)]
  return loss, jnp.stack(per_layer)
