"""What a layer's attention may see: one static spec, one pytree of run-time operands, one rule.

A mask is two things (as splash attention's mask objects, levanter's `AttentionMask` and
FlexAttention's `mask_mod`/`score_mod`):

- `MaskSpec`, static and hashable: causal always (a decoder), a window, per-head spans between
  two bounds, sink tokens, a logit soft cap, and the run-time kind with its parameters (hash
  buckets, QK-dropping, SparseK). The host builds the ring's schedule from it, the kernel
  choice reads it (`parallelism.kernels`), and `problem` states every rule of which
  combinations mean something, blaming the field: the trainer's config check and
  `ring_attention` both call it.
- `Mask`, a pytree: the spec (static) plus a query `Side` and a key `Side` of run-time
  operands (segment ids, positions, codes, SparseK's numbers; the query side also each
  head's span). It shards, travels around the ring and returns its cotangents as one value.

`visible` is the one definition of which keys a query sees, and `logits` the one score
modification; dense attention, every kernel, decoding, the sink path and the host's schedule
(NumPy) call them on arrays shaped however they hold their tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

SPARSE = ("none", "hash", "qk_drop", "sparsek")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static: what a layer's queries may see. Query i sees key j iff j's original position is
  not after i's, they are in the same document, and every field set below agrees."""
  window: int | None = None  # keys a query sees, itself included; with spans the widest
  narrowest: int | None = None  # per-head spans (`Side.spans`) lie in [narrowest, window]
  sink_tokens: int = 0  # with a window: keys at in-document positions below it stay visible
  softcap: float = 0.0  # logits capped at softcap * tanh(logit / softcap); 0: none
  sparse: str = "none"  # run-time kind: hash buckets, QK-dropping's flags, SparseK
  hash_buckets: int = 0  # hash: buckets (even: argmax over [xR, -xR])
  qk_drop_rate: float = 0.0  # qk_drop: the share of queries and keys dropped
  sparsek_k: int = 0  # sparsek: keys each query's soft top-k keeps
  sparsek_window: int = 0  # sparsek: keys up to itself a query always sees

  @property
  def head_spans(self) -> bool:
    """Whether each query head has its own span (`Side.spans`)."""
    return self.narrowest is not None

  @property
  def coded(self) -> bool:
    """Whether run-time codes mask it: a key seen only where its code equals the query's."""
    return self.sparse in ("hash", "qk_drop")

  @property
  def selects(self) -> bool:
    """Whether SparseK weighs its keys (thresholds and scores, with gradients)."""
    return self.sparse == "sparsek"

  @property
  def on_ring(self) -> MaskSpec:
    """What the ring's block kernels apply: all but the sinks, which a path of their own
    adds beside the ring (`parallelism.sinks`)."""
    return dataclasses.replace(self, sink_tokens=0)

  @property
  def text(self) -> str:
    """'causal', 'window 64', 'spans 16..64', then what else is set."""
    parts = ["causal" if self.window is None else f"window {self.window}" if not
             self.head_spans else f"spans {self.narrowest}..{self.window}"]
    parts += [f"{self.sink_tokens} sinks"] * bool(self.sink_tokens)
    parts += [f"softcap {self.softcap:g}"] * bool(self.softcap)
    parts += [self.sparse] * (self.sparse != "none")
    return ", ".join(parts)


# How `ring_attention`'s callers know each field; the trainer names them by its config's.
FIELDS = {field.name: f"mask.{field.name}" for field in dataclasses.fields(MaskSpec)}


def _whole(value, least: int) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def _finite(value) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def problem(spec: MaskSpec, names: dict[str, str] = FIELDS) -> str:
  """Every rule of what a spec may be, in one place: what is wrong with `spec`, naming the
  field by `names`; empty when it can run."""
  n = names
  if spec.window is not None and not _whole(spec.window, 1):
    return (f"{n['window']}={spec.window!r} must be a whole number of keys >= 1 (the query "
            f"itself counts), or None for causal attention")
  if spec.narrowest is not None:
    if not _whole(spec.narrowest, 1) or spec.window is None or spec.narrowest > spec.window:
      return (f"{n['narrowest']}={spec.narrowest!r}: the narrowest span must be a whole "
              f"number of keys >= 1, at most the widest ({n['window']}={spec.window})")
  if not _whole(spec.sink_tokens, 0):
    return f"{n['sink_tokens']}={spec.sink_tokens!r} must be >= 0 (0: none)"
  if spec.sink_tokens and spec.window is None:
    return (f"{n['sink_tokens']}={spec.sink_tokens} needs a window ({n['window']}): a causal "
            f"layer already sees every earlier key")
  if not _finite(spec.softcap) or spec.softcap < 0:
    return f"{n['softcap']}={spec.softcap!r} must be a finite number >= 0 (0: no cap)"
  return _sparse_problem(spec, n)


def _sparse_problem(spec: MaskSpec, n: dict[str, str]) -> str:
  if spec.sparse not in SPARSE:
    return f"{n['sparse']}='{spec.sparse}' must be one of {SPARSE}"
  for field, kind in (("hash_buckets", "hash"), ("qk_drop_rate", "qk_drop"),
                      ("sparsek_k", "sparsek"), ("sparsek_window", "sparsek")):
    if getattr(spec, field) and spec.sparse != kind:
      return (f"{n[field]}={getattr(spec, field):g} is set but {n['sparse']}='{spec.sparse}': "
              f"set {n['sparse']}='{kind}' too")
  if spec.sparse == "hash" and (not _whole(spec.hash_buckets, 2) or spec.hash_buckets % 2):
    return (f"{n['hash_buckets']}={spec.hash_buckets} must be even and >= 2 with "
            f"{n['sparse']}='hash' (the hash is argmax over [xR, -xR] of b/2 projections)")
  if spec.sparse == "qk_drop" and not (_finite(spec.qk_drop_rate) and 0 < spec.qk_drop_rate < 1):
    return (f"{n['qk_drop_rate']}={spec.qk_drop_rate:g} must be in (0, 1) with {n['sparse']}="
            f"'qk_drop' (the share of queries and keys dropped per head)")
  if spec.sparse != "none" and spec.sink_tokens:
    return (f"{n['sink_tokens']}={spec.sink_tokens} does not combine with {n['sparse']}="
            f"'{spec.sparse}' (the sink path has no run-time mask)")
  if not spec.selects:
    return ""
  if not _whole(spec.sparsek_k, 1):
    return (f"{n['sparsek_k']}={spec.sparsek_k} must be >= 1 with {n['sparse']}='sparsek' (the "
            f"keys each query's soft top-k mask keeps)")
  if not _whole(spec.sparsek_window, 0):
    return f"{n['sparsek_window']}={spec.sparsek_window} must be >= 0 (0: no window)"
  if spec.window is not None or spec.head_spans:
    return (f"{n['sparse']}='sparsek' does not combine with local layers (a window or "
            f"per-head spans: {n['window']}, {n['narrowest']}): its own window is "
            f"{n['sparsek_window']}")
  if spec.softcap:
    return (f"{n['softcap']}={spec.softcap:g} does not combine with {n['sparse']}='sparsek' "
            f"(its kernel has no logit cap)")
  return ""


def check(spec: MaskSpec, names: dict[str, str] = FIELDS) -> None:
  """`problem` as a ValueError."""
  message = problem(spec, names)
  if message:
    raise ValueError(message)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["segment_ids", "positions", "codes", "scores", "spans", "index"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Side:
  """One side's run-time operands, each None where the spec needs none. Per token [B, S] or
  [B, S, H] in the layout's order, as q (query side, H = Hq) or k (key side, H = Hkv); a
  side sorted per head (`parallelism.sorting`) holds [B, S, H] in each head's order."""
  segment_ids: Any = None  # [B, S] int32: document ids; None: one document per row
  positions: Any = None  # [B, S] int32: in-document positions (which keys are sinks)
  codes: Any = None  # [B, S, H] int32: hash bucket or QK-dropping's kept flag per head
  scores: Any = None  # [B, S, H] float32: SparseK's threshold (queries) or score (keys)
  spans: Any = None  # [Hq] int32, query side: each head's span (MoA)
  index: Any = None  # [B, S, H] int32, a sorted side: each entry's original position

  def travelling(self) -> Side:
    """What a key block carries around the ring: positions stay (the sink path, off the
    ring, reads them from the whole row)."""
    return dataclasses.replace(self, positions=None)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "k"],
                   meta_fields=["spec"])
@dataclasses.dataclass(frozen=True)
class Mask:
  """A layer's mask: the static spec and the run-time operands of both sides."""
  spec: MaskSpec = MaskSpec()
  q: Side = Side()
  k: Side = Side()

  @classmethod
  def of(cls, spec: MaskSpec = MaskSpec(), segment_ids=None, *, positions=None, spans=None,
         codes=(None, None), scores=(None, None)) -> Mask:
    """Self-attention's mask: both sides share segment ids and positions; `codes` and
    `scores` are (the queries', the keys')."""
    return cls(spec, Side(segment_ids, positions, codes[0], scores[0], spans),
               Side(segment_ids, positions, codes[1], scores[1]))

  def checked(self, q_shape, k_shape) -> Mask:
    """The mask with every operand the spec needs present, shaped for q [B, S, Hq, D] and
    k [B, S, Hkv, D] and cast to its dtype; a ValueError says what is missing or wrong."""
    check(self.spec)
    spec, row = self.spec, tuple(q_shape[:2])
    needs = dict(segment_ids=None, positions=spec.sink_tokens > 0, codes=spec.coded,
                 scores=spec.selects, index=False)
    what = dict(positions="sink tokens need positions (in-document positions, which say "
                          "which keys are sinks)",
                codes="hash attention and QK-dropping need codes", scores="SparseK needs "
                "thresholds (queries) and scores (keys)")
    sides = {}
    for side_name, side, heads in (("q", self.q, q_shape[2]), ("k", self.k, k_shape[2])):
      fields = {}
      for field, needed in needs.items():
        value = getattr(side, field)
        shape = row if field in ("segment_ids", "positions") else row + (heads,)
        if needed is not None and (value is None) == needed:
          raise ValueError(f"mask.{side_name}.{field}: {what[field]} [B, S"
                           f"{', H' if len(shape) > 2 else ''}] = {shape}" if needed else
                           f"mask.{side_name}.{field} is given but mask.spec ({spec.text}) "
                           f"reads none")
        if value is not None and tuple(value.shape) != shape:
          raise ValueError(f"mask.{side_name}.{field} {tuple(value.shape)} must be {shape}")
        dtype = jnp.float32 if field == "scores" else jnp.int32
        fields[field] = None if value is None else jnp.asarray(value).astype(dtype)
      sides[side_name] = Side(**fields)
    spans = self.q.spans
    if spec.head_spans != (spans is not None) or (
        spans is not None and tuple(spans.shape) != (q_shape[2],)):
      raise ValueError(f"per-head spans (mask.q.spans [query heads] = [{q_shape[2]}]) go with "
                       f"mask.spec.narrowest and mask.spec.window (the narrowest and widest)")
    if self.k.spans is not None:
      raise ValueError("per-head spans are the query side's (mask.q.spans)")
    q_side = dataclasses.replace(sides["q"], spans=None if spans is None
                                 else jnp.asarray(spans, jnp.int32))
    return Mask(spec, q_side, sides["k"])

  def on_ring(self) -> Mask:
    """The mask the ring's block kernels apply (`MaskSpec.on_ring`)."""
    return dataclasses.replace(self, spec=self.spec.on_ring)

  def specs(self, q_spec: P, kv_spec: P, row_spec: P) -> Mask:
    """The shard_map specs of its operands (a Mask of PartitionSpecs): per-token operands
    as the row (segment ids, positions) or as their side's heads, spans as the heads."""
    def side(s: Side, x_spec: P) -> Side:
      per_head = P(*x_spec[:3])
      return Side(*(None if value is None else spec for value, spec in (
          (s.segment_ids, row_spec), (s.positions, row_spec), (s.codes, per_head),
          (s.scores, per_head), (s.spans, P(q_spec[2])), (s.index, per_head))))
    return Mask(self.spec, side(self.q, q_spec), side(self.k, kv_spec))


def visible(mask: Mask, behind=None):
  """Whether each query sees each key: the one rule. The mask's operands broadcast against
  each other (NumPy or JAX arrays, laid out however the caller holds its tiles; the query
  side's `spans` as each query head's span): `behind` is the query's original position
  minus the key's, or None where a mask of positions already holds (a schedule's tile mask,
  which is this rule run on the host). Sinks are included: the ring's kernels take
  `Mask.on_ring`, the sink path the rest (`beyond_ring`)."""
  spec, q, k = mask.spec, mask.q, mask.k
  seen = None
  if behind is not None:
    seen = behind >= 0
    if spec.window is not None:
      seen = seen & (behind < (spec.window if q.spans is None else q.spans))
  if spec.selects:  # a key fewer than sparsek_window back, or of a score above the threshold
    picked = k.scores - q.scores > 0.0
    seen = _and(seen, picked if behind is None else (behind < spec.sparsek_window) | picked)
  if spec.coded:
    seen = _and(seen, q.codes == k.codes)
  if spec.sink_tokens and behind is not None:
    seen = seen | ((behind >= 0) & (k.positions < spec.sink_tokens))
  if q.segment_ids is not None:
    seen = _and(seen, q.segment_ids == k.segment_ids)
  return seen


def beyond_ring(mask: Mask, behind):
  """What the sink path adds to the ring's keys: visible, but not on the ring (`on_ring`)."""
  return visible(mask, behind) & ~visible(mask.on_ring(), behind)


def _and(a, b):
  return b if a is None else a & b


def logits(spec: MaskSpec, s, scale: float):
  """The one score modification: (logits, their slope d logits / d s) of scores s = q.k,
  scaled and, with a soft cap, capped."""
  logits_ = s * scale
  if not spec.softcap:
    return logits_, scale
  capped = jnp.tanh(logits_ / spec.softcap)
  return spec.softcap * capped, scale * (1.0 - capped * capped)


def sparsek_weight(mask: Mask, behind):
  """SparseK's weight of each visible key, m = 1 within its window, else
  clip(score - threshold, 0, 1), and whether it lies strictly inside (0, 1) (its support,
  where the weight has a gradient). Attention weighs exp(logit) by m (log m added)."""
  gap = mask.k.scores - mask.q.scores
  near = behind < mask.spec.sparsek_window
  return jnp.where(near, 1.0, jnp.clip(gap, 0.0, 1.0)), ~near & (gap > 0.0) & (gap < 1.0)
