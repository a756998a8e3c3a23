"""Grouped-query self-attention and its dispatch by `ModelConfig.attention`.

Every layout shares one rule: query i may see key j iff j's original position is not after
i's and their segment ids match; in a local layer (`ModelConfig.layer_pattern`) also fewer
than `window` positions before it (`parallelism.tiles`). `dense` applies it to the whole
row in its original order: on a CUDA GPU by cuDNN's flash attention, elsewhere as a masked
softmax; `ring`, `striped` and `zigzag` hand q, k, v and the segment ids to
`parallelism.ring_attention` with the layout's name, whose static schedule knows every
token's original position without reading an index. With hash attention (`model.sparse`)
a query also sees only keys of its bucket (model/hashing.py), with QK-dropping only kept keys
and only if kept itself (model/dropping.py), in every layout alike: both as run-time codes.
With SparseK a learned score per key and a threshold per query weigh each key by a soft top-k
mask beside a window (model/sparsek.py): the scores travel with K/V, trained end to end.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import parallelism
from model.config import GLOBAL, LOCAL, ModelConfig
from model.dropping import codes_at, drop_codes, layout_shards
from model.hashing import bucket_codes
from model.layers import Projection, constrain
from model.sparsek import Scorer, decode_thresholds, thresholds
from model.rope import RopeScaling, apply_rope, frequencies


def dense_attention(q_BSHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                    segment_ids_BS: jax.Array, window: int | None = None,
                    softcap: float = 0.0, spans_H: jax.Array | None = None,
                    positions_BS: jax.Array | None = None, sink_tokens: int = 0,
                    q_codes_BSH: jax.Array | None = None,
                    k_codes_BSK: jax.Array | None = None,
                    sparsek: tuple | None = None) -> jax.Array:
  """Masked softmax attention over the whole row, in its original order (a token's index
  is its place), each query seeing the `window` keys up to itself (None: all before it; with
  per-head spans `spans_H` [Hq], query head h sees `spans_H[h]`) and, with `sink_tokens` k,
  every earlier key of its document at a position below k (`parallelism.sinks`), logits
  capped at `softcap` (0: not); K/V heads are shared by query groups. With bucket codes
  (hash attention: `q_codes_BSH` [B,S,Hq], `k_codes_BSK` [B,S,Hkv]) query head h also sees
  only keys whose code of its kv head equals its own. With `sparsek` (thresholds [B,S,Hq],
  scores [B,S,Hkv], window), key j weighs clip(score_j - threshold_i, 0, 1) unless fewer than
  window positions back (model/sparsek.py): log of it is added to the logits.

  Scores and softmax are float32. A query that sees no key gets zeros, not NaN.
  """
  batch, seq, num_heads, head_dim = q_BSHD.shape
  token_index_BS = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  num_kv_heads = k_BSKD.shape[2]
  q_BSKGD = q_BSHD.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores_BKGST = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BSKD,
                            preferred_element_type=jnp.float32) / jnp.sqrt(head_dim)
  if softcap:
    scores_BKGST = softcap * jnp.tanh(scores_BKGST / softcap)
  same_BST = segment_ids_BS[:, None, :] == segment_ids_BS[:, :, None]
  visible_BST = parallelism.visible(token_index_BS[:, :, None], token_index_BS[:, None, :],
                                    window)
  visible_B11ST = visible_BST[:, None, None]
  if spans_H is not None:
    behind_ST = token_index_BS[0][:, None] - token_index_BS[0][None, :]
    spans_KG11 = spans_H.reshape(num_kv_heads, -1)[:, :, None, None]
    visible_B11ST = visible_B11ST & (behind_ST < spans_KG11)[None]
  if sink_tokens:
    sink_BST = (token_index_BS[:, :, None] >= token_index_BS[:, None, :]) & (
        positions_BS[:, None, :] < sink_tokens)
    visible_B11ST = visible_B11ST | sink_BST[:, None, None]
  visible_B11ST = visible_B11ST & same_BST[:, None, None]
  if q_codes_BSH is not None:
    q_codes_BKGS1 = jnp.moveaxis(q_codes_BSH.reshape(batch, seq, num_kv_heads, -1), 1, 3)
    k_codes_BK11T = jnp.moveaxis(k_codes_BSK, 1, 2)[:, :, None, None, :]
    visible_B11ST = visible_B11ST & (q_codes_BKGS1[..., None] == k_codes_BK11T)
  if sparsek is not None:
    tau_BSH, u_BSK, near = sparsek
    tau_BKGS1 = jnp.moveaxis(tau_BSH.reshape(batch, seq, num_kv_heads, -1), 1, 3)[..., None]
    u_BK11T = jnp.moveaxis(u_BSK, 1, 2)[:, :, None, None, :]
    m_BKGST = jnp.clip(u_BK11T - tau_BKGS1, 0.0, 1.0)
    near_B11ST = (token_index_BS[:, :, None] - token_index_BS[:, None, :] < near)[:, None, None]
    visible_B11ST = visible_B11ST & (near_B11ST | (m_BKGST > 0))
    scores_BKGST += jnp.where(near_B11ST, 0.0, jnp.log(jnp.where(m_BKGST > 0, m_BKGST, 1.0)))
  scores_BKGST = jnp.where(visible_B11ST, scores_BKGST, -jnp.inf)
  row_max_BKGS1 = jnp.max(scores_BKGST, axis=-1, keepdims=True)
  row_max_BKGS1 = jnp.where(jnp.isfinite(row_max_BKGS1), row_max_BKGS1, 0.0)
  weights_BKGST = jnp.exp(scores_BKGST - row_max_BKGS1)
  denom_BKGS1 = jnp.sum(weights_BKGST, axis=-1, keepdims=True)
  probs_BKGST = weights_BKGST / jnp.where(denom_BKGS1 > 0, denom_BKGS1, 1.0)
  out_BSKGD = jnp.einsum("bkgst,btkd->bskgd", probs_BKGST.astype(v_BSKD.dtype), v_BSKD,
                         preferred_element_type=jnp.float32)
  return out_BSKGD.reshape(q_BSHD.shape).astype(q_BSHD.dtype)


def _local_and_sparse(cfg: ModelConfig, spans_H, positions_BS, sinks: int, codes,
                      sparsek=None) -> dict:
  """`parallelism.ring_attention`'s per-head spans, sink, bucket-code and SparseK arguments."""
  q_codes, k_codes = codes or (None, None)
  tau, u, near = sparsek or (None, None, 0)
  return dict(spans=spans_H, narrowest=None if spans_H is None else cfg.narrowest_span,
              positions=positions_BS, sink_tokens=sinks, q_buckets=q_codes, k_buckets=k_codes,
              q_thresholds=tau, k_scores=u, sparsek_window=near)


def _whole_rows(cfg: ModelConfig, q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, window,
                spans_H=None, positions_BS=None, sinks=0, codes=None, sparsek=None):
  """`dense` attention: cuDNN's flash attention on a CUDA GPU (each packed document apart;
  a row of more documents than its packed layout takes runs the block kernels as a ring of
  one, and so do a local layer, capped logits and hash attention's `codes`, which cuDNN's
  packed call is not given),
  else `dense_attention`. A dense row is in its original order, so the token index is its
  position and cuDNN's causal mask the rule."""
  if parallelism.cudnn_dense_reason(q_BSHD.shape, q_BSHD.dtype):
    return dense_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, window,
                           cfg.attention_softcap, spans_H, positions_BS, sinks,
                           *(codes or (None, None)), sparsek)
  fallback = functools.partial(
      parallelism.ring_attention, layout="ring", rules=nn.get_logical_axis_rules(),
      tile_size=math.gcd(q_BSHD.shape[1], cfg.attention_tile), window=window,
      softcap=cfg.attention_softcap)
  if window is not None or cfg.attention_softcap or codes is not None or sparsek is not None:
    return fallback(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS,
                    **_local_and_sparse(cfg, spans_H, positions_BS, sinks, codes, sparsek))
  return parallelism.cudnn_dense_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, fallback)


def dense_kernel(cfg: ModelConfig) -> str:
  """What computes a run's `dense` attention: 'cudnn', or 'xla' (`dense_attention`)."""
  reason = parallelism.cudnn_dense_reason((1, 1, cfg.num_heads, cfg.head_size),
                                          jnp.dtype(cfg.dtype))
  return "xla" if reason else "cudnn"


def dense_line(cfg: ModelConfig) -> str:
  """How a run's `dense` attention is computed, as its start says it."""
  if dense_kernel(cfg) == "cudnn":
    return "attention: dense, cuDNN flash attention (packed documents kept apart)"
  return "attention: dense, the plain masked softmax over whole rows"


def _sparsek_operands(cfg: ModelConfig, u_BSK, segment_ids_BS) -> tuple:
  """(thresholds [B, S, Hq], scores [B, S, Hkv], window) of SparseK, in the layout's order.
  A query's threshold reads every earlier score of its row: each device gathers the scores
  (S floats per row and kv head) and computes its own queries' (`parallelism.per_query`)."""
  u_BSK = constrain(u_BSK, ("activation_batch", "activation_seq", "activation_kv_heads"))
  tau_BSK = parallelism.per_query(
      functools.partial(thresholds, k=cfg.sparsek_k, window=cfg.sparsek_window), u_BSK,
      segment_ids_BS, layout=cfg.layout, num_shards=layout_shards(),
      rules=nn.get_logical_axis_rules())
  tau_BSH = jnp.repeat(tau_BSK, cfg.num_heads // cfg.num_kv_heads, axis=2)
  tau_BSH = constrain(tau_BSH, ("activation_batch", "activation_seq", "activation_heads"))
  return tau_BSH, u_BSK, cfg.sparsek_window


def cache_names(cfg: ModelConfig) -> tuple[str, ...]:
  """What a sampler's cache keeps per layer and slot: the roped key and the value, and with a
  run-time mask the key's side of it, [B, C, Hkv]: its code (hash bucket, QK-dropping's kept
  flag; int32) or its SparseK score (float32)."""
  side = ("key_scores",) if cfg.selects else ("key_codes",) if cfg.coded else ()
  return ("key", "value") + side


def _position_drop_codes(cfg: ModelConfig, positions_BS, capacity: int, layer) -> tuple:
  """QK-dropping's codes ([B, S, Hq], [B, S, Hkv]) of decoded tokens: those of their
  positions in a row of the cache's `capacity`, what the prefill's row gave every slot (a
  sampler's row is one document, its positions its original places). So the decode of
  position p is the whole row's forward at p, the row being the cache's length: a sequence
  that grows is coded as the full row it will be, and a slot's flag never changes."""
  batch, seq = positions_BS.shape
  q_SH, k_SK = codes_at(positions_BS.reshape(-1), capacity, cfg.num_heads, cfg.num_kv_heads,
                        cfg.qk_drop_rate, layer)
  return q_SH.reshape(batch, seq, -1), k_SK.reshape(batch, seq, -1)


def _decode_step(cfg: ModelConfig, q_B1HD, k_B1KD, v_B1KD, cache: dict, position_B, window,
                 spans, sinks, codes, u_B1K) -> tuple:
  """(out, the updated cache) of one token per row by `parallelism.decode_attention`; a
  run-time mask's side of the cache (`cache_names`) is written and read beside K/V."""
  mask = {}
  if codes is not None:
    mask["codes"] = (*codes, cache["key_codes"])
  if u_B1K is not None:
    threshold = functools.partial(decode_thresholds, k=cfg.sparsek_k, window=cfg.sparsek_window)
    mask["sparsek"] = (u_B1K, cache["key_scores"], threshold, cfg.sparsek_window)
  out_B1HD, *kept = parallelism.decode_attention(
      q_B1HD, k_B1KD, v_B1KD, cache["key"], cache["value"], position_B, layout=cfg.layout,
      rules=nn.get_logical_axis_rules(), window=window, softcap=cfg.attention_softcap,
      spans=spans, sink_tokens=sinks, **mask)
  return out_B1HD, dict(zip(cache_names(cfg), kept))


class Attention(nn.Module):
  """Self-attention of a whole row (training, eval, a sampler's prefill) or, with `decode`,
  of one new token per row over the `cache` collection a prefill left (for sampling).

  `local` (a traced bool, one per layer of the decoder's scan) says whether this layer is
  local; when the model's layers are all of one kind it is ignored and nothing branches.
  A local layer sees `cfg.window` keys (with a span plan, each query head its own span:
  `spans_H`, this layer's row of the scanned plan) and, with `cfg.local_rope_theta`,
  rotates by its own RoPE base (unscaled, as Gemma 3's local layers).

  A prefill (an apply, not an init) with the `cache` collection mutable stores each layer's
  roped keys and values there, in the row's layout order; a decode step writes the new
  token's into the slot of its position and attends to the whole cache by
  `parallelism.decode_attention`. With a run-time mask the cache also keeps each key's code
  or SparseK score (`cache_names`) and a step masks as the whole row's forward does; for
  QK-dropping that row is the cache's capacity (`_position_drop_codes`).

  With hash attention, `hash_KDR` is this layer's projection ([Hkv, D, b/2], scanned with
  the blocks): the roped q and k are hashed by it into bucket codes (model/hashing.py).
  With QK-dropping, `layer` is this layer's index (scanned), the seed of its drop pattern
  (model/dropping.py), whose kept/dropped codes mask attention the same way. With SparseK a
  scorer (`sparsek_score`, [d_model, Hkv]) scores each token from the layer's input, and each
  query's threshold over its prefix follows (model/sparsek.py).
  """

  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BSE: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array,
               local: jax.Array | None = None, spans_H: jax.Array | None = None,
               hash_KDR: jax.Array | None = None, layer: jax.Array | None = None) -> jax.Array:
    cfg = self.cfg

    def project(heads, names, name):
      return Projection(cfg, "bse,ehd->bshd", (cfg.d_model, heads, cfg.head_size), names,
                        name=name)(x_BSE)

    q_BSHD = project(cfg.num_heads, ("embed", "heads", "head_dim"), "query")
    k_BSKD = project(cfg.num_kv_heads, ("embed", "kv_heads", "head_dim"), "key")
    v_BSKD = project(cfg.num_kv_heads, ("embed", "kv_heads", "head_dim"), "value")
    cache = {name: self.get_variable("cache", name) for name in cache_names(cfg)
             } if self.decode else None
    u_BSK = Scorer(cfg, name="sparsek_score")(x_BSE) if cfg.selects else None
    sparsek = None
    if cfg.selects and not self.decode:
      sparsek = _sparsek_operands(cfg, u_BSK, segment_ids_BS)

    def attend(kind: str, q_BSHD, k_BSKD, v_BSKD, cache):
      """(out, what the cache keeps: `cache_names`) of a layer of this kind."""
      theta, scaling = cfg.rope_theta, cfg.rope_scaling
      if kind == LOCAL and cfg.local_rope_theta:
        theta, scaling = cfg.local_rope_theta, RopeScaling()
      inv_freq_F, rope_factor = frequencies(cfg.head_size, theta, scaling)
      q_BSHD = constrain(apply_rope(q_BSHD, positions_BS, inv_freq_F, rope_factor),
                         ("activation_batch", "activation_seq", "activation_heads", None))
      k_BSKD = constrain(apply_rope(k_BSKD, positions_BS, inv_freq_F, rope_factor),
                         ("activation_batch", "activation_seq", "activation_kv_heads", None))
      window = cfg.window_of(kind)
      # Per-head spans narrow a local layer's window per head (the widest is `window`).
      spans = spans_H if kind == LOCAL else None
      sinks = cfg.sink_tokens if kind == LOCAL else 0
      codes = None
      if hash_KDR is not None:
        codes = bucket_codes(q_BSHD, hash_KDR), bucket_codes(k_BSKD, hash_KDR)
      if layer is not None and self.decode:  # The token's own, in a row of the capacity.
        codes = _position_drop_codes(cfg, positions_BS, cache["key"].shape[1], layer)
      elif layer is not None:  # Pinned like q and k: each device computes its own tokens'.
        q_codes, k_codes = drop_codes(q_BSHD.shape[0], q_BSHD.shape[1], cfg.num_heads,
                                      cfg.num_kv_heads, cfg.qk_drop_rate, layer, cfg.layout)
        codes = (constrain(q_codes, ("activation_batch", "activation_seq", "activation_heads")),
                 constrain(k_codes, ("activation_batch", "activation_seq",
                                     "activation_kv_heads")))
      if self.decode:
        return _decode_step(cfg, q_BSHD, k_BSKD, v_BSKD, cache, positions_BS[:, 0], window,
                            spans, sinks, codes, u_BSK)
      if cfg.attention == "dense":
        out_BSHD = _whole_rows(cfg, q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, window, spans,
                               positions_BS, sinks, codes, sparsek)
      else:
        # The ring's shardings come from the rules table the activations above are pinned
        # by; its schedule from the layout the data pipeline permuted the batch into.
        out_BSHD = parallelism.ring_attention(
            q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, layout=cfg.layout,
            rules=nn.get_logical_axis_rules(), kernel=cfg.kernel,
            tile_size=cfg.attention_tile, strategy=cfg.sequence_parallel, window=window,
            softcap=cfg.attention_softcap,
            **_local_and_sparse(cfg, spans, positions_BS, sinks, codes, sparsek))
      kept = {"key": k_BSKD, "value": v_BSKD}
      if codes is not None:
        kept["key_codes"] = codes[1]
      if sparsek is not None:
        kept["key_scores"] = sparsek[1]
      return out_BSHD, kept

    kinds = set(cfg.layer_kinds)
    operands = (q_BSHD, k_BSKD, v_BSKD, cache)
    if len(kinds) == 1:
      out_BSHD, kept = attend(kinds.pop(), *operands)
    else:  # Both branches are traced once; each layer runs one.
      out_BSHD, kept = jax.lax.cond(
          local, functools.partial(attend, LOCAL), functools.partial(attend, GLOBAL), *operands)
    if self.is_mutable_collection("cache") and not self.is_initializing():
      for name, value in kept.items():
        self.put_variable("cache", name, value)
    # Named so that the `save_attention` remat policy can keep it (the ring names its
    # backward's residuals itself).
    out_BSHD = checkpoint_name(out_BSHD, "attention_out")
    return Projection(cfg, "bshd,hde->bse", (cfg.num_heads, cfg.head_size, cfg.d_model),
                      ("heads", "head_dim", "embed"), name="out")(out_BSHD)
