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
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import parallelism
from model.config import GLOBAL, LOCAL, ModelConfig
from model.dropping import codes_at, drop_codes, layout_shards
from model.hashing import bucket_codes
from model.layers import Projection, constrain
from model.sparsek import Scorer, decode_thresholds, row_mask, thresholds
from model.rope import RopeScaling, apply_rope, frequencies


def dense_attention(q_BSHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                    mask: parallelism.Mask) -> jax.Array:
  """Masked softmax attention over the whole row, in its original order (a token's index
  is its place), as `mask` says (`parallelism.masks`: the one rule, the one score
  modification and, with SparseK, the log of each key's weight added to its logit); K/V
  heads are shared by query groups.

  Scores and softmax are float32. A query that sees no key gets zeros, not NaN.
  """
  spec = mask.spec
  batch, seq, num_heads, head_dim = q_BSHD.shape
  num_kv_heads = k_BSKD.shape[2]
  q_BSKGD = q_BSHD.reshape(batch, seq, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores_BKGST = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BSKD,
                            preferred_element_type=jnp.float32)
  scores_BKGST = parallelism.masks.logits(spec, scores_BKGST, head_dim ** -0.5)[0]
  # The operands laid out [B, Hkv, G, S (queries), T (keys)].
  index_S = jnp.arange(seq)
  behind_ST = index_S[:, None] - index_S[None, :]
  per_query = lambda x_BS_: None if x_BS_ is None else jnp.moveaxis(
      x_BS_.reshape(batch, seq, num_kv_heads, -1), 1, 3)[..., None]
  per_key = lambda x_BS_: None if x_BS_ is None else jnp.moveaxis(x_BS_, 1, 2)[:, :, None,
                                                                             None, :]
  row = lambda x_BS, axis: None if x_BS is None else jnp.expand_dims(x_BS[:, None, None],
                                                                     axis)
  span = None if mask.q.spans is None else mask.q.spans.reshape(num_kv_heads, -1)[
      :, :, None, None]
  laid_out = parallelism.Mask(
      spec, parallelism.Side(row(mask.q.segment_ids, -1), codes=per_query(mask.q.codes),
                             scores=per_query(mask.q.scores), spans=span),
      parallelism.Side(row(mask.k.segment_ids, -2), row(mask.k.positions, -2),
                       per_key(mask.k.codes), per_key(mask.k.scores)))
  visible_BKGST = parallelism.masks.visible(laid_out, behind_ST)
  if spec.selects:
    weight, _ = parallelism.masks.sparsek_weight(laid_out, behind_ST)
    scores_BKGST += jnp.log(jnp.where(weight > 0, weight, 1.0))
  scores_BKGST = jnp.where(visible_BKGST, scores_BKGST, -jnp.inf)
  row_max_BKGS1 = jnp.max(scores_BKGST, axis=-1, keepdims=True)
  row_max_BKGS1 = jnp.where(jnp.isfinite(row_max_BKGS1), row_max_BKGS1, 0.0)
  weights_BKGST = jnp.exp(scores_BKGST - row_max_BKGS1)
  denom_BKGS1 = jnp.sum(weights_BKGST, axis=-1, keepdims=True)
  probs_BKGST = weights_BKGST / jnp.where(denom_BKGS1 > 0, denom_BKGS1, 1.0)
  out_BSKGD = jnp.einsum("bkgst,btkd->bskgd", probs_BKGST.astype(v_BSKD.dtype), v_BSKD,
                         preferred_element_type=jnp.float32)
  return out_BSKGD.reshape(q_BSHD.shape).astype(q_BSHD.dtype)


def _whole_rows(cfg: ModelConfig, q_BSHD, k_BSKD, v_BSKD, mask: parallelism.Mask):
  """`dense` attention: cuDNN's flash attention on a CUDA GPU (each packed document apart;
  a row of more documents than its packed layout takes runs the block kernels as a ring of
  one, and so does any mask beyond causal documents: a local layer, capped logits, run-time
  masks, which cuDNN's packed call is not given), else `dense_attention`. A dense row is in
  its original order, so the token index is its position and cuDNN's causal mask the rule."""
  if parallelism.cudnn_dense_reason(q_BSHD.shape, q_BSHD.dtype):
    return dense_attention(q_BSHD, k_BSKD, v_BSKD, mask)
  ring = functools.partial(
      parallelism.ring_attention, layout="ring", rules=nn.get_logical_axis_rules(),
      tile_size=math.gcd(q_BSHD.shape[1], cfg.attention_tile))
  if mask.spec != parallelism.MaskSpec():
    return ring(q_BSHD, k_BSKD, v_BSKD, mask)
  return parallelism.cudnn_dense_attention(
      q_BSHD, k_BSKD, v_BSKD, mask.q.segment_ids,
      lambda q, k, v, segment_ids: ring(q, k, v, parallelism.Mask.of(segment_ids=segment_ids)))


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


def _sparsek_scores(cfg: ModelConfig, u_BSK, segment_ids_BS) -> tuple:
  """SparseK's (thresholds [B, S, Hq], scores [B, S, Hkv]), in the layout's order.
  A query's threshold reads every earlier score of its row: each device gathers the scores
  (S floats per row and kv head) and computes its own queries' (`parallelism.per_query`)."""
  u_BSK = constrain(u_BSK, ("activation_batch", "activation_seq", "activation_kv_heads"))
  spec = cfg.mask_spec(GLOBAL)
  tau_BSK = parallelism.per_query(
      lambda u, seg, index, seg_q: thresholds(row_mask(spec, u, seg, index, seg_q)), u_BSK,
      segment_ids_BS, layout=cfg.layout, num_shards=layout_shards(),
      rules=nn.get_logical_axis_rules())
  tau_BSH = jnp.repeat(tau_BSK, cfg.num_heads // cfg.num_kv_heads, axis=2)
  tau_BSH = constrain(tau_BSH, ("activation_batch", "activation_seq", "activation_heads"))
  return tau_BSH, u_BSK


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


def _decode_step(cfg: ModelConfig, q_B1HD, k_B1KD, v_B1KD, cache: dict, position_B,
                 mask: parallelism.Mask) -> tuple:
  """(out, the updated cache) of one token per row by `parallelism.decode_attention`; a
  run-time mask's side of the cache (`cache_names`) is written and read beside K/V."""
  names = cache_names(cfg)
  slots = parallelism.Side(codes=cache.get("key_codes"), scores=cache.get("key_scores"))
  threshold = None
  if cfg.selects:
    threshold = functools.partial(decode_thresholds, k=cfg.sparsek_k, window=cfg.sparsek_window)
  out_B1HD, (key, value, slots) = parallelism.decode_attention(
      q_B1HD, k_B1KD, v_B1KD, (cache["key"], cache["value"], slots), position_B, mask,
      layout=cfg.layout, rules=nn.get_logical_axis_rules(), threshold=threshold)
  kept = (key, value) + tuple(x for x in (slots.codes, slots.scores) if x is not None)
  return out_B1HD, dict(zip(names, kept))


class LayerInputs(NamedTuple):
  """What the decoder's scan hands each layer's attention beside its input (each None where
  the model has none): whether it is local (a traced bool; ignored when the layers are all
  of one kind), its per-head spans [Hq], its hash projections [Hkv, D, b/2], its index (the
  seed of QK-dropping's pattern)."""
  local: jax.Array | None = None
  spans_H: jax.Array | None = None
  hash_KDR: jax.Array | None = None
  index: jax.Array | None = None


class Attention(nn.Module):
  """Self-attention of a whole row (training, eval, a sampler's prefill) or, with `decode`,
  of one new token per row over the `cache` collection a prefill left (for sampling).

  `layer.local` (a traced bool, one per layer of the decoder's scan) says whether this
  layer is local; when the model's layers are all of one kind it is ignored and nothing
  branches. A local layer sees `cfg.window` keys (with a span plan, each query head its own
  span: `layer.spans_H`, this layer's row of the scanned plan) and, with
  `cfg.local_rope_theta`, rotates by its own RoPE base (unscaled, as Gemma 3's local layers).
  Each layer kind's mask is `cfg.mask_spec(kind)` (`parallelism.masks`).

  A prefill (an apply, not an init) with the `cache` collection mutable stores each layer's
  roped keys and values there, in the row's layout order; a decode step writes the new
  token's into the slot of its position and attends to the whole cache by
  `parallelism.decode_attention`. With a run-time mask the cache also keeps each key's code
  or SparseK score (`cache_names`) and a step masks as the whole row's forward does; for
  QK-dropping that row is the cache's capacity (`_position_drop_codes`).

  With hash attention, `layer.hash_KDR` is this layer's projection ([Hkv, D, b/2], scanned
  with the blocks): the roped q and k are hashed by it into bucket codes (model/hashing.py).
  With QK-dropping, `layer.index` is this layer's index (scanned), the seed of its drop
  pattern (model/dropping.py), whose kept/dropped codes mask attention the same way. With SparseK a
  scorer (`sparsek_score`, [d_model, Hkv]) scores each token from the layer's input, and each
  query's threshold over its prefix follows (model/sparsek.py).
  """

  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BSE: jax.Array, positions_BS: jax.Array, segment_ids_BS: jax.Array,
               layer: LayerInputs = LayerInputs()) -> jax.Array:
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
    scores = (None, u_BSK)  # SparseK's (thresholds, scores); a decode step solves its own
    if cfg.selects and not self.decode:
      scores = _sparsek_scores(cfg, u_BSK, segment_ids_BS)

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
      spec = cfg.mask_spec(kind)
      codes = (None, None)
      if layer.hash_KDR is not None:
        codes = bucket_codes(q_BSHD, layer.hash_KDR), bucket_codes(k_BSKD, layer.hash_KDR)
      if layer.index is not None and self.decode:  # The token's own, in a row of the capacity.
        codes = _position_drop_codes(cfg, positions_BS, cache["key"].shape[1], layer.index)
      elif layer.index is not None:  # Pinned like q and k: each device computes its own.
        q_codes, k_codes = drop_codes(q_BSHD.shape[0], q_BSHD.shape[1], cfg.num_heads,
                                      cfg.num_kv_heads, cfg.qk_drop_rate, layer.index,
                                      cfg.layout)
        codes = (constrain(q_codes, ("activation_batch", "activation_seq", "activation_heads")),
                 constrain(k_codes, ("activation_batch", "activation_seq",
                                     "activation_kv_heads")))
      # Per-head spans narrow a local layer's window per head (the widest is the spec's).
      spans = layer.spans_H if spec.head_spans else None
      if self.decode:  # one document per row: no segment ids, positions are its own
        mask = parallelism.Mask(spec, parallelism.Side(codes=codes[0], spans=spans),
                                parallelism.Side(codes=codes[1], scores=scores[1]))
        return _decode_step(cfg, q_BSHD, k_BSKD, v_BSKD, cache, positions_BS[:, 0], mask)
      mask = parallelism.Mask.of(
          spec, segment_ids_BS, positions=positions_BS if spec.sink_tokens else None,
          spans=spans, codes=codes, scores=scores)
      if cfg.attention == "dense":
        out_BSHD = _whole_rows(cfg, q_BSHD, k_BSKD, v_BSKD, mask)
      else:
        # The ring's shardings come from the rules table the activations above are pinned
        # by; its schedule from the layout the data pipeline permuted the batch into.
        out_BSHD = parallelism.ring_attention(
            q_BSHD, k_BSKD, v_BSKD, mask, layout=cfg.layout, rules=nn.get_logical_axis_rules(),
            kernel=cfg.kernel, tile_size=cfg.attention_tile, strategy=cfg.sequence_parallel)
      kept = {"key": k_BSKD, "value": v_BSKD}
      if codes[1] is not None:
        kept["key_codes"] = codes[1]
      if scores[1] is not None:
        kept["key_scores"] = scores[1]
      return out_BSHD, kept

    kinds = set(cfg.layer_kinds)
    operands = (q_BSHD, k_BSKD, v_BSKD, cache)
    if len(kinds) == 1:
      out_BSHD, kept = attend(kinds.pop(), *operands)
    else:  # Both branches are traced once; each layer runs one.
      out_BSHD, kept = jax.lax.cond(
          layer.local, functools.partial(attend, LOCAL), functools.partial(attend, GLOBAL),
          *operands)
    if self.is_mutable_collection("cache") and not self.is_initializing():
      for name, value in kept.items():
        self.put_variable("cache", name, value)
    # Named so that the `save_attention` remat policy can keep it (the ring names its
    # backward's residuals itself).
    out_BSHD = checkpoint_name(out_BSHD, "attention_out")
    return Projection(cfg, "bshd,hde->bse", (cfg.num_heads, cfg.head_size, cfg.d_model),
                      ("heads", "head_dim", "embed"), name="out")(out_BSHD)
