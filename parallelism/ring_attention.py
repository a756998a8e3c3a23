"""Exact causal attention over a sequence sharded along the mesh: the public entry point.

`ring_attention` runs one strategy (`parallelism.strategies`: ring by default, allgather,
ulysses or hybrid) for a sequence in any layout (`parallelism.layouts`). What each device
computes is the layout's static schedule (`parallelism.schedule`), built on the host once
per compile; no token index is traced, travels or is compared at run time.

The shard_map's specs come from the same rules table as the activations around the call
(logical names `activation_batch`, `activation_seq`, `activation_heads`,
`activation_kv_heads`), so a change of `mesh.rules` moves both together and adds no reshard.
`activation_seq` names the ring's mesh axis, then, for Ulysses, the all-to-all's.

The gradient is a `jax.custom_vjp` around the sharded passes: the forward saves its inputs
plus the global output and lse, named `attention_out` and `attention_lse` for remat
policies; the backward is a second pass of the strategy (its own shard_map) that recomputes
each block's probabilities from them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parallelism import kernels, sinks
from parallelism.mesh import Rules, as_axes, logical_to_spec, spec_on_mesh
from parallelism.split import KV_NAMES, Q_NAMES, local_strategy, split_attention
from parallelism.strategies import STRATEGIES, Strategy

SEGMENT_NAMES = ("activation_batch", "activation_seq")
# Without a rules table: the sequence over the `sequence` axis (the ring) and, where the mesh
# has one, the `ulysses` axis; everything else replicated.
DEFAULT_RULES = (("activation_seq", ("sequence", "ulysses")),)
# What the backward needs from the forward; a remat policy that saves these by name keeps
# the backward from running the ring forward again.
SAVED_NAMES = ("attention_out", "attention_lse")



@dataclasses.dataclass(frozen=True)
class _Passes:
  """How one call runs its passes: each device's strategy and, on a mesh, the shard_map
  specs (q and out, k and v, segment ids) it runs over. Static (hashed into the trace) so
  it can be a non-differentiable argument of the custom_vjp."""
  strategy: Strategy
  mesh: Any = None  # None: the context mesh when `specs` are given
  specs: tuple[P, P, P] | None = None  # None: no mesh, one local block
  sinks: sinks.SinkPlan | None = None  # sink tokens beside the ring (parallelism.sinks)

  def _on_devices(self, per_device, in_specs, out_specs):
    if self.specs is None:
      return per_device
    # check_vma=False: the kernels' loop carries and skip branches start from replicated
    # constants while the computed ones are device-varying. The shard_map is never
    # transposed (the custom_vjp around it supplies the backward), so replicated operands
    # cost no all-reduce of their cotangents.
    return jax.shard_map(per_device, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

  def _optional_specs(self, seg_BS, spans_H, pos_BS, codes) -> tuple:
    """Specs of the optional operands given: segment ids, per-head spans (as heads),
    positions (sink tokens), then the queries' and keys' bucket codes (as lse)."""
    q_spec, kv_spec, seg_spec = self.specs or (None,) * 3
    heads_spec = None if q_spec is None else P(q_spec[2])
    code_specs = (None, None) if q_spec is None else (P(*q_spec[:3]), P(*kv_spec[:3]))
    return (_if(seg_BS, seg_spec) + _if(spans_H, heads_spec) + _if(pos_BS, seg_spec)
            + (() if codes is None else code_specs))

  def _sink_args(self, q, seg, pos, spans) -> tuple:
    """The sink path's leading arguments on one device (`parallelism.sinks`)."""
    axes = () if self.specs is None else as_axes(self.specs[0][1])
    seg = jnp.zeros_like(pos) if seg is None else seg
    return (self.sinks, self.strategy.schedule.order.reshape(-1), axes, seg, pos,
            self.sinks.windows(q.shape[2], spans), self.strategy.softcap)

  def forward(self, q_BSHD, k_BSKD, v_BSKD, seg_BS, spans_H=None, pos_BS=None, codes=None):
    """(out in q's dtype, lse float32 [B, S, Hq]), global arrays; `codes`: (the queries',
    the keys') bucket codes of hash attention, or None."""
    q_spec, kv_spec, _ = self.specs or (None,) * 3
    lse_spec = None if q_spec is None else P(*q_spec[:3])

    def per_device(q, k, v, *optional):
      seg, spans, pos, codes_d = _split_optional(optional, seg_BS, spans_H, pos_BS, codes)
      out, lse = self.strategy.forward(q, k, v, seg, spans, codes_d)
      if self.sinks is not None:
        plan, order, axes, seg, pos, windows, cap = self._sink_args(q, seg, pos, spans)
        out, lse = sinks.forward(plan, order, axes, q, k, v, seg, pos, windows, cap, out, lse)
      return out.astype(q.dtype), lse

    run = self._on_devices(per_device, (q_spec, kv_spec, kv_spec)
                           + self._optional_specs(seg_BS, spans_H, pos_BS, codes),
                           (q_spec, lse_spec))
    return run(q_BSHD, k_BSKD, v_BSKD, *_optionals(seg_BS, spans_H, pos_BS, codes))

  def backward(self, q_BSHD, k_BSKD, v_BSKD, seg_BS, spans_H, pos_BS, codes, out_BSHD,
               lse_BSH, dout_BSHD):
    """(dq, dk, dv) in the dtypes of q, k, v, global arrays."""
    q_spec, kv_spec, _ = self.specs or (None,) * 3
    lse_spec = None if q_spec is None else P(*q_spec[:3])

    def per_device(q, k, v, out, lse, dout, *optional):
      seg, spans, pos, codes_d = _split_optional(optional, seg_BS, spans_H, pos_BS, codes)
      # The ring's pass with the global (merged) out and lse gives exactly its keys' share.
      dq, dk, dv, *code_grads = self.strategy.backward(q, k, v, seg, out, lse, dout, spans,
                                                       codes_d)
      if code_grads:  # SparseK's thresholds and scores (float32, as they came)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *code_grads
      if self.sinks is not None:
        plan, order, axes, seg, pos, windows, cap = self._sink_args(q, seg, pos, spans)
        dq_s, dk_s, dv_s = sinks.backward(plan, order, axes, q, k, v, seg, pos, windows, cap,
                                          out, lse, dout)
        dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
      return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    code_specs = ()
    if self.strategy.sparsek_window is not None:
      code_specs = self._optional_specs(None, None, None, codes)
    run = self._on_devices(
        per_device, (q_spec, kv_spec, kv_spec, q_spec, lse_spec, q_spec)
        + self._optional_specs(seg_BS, spans_H, pos_BS, codes),
        (q_spec, kv_spec, kv_spec) + code_specs)
    return run(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BSH, dout_BSHD,
               *_optionals(seg_BS, spans_H, pos_BS, codes))


def _if(optional, value) -> tuple:
  """(value,) when an optional operand (segment ids, spans, positions) is given, else ()."""
  return () if optional is None else (value,)


def _optionals(seg_BS, spans_H, pos_BS, codes) -> tuple:
  """The optional operands given, in `_optional_specs`' order."""
  return (*_if(seg_BS, seg_BS), *_if(spans_H, spans_H), *_if(pos_BS, pos_BS),
          *(() if codes is None else codes))


def _split_optional(operands, seg_BS, spans_H, pos_BS, codes):
  """(segment ids, spans, positions, codes) of a device from the optional operands given,
  None for the rest."""
  operands = list(operands)
  seg, spans, pos = (operands.pop(0) if x is not None else None
                     for x in (seg_BS, spans_H, pos_BS))
  return seg, spans, pos, None if codes is None else tuple(operands)


def _pair(q_codes_BSH, k_codes_BSK):
  return None if q_codes_BSH is None else (q_codes_BSH, k_codes_BSK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(q_BSHD, k_BSKD, v_BSKD, seg_BS, spans_H, pos_BS, q_codes_BSH, k_codes_BSK,
               passes: _Passes):
  return passes.forward(q_BSHD, k_BSKD, v_BSKD, seg_BS, spans_H, pos_BS,
                        _pair(q_codes_BSH, k_codes_BSK))[0]


def _attention_fwd(q_BSHD, k_BSKD, v_BSKD, seg_BS, spans_H, pos_BS, q_codes_BSH, k_codes_BSK,
                   passes: _Passes):
  codes = _pair(q_codes_BSH, k_codes_BSK)
  out_BSHD, lse_BSH = passes.forward(q_BSHD, k_BSKD, v_BSKD, seg_BS, spans_H, pos_BS, codes)
  # Named so that a remat policy can keep them (SAVED_NAMES); the output is saved in q's
  # dtype (what the caller holds anyway), lse in float32.
  out_BSHD = checkpoint_name(out_BSHD, SAVED_NAMES[0])
  lse_BSH = checkpoint_name(lse_BSH, SAVED_NAMES[1])
  return out_BSHD, (q_BSHD, k_BSKD, v_BSKD, seg_BS, spans_H, pos_BS, codes, out_BSHD, lse_BSH)


def _attention_bwd(passes: _Passes, residuals, dout_BSHD):
  # Integer segment ids, spans, positions and bucket codes get no cotangent; SparseK's float
  # thresholds and scores do.
  dq, dk, dv, *code_grads = passes.backward(*residuals, dout_BSHD)
  return dq, dk, dv, None, None, None, *(code_grads or (None, None))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_shapes(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS) -> None:
  batch, seq_len, num_heads, head_dim = q_BSHD.shape
  num_kv = k_BSKD.shape[2]
  if (k_BSKD.shape != v_BSKD.shape or k_BSKD.shape[:2] != (batch, seq_len)
      or k_BSKD.shape[3] != head_dim):
    raise ValueError(f"k {k_BSKD.shape} and v {v_BSKD.shape} must be [B, S, Hkv, D] "
                     f"matching q {q_BSHD.shape}")
  if segment_ids_BS is not None and segment_ids_BS.shape != (batch, seq_len):
    raise ValueError(f"segment_ids {segment_ids_BS.shape} must be [B, S] = {(batch, seq_len)}")
  if num_heads % num_kv:
    raise ValueError(f"query heads ({num_heads}) must be divisible by kv heads ({num_kv})")


def operand_specs(mesh, rules: Rules, q_shape, num_kv: int) -> tuple[P, P, P]:
  """PartitionSpecs of q/out, k/v and segment ids from the rules table (mesh axes the mesh
  lacks are dropped); checks that batch and heads divide over them."""
  specs = [spec_on_mesh(logical_to_spec(names, rules), mesh)
           for names in (Q_NAMES, KV_NAMES, SEGMENT_NAMES)]
  q_spec = specs[0]
  batch, _, num_heads, _ = q_shape
  for what, size, axes in (("batch", batch, q_spec[0]), ("query heads", num_heads, q_spec[2]),
                           ("kv heads", num_kv, q_spec[2])):
    shards = math.prod(mesh.shape[a] for a in as_axes(axes))
    if size % shards:
      raise ValueError(f"{what} ({size}) must be divisible by the mesh axes {as_axes(axes)} "
                       f"they shard over (size {shards})")
  return tuple(specs)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                   *, layout: str, mesh=None, rules: Rules | None = None, kernel: str = "auto",
                   tile_size: int = 512, strategy: str = "ring",
                   window: int | None = None, softcap: float = 0.0,
                   spans: jax.Array | None = None, narrowest: int | None = None,
                   positions: jax.Array | None = None, sink_tokens: int = 0,
                   q_buckets: jax.Array | None = None,
                   k_buckets: jax.Array | None = None,
                   q_thresholds: jax.Array | None = None,
                   k_scores: jax.Array | None = None,
                   sparsek_window: int = 0) -> jax.Array:
  """Causal attention, exact, of q [B,S,Hq,D] on k/v [B,S,Hkv,D] sharded along S in `layout`.

  The sequence axis holds the tokens in the order of `layout` (`parallelism.layouts`) over
  the mesh axes that `rules` maps `activation_seq` to (the ring's, then for `strategy`
  ulysses or hybrid the all-to-all's; `parallelism.strategies`). Query i sees key j iff j's original
  position is not after i's (and, with a `window` of w keys, fewer than w before it:
  `parallelism.tiles`) and their segment ids match (`segment_ids=None`: one document
  per row). `softcap` > 0 caps the logits at `softcap * tanh(logit / softcap)` (Gemma 2).
  Per-head spans (MoA): `spans` [Hq] int32 (may be traced: a scanned layer's) gives each query
  head its own window, between the static `narrowest` and `window` (the widest), which the
  schedule is built for.
  `sink_tokens` k > 0 (a local layer's, with `positions` [B,S], the in-document positions):
  keys at positions below k also stay visible to every later query of their segment beyond
  the window (`parallelism.sinks`, off the ring).
  Hash attention (SCFA): bucket codes `q_buckets` [B,S,Hq] and `k_buckets` [B,S,Hkv] (int,
  in the layout's order, as q and k) also require query head h's code to equal the key's
  code of its kv head; they travel with K/V and mask every computed tile (xla kernel).
  SparseK: thresholds `q_thresholds` [B,S,Hq] and scores `k_scores` [B,S,Hkv] (float, in the
  layout's order) weigh key j by clip(score_j - threshold_i, 0, 1) unless it is fewer than
  `sparsek_window` positions back (then 1), differentiably (`parallelism.kernel_sparsek`;
  xla kernel, ring strategy); the scores travel with K/V.
  Batch and heads shard as `rules` map `activation_batch` and
  `activation_heads`/`activation_kv_heads` (no rules: `DEFAULT_RULES`). `mesh=None` uses
  the mesh set by `jax.set_mesh`, or, when none is set, computes locally as one block.
  Without a mesh the row must be in its original order (a ring of one holds it unpermuted).
  `tile_size` is clipped to the per-device block. Returns out [B,S,Hq,D] in q's dtype.
  """
  kernels.check_name(kernel)  # an unknown name fails here, before any tracing
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown sequence-parallel strategy '{strategy}'; choose one of "
                     f"{STRATEGIES}")
  rules = rules or DEFAULT_RULES
  _check_shapes(q, k, v, segment_ids)
  segment_ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
  spans = None if spans is None else jnp.asarray(spans, jnp.int32)
  if spans is not None and (narrowest is None or spans.shape != (q.shape[2],)):
    raise ValueError(f"per-head spans {spans.shape} must be [query heads] = [{q.shape[2]}], "
                     f"with narrowest= and window= the narrowest and widest of them")
  sink_plan = _sink_plan(sink_tokens, positions, window, _narrowest(spans, narrowest),
                         q.shape[:2])
  positions = None if sink_plan is None else positions.astype(jnp.int32)
  codes = _bucket_codes(q_buckets, k_buckets, q.shape, k.shape, sink_plan)
  sparsek = _sparsek_codes(q_thresholds, k_scores, q.shape, k.shape, sink_plan, codes,
                           window is not None or softcap or spans is not None)
  codes = codes or sparsek
  q_buckets, k_buckets = codes or (None, None)
  sparsek_window = None if sparsek is None else sparsek_window
  context_mesh = mesh is None
  mesh = jax.sharding.get_abstract_mesh() if context_mesh else mesh
  seq_len = q.shape[1]
  if context_mesh and mesh.empty:
    # No mesh anywhere (a single-device script, model.init outside a mesh): one block, local.
    local = local_strategy(layout, seq_len, tile_size, kernel, q.shape, k.shape, q.dtype,
                           window, softcap, _narrowest(spans, narrowest), codes is not None,
                           sparsek_window)
    return _attention(q, k, v, segment_ids, spans, positions, q_buckets, k_buckets,
                      _Passes(local, sinks=sink_plan))
  specs = operand_specs(mesh, rules, q.shape, k.shape[2])
  passes = _Passes(split_attention(strategy, layout, seq_len, tile_size, kernel, mesh, rules,
                                   q.shape[2], k.shape[2], q.shape[3], q.dtype,
                                   window=window, softcap=softcap,
                                   narrowest=_narrowest(spans, narrowest),
                                   buckets=codes is not None,
                                   sparsek_window=sparsek_window),
                   None if context_mesh else mesh, specs, sink_plan)
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return _attention(q, k, v, segment_ids, spans, positions, q_buckets, k_buckets, passes)
  # Explicit-sharding meshes make shard_map demand inputs already laid out as in_specs;
  # the output goes back to q's sharding so the caller sees the type it passed in.
  out_spec = jax.typeof(q).sharding.spec
  q_spec, kv_spec, seg_spec = specs
  q, k, v = (jax.reshard(x, _sharding(mesh, spec))
             for x, spec in ((q, q_spec), (k, kv_spec), (v, kv_spec)))
  if segment_ids is not None:
    segment_ids = jax.reshard(segment_ids, _sharding(mesh, seg_spec))
  if spans is not None:
    spans = jax.reshard(spans, _sharding(mesh, P(q_spec[2])))
  if positions is not None:
    positions = jax.reshard(positions, _sharding(mesh, seg_spec))
  if codes is not None:
    q_buckets = jax.reshard(q_buckets, _sharding(mesh, P(*q_spec[:3])))
    k_buckets = jax.reshard(k_buckets, _sharding(mesh, P(*kv_spec[:3])))
  return jax.reshard(_attention(q, k, v, segment_ids, spans, positions, q_buckets, k_buckets,
                                passes), _sharding(mesh, out_spec))


def _bucket_codes(q_buckets, k_buckets, q_shape, k_shape, sink_plan):
  """(queries', keys') bucket codes as int32, or None without hash attention."""
  if q_buckets is None and k_buckets is None:
    return None
  if (q_buckets is None or k_buckets is None or tuple(q_buckets.shape) != tuple(q_shape[:3])
      or tuple(k_buckets.shape) != tuple(k_shape[:3])):
    raise ValueError(f"bucket codes need both q_buckets [B, S, Hq] = {tuple(q_shape[:3])} and "
                     f"k_buckets [B, S, Hkv] = {tuple(k_shape[:3])}")
  if sink_plan is not None:
    raise ValueError("bucket codes (hash attention) do not combine with sink tokens")
  return q_buckets.astype(jnp.int32), k_buckets.astype(jnp.int32)


def _sparsek_codes(q_thresholds, k_scores, q_shape, k_shape, sink_plan, buckets, local):
  """(queries' thresholds, keys' scores) as float32, or None without SparseK."""
  if q_thresholds is None and k_scores is None:
    return None
  if (q_thresholds is None or k_scores is None
      or tuple(q_thresholds.shape) != tuple(q_shape[:3])
      or tuple(k_scores.shape) != tuple(k_shape[:3])):
    raise ValueError(f"SparseK needs both q_thresholds [B, S, Hq] = {tuple(q_shape[:3])} and "
                     f"k_scores [B, S, Hkv] = {tuple(k_shape[:3])}")
  if sink_plan is not None or buckets is not None or local:
    raise ValueError("SparseK's thresholds do not combine with sink tokens, bucket codes, a "
                     "local window, per-head spans or a soft cap (its kernel applies none)")
  return q_thresholds.astype(jnp.float32), k_scores.astype(jnp.float32)


def _sink_plan(sink_tokens: int, positions, window: int | None, narrowest: int | None,
               row_shape) -> sinks.SinkPlan | None:
  """The sink path of a local layer, or None where no query can need one."""
  if sink_tokens < 0:
    raise ValueError(f"sink_tokens={sink_tokens} must be >= 0 (0: none)")
  if not sink_tokens:
    return None
  if window is None:
    raise ValueError("sink tokens need a window (a local layer): a causal layer already "
                     "sees every earlier key")
  if positions is None or tuple(positions.shape) != tuple(row_shape):
    raise ValueError(f"sink tokens need positions [B, S] = {tuple(row_shape)} (in-document "
                     f"positions, which say which keys are sinks)")
  plan = sinks.SinkPlan(sink_tokens, window, narrowest or window)
  return plan if plan.capacity(row_shape[1]) else None


def _narrowest(spans, narrowest: int | None) -> int | None:
  """The schedule's narrowest span: only with per-head spans."""
  return None if spans is None else narrowest


def _sharding(mesh, spec: P):
  """A NamedSharding on a concrete mesh; a bare spec for the context's abstract mesh."""
  return NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
