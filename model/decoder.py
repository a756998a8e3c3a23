"""The LLaMA-style decoder: embedding, scanned pre-norm blocks, final norm, logits."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import parallelism
from model.attention import Attention, LayerInputs
from model.config import LOCAL, ModelConfig
from model.hashing import projections
from model.layers import RMSNorm, SwiGLU, constrain, projection_kernel
from model.loss import chunked_token_scores

_ACTIVATION_BSE = ("activation_batch", "activation_seq", "activation_embed")
BLOCK_INPUT = "block_input"


class Block(nn.Module):
  """One pre-norm residual block; shaped (carry, broadcast...) -> (carry, None) for nn.scan."""

  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BSE, positions_BS, segment_ids_BS, layer: LayerInputs = LayerInputs()):
    cfg = self.cfg
    x_BSE = checkpoint_name(x_BSE, BLOCK_INPUT)  # What remat 'offload' keeps in host memory.
    h_BSE = RMSNorm(cfg, name="attention_norm")(x_BSE)
    x_BSE = x_BSE + Attention(cfg, self.decode, name="attention")(
        h_BSE, positions_BS, segment_ids_BS, layer)
    h_BSE = RMSNorm(cfg, name="mlp_norm")(x_BSE)
    x_BSE = constrain(x_BSE + SwiGLU(cfg, name="mlp")(h_BSE), _ACTIVATION_BSE)
    return x_BSE, None


def _layer_inputs(cfg: ModelConfig) -> LayerInputs:
  """Every layer's `LayerInputs`, stacked for the scan, so the stack stays one scan whatever
  the pattern: which layers are local (`ModelConfig.layer_pattern`) and, with a span plan
  whose spans differ, each layer's per-head spans; with hash attention each layer's fixed
  projections (model/hashing.py), with QK-dropping its index (its drop pattern's seed,
  model/dropping.py); None where the model has none."""
  return LayerInputs(
      local=jnp.asarray([kind == LOCAL for kind in cfg.layer_kinds]),
      spans_H=None if cfg.narrowest_span is None else jnp.asarray(cfg.spans, jnp.int32),
      hash_KDR=None if not cfg.hashed else jnp.asarray(projections(
          cfg.num_layers, cfg.num_kv_heads, cfg.head_size, cfg.hash_buckets)),
      index=jnp.arange(cfg.num_layers, dtype=jnp.int32) if cfg.dropped else None)


def _remat_policy(name: str):
  return {
      "full": None,  # Save nothing; recompute the whole block in the backward pass.
      "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
      # The attention output and the ring's lse: all its backward needs besides q, k, v,
      # which the block recomputes with its projections, not with another ring pass.
      "save_attention": jax.checkpoint_policies.save_only_these_names(
          *parallelism.SAVED_NAMES),
      # Each block's input goes to pinned host memory in the forward and comes back for the
      # backward, which recomputes the rest of the block: 'full' without the device memory
      # of the layer inputs, at the price of host transfers.
      "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
          names_which_can_be_saved=[], names_which_can_be_offloaded=[BLOCK_INPUT],
          offload_src="device", offload_dst="pinned_host"),
  }[name]


class _Kernel(nn.Module):
  """A Projection's kernel alone (same path `<name>/kernel`, same init), in the parameter
  dtype, for the loss that applies the output projection one sequence chunk at a time."""

  cfg: ModelConfig
  shape: tuple[int, ...]
  names: tuple[str, ...]

  @nn.compact
  def __call__(self) -> jax.Array:
    return projection_kernel(self, self.cfg, self.shape, self.names)


class Decoder(nn.Module):
  """Maps a batch's `tokens`, `positions`, `segment_ids` to float32 logits,
  or, given `targets`, to per-token losses (and with `predictions` whether each argmax is
  its target) computed in sequence chunks without the whole logits (model/loss.py).

  The blocks are one `nn.scan` so compile time does not grow with depth (local and global
  layers too: each layer's kind is scanned with it); parameters of the
  stack gain a leading `layers` axis (and so does the `cache` collection of sampling).

  For sampling (trainer/tools/sampling.py): `logits_at_B` returns the logits of one position per row
  only ([B, 1, V], the slot of the prompt's last token); with the `cache` collection mutable
  the call is a prefill that keeps every layer's keys and values; `decode=True` makes the
  call one step of one token per row over that cache.
  """

  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BS, positions_BS, segment_ids_BS, targets_BS=None,
               predictions: bool = False, logits_at_B=None):
    cfg = self.cfg
    param_VE = self.param(
        "embedding", nn.with_logical_partitioning(
            nn.initializers.normal(cfg.init_std), ("vocab", "embed")),
        (cfg.vocab_size, cfg.d_model), jnp.dtype(cfg.param_dtype))
    # Gather the table's `embed` shards before the lookup: a row gather from a table sharded
    # along its width would otherwise be replicated and re-split by the partitioner.
    table_VE = constrain(param_VE.astype(cfg.dtype), ("vocab", None))
    x_BSE = constrain(jnp.take(table_VE, tokens_BS, axis=0), _ACTIVATION_BSE)

    block = Block
    if cfg.remat != "none":
      block = nn.remat(Block, policy=_remat_policy(cfg.remat), prevent_cse=False)
    blocks = nn.scan(
        block, variable_axes={"params": 0, "cache": 0}, split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast, 0), length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"})
    x_BSE, _ = blocks(cfg, self.decode, name="blocks")(
        x_BSE, positions_BS, segment_ids_BS, _layer_inputs(cfg))
    x_BSE = RMSNorm(cfg, name="final_norm")(x_BSE)

    if cfg.tie_embeddings:
      head_EV = param_VE.T
    else:
      head_EV = _Kernel(cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                        name="lm_head")()
    # Whole rows, gathered once: not inside every chunk of the loss's loop.
    head_EV = constrain(head_EV, (None, "vocab"))
    if targets_BS is not None:
      return chunked_token_scores(x_BSE, head_EV, targets_BS, cfg.loss_chunk, predictions)
    logits_names = ("activation_batch", "activation_seq", "activation_vocab")
    if logits_at_B is not None:
      # A masked sum over the sharded sequence (one all-reduce of [B, E]), not a gather
      # that would bring the whole row's hidden states to every device.
      picked_BS = jnp.arange(x_BSE.shape[1])[None, :] == logits_at_B[:, None]
      x_BSE = jnp.sum(jnp.where(picked_BS[:, :, None], x_BSE, 0), axis=1, keepdims=True)
      logits_names = ("activation_batch", None, "activation_vocab")
    logits_BSV = jnp.einsum("bse,ev->bsv", x_BSE, head_EV.astype(cfg.dtype))
    logits_BSV = constrain(logits_BSV, logits_names)
    return logits_BSV.astype(jnp.float32)
