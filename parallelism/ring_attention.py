"""Exact causal attention over a sequence sharded along the mesh: the public entry point.

`ring_attention` runs one strategy (`parallelism.strategies`: ring by default, allgather,
ulysses or hybrid) for a sequence in any layout (`parallelism.layouts`). What each device
computes is the layout's static schedule (`parallelism.schedule`), built on the host once
per compile; no token index is traced, travels or is compared at run time, but for run-time
codes, whose keys travel sorted with their original positions (`parallelism.sorting`).
What a query may see is the call's mask (`parallelism.masks`), one value.

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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parallelism import kernels, masks, sinks
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

  def _specs(self, mask: masks.Mask):
    """(q/out, k/v, lse, the mask's operands) specs; Nones without a mesh."""
    if self.specs is None:
      return None, None, None, jax.tree.map(lambda _: None, mask)
    q_spec, kv_spec, row_spec = self.specs
    return q_spec, kv_spec, P(*q_spec[:3]), mask.specs(q_spec, kv_spec, row_spec)

  def _sink_axes(self) -> tuple:
    """The mesh axes the sink path gathers the row over (`parallelism.sinks`)."""
    return () if self.specs is None else as_axes(self.specs[0][1])

  def forward(self, q_BSHD, k_BSKD, v_BSKD, mask: masks.Mask):
    """(out in q's dtype, lse float32 [B, S, Hq]), global arrays."""
    q_spec, kv_spec, lse_spec, mask_specs = self._specs(mask)

    def per_device(q, k, v, mask_d):
      out, lse = self.strategy.forward(q, k, v, mask_d.on_ring())
      if self.sinks is not None:
        out, lse = sinks.forward(self.sinks, self.strategy.schedule.order.reshape(-1),
                                 self._sink_axes(), q, k, v, mask_d, out, lse)
      return out.astype(q.dtype), lse

    run = self._on_devices(per_device, (q_spec, kv_spec, kv_spec, mask_specs),
                           (q_spec, lse_spec))
    return run(q_BSHD, k_BSKD, v_BSKD, mask)

  def backward(self, q_BSHD, k_BSKD, v_BSKD, mask: masks.Mask, out_BSHD, lse_BSH, dout_BSHD):
    """(dq, dk, dv in the dtypes of q, k, v, the mask's cotangent), global arrays; the
    cotangent is None but for SparseK's float thresholds and scores."""
    q_spec, kv_spec, lse_spec, mask_specs = self._specs(mask)
    selects = mask.spec.selects

    def per_device(q, k, v, out, lse, dout, mask_d):
      # The ring's pass with the global (merged) out and lse gives exactly its keys' share.
      g = self.strategy.backward(q, k, v, mask_d.on_ring(), out, lse, dout)
      dq, dk, dv = g.dq, g.dk, g.dv
      if self.sinks is not None:
        dq_s, dk_s, dv_s = sinks.backward(self.sinks, self.strategy.schedule.order.reshape(-1),
                                          self._sink_axes(), q, k, v, mask_d, out, lse, dout)
        dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
      grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
      return grads + ((g.dq_scores, g.dk_scores) if selects else ())

    score_specs = (lse_spec, None if kv_spec is None else P(*kv_spec[:3])) if selects else ()
    run = self._on_devices(
        per_device, (q_spec, kv_spec, kv_spec, q_spec, lse_spec, q_spec, mask_specs),
        (q_spec, kv_spec, kv_spec) + score_specs)
    dq, dk, dv, *scores = run(q_BSHD, k_BSKD, v_BSKD, out_BSHD, lse_BSH, dout_BSHD, mask)
    # Integer operands (segment ids, positions, codes, spans) get no cotangent; SparseK's
    # float thresholds and scores do.
    dmask = masks.Mask(mask.spec, masks.Side(scores=scores[0]),
                       masks.Side(scores=scores[1])) if scores else jax.tree.map(
                           lambda _: None, mask)
    return dq, dk, dv, dmask


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BSHD, k_BSKD, v_BSKD, mask: masks.Mask, passes: _Passes):
  return passes.forward(q_BSHD, k_BSKD, v_BSKD, mask)[0]


def _attention_fwd(q_BSHD, k_BSKD, v_BSKD, mask: masks.Mask, passes: _Passes):
  out_BSHD, lse_BSH = passes.forward(q_BSHD, k_BSKD, v_BSKD, mask)
  # Named so that a remat policy can keep them (SAVED_NAMES); the output is saved in q's
  # dtype (what the caller holds anyway), lse in float32.
  out_BSHD = checkpoint_name(out_BSHD, SAVED_NAMES[0])
  lse_BSH = checkpoint_name(lse_BSH, SAVED_NAMES[1])
  return out_BSHD, (q_BSHD, k_BSKD, v_BSKD, mask, out_BSHD, lse_BSH)


def _attention_bwd(passes: _Passes, residuals, dout_BSHD):
  return passes.backward(*residuals, dout_BSHD)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_shapes(q_BSHD, k_BSKD, v_BSKD) -> None:
  num_heads, head_dim = q_BSHD.shape[2:]
  num_kv = k_BSKD.shape[2]
  if (k_BSKD.shape != v_BSKD.shape or k_BSKD.shape[:2] != q_BSHD.shape[:2]
      or k_BSKD.shape[3] != head_dim):
    raise ValueError(f"k {k_BSKD.shape} and v {v_BSKD.shape} must be [B, S, Hkv, D] "
                     f"matching q {q_BSHD.shape}")
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


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                   mask: masks.Mask | None = None, *, layout: str, mesh=None,
                   rules: Rules | None = None, kernel: str = "auto", tile_size: int = 512,
                   strategy: str = "ring") -> jax.Array:
  """Causal attention, exact, of q [B,S,Hq,D] on k/v [B,S,Hkv,D] sharded along S in `layout`.

  The sequence axis holds the tokens in the order of `layout` (`parallelism.layouts`) over
  the mesh axes that `rules` maps `activation_seq` to (the ring's, then for `strategy`
  ulysses or hybrid the all-to-all's; `parallelism.strategies`). Query i sees key j as
  `mask` says (`parallelism.masks`: its static spec and its operands, a query side and a key
  side in the layout's order; None: causal, one document per row): j's original position
  not after i's, and as the spec adds, within a window or each head's span, in the same
  document, sinks beyond the window (off the ring: `parallelism.sinks`), equal run-time
  codes (hash attention, QK-dropping) or SparseK's soft weight; logits soft-capped.
  Run-time key operands travel with K/V; SparseK's thresholds and scores get gradients.
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
  _check_shapes(q, k, v)
  if mask is not None and not isinstance(mask, masks.Mask):
    raise TypeError(f"mask must be a parallelism.Mask (e.g. Mask.of(MaskSpec(), segment_ids))"
                    f" or None, not {type(mask).__name__}")
  mask = (mask or masks.Mask()).checked(q.shape, k.shape)
  spec = mask.spec
  sink_plan = _sink_plan(spec, q.shape[1])
  context_mesh = mesh is None
  mesh = jax.sharding.get_abstract_mesh() if context_mesh else mesh
  seq_len = q.shape[1]
  if context_mesh and mesh.empty:
    # No mesh anywhere (a single-device script, model.init outside a mesh): one block, local.
    local = local_strategy(layout, seq_len, tile_size, kernel, q.shape, k.shape, q.dtype, spec)
    return _attention(q, k, v, mask, _Passes(local, sinks=sink_plan))
  specs = operand_specs(mesh, rules, q.shape, k.shape[2])
  passes = _Passes(split_attention(strategy, layout, tile_size, kernel, mesh, rules, q, k,
                                   spec=spec),
                   None if context_mesh else mesh, specs, sink_plan)
  if not any(t == AxisType.Explicit for t in mesh.axis_types):
    return _attention(q, k, v, mask, passes)
  # Explicit-sharding meshes make shard_map demand inputs already laid out as in_specs;
  # the output goes back to q's sharding so the caller sees the type it passed in.
  out_spec = jax.typeof(q).sharding.spec
  q_spec, kv_spec, seg_spec = specs
  q, k, v = (jax.reshard(x, _sharding(mesh, spec))
             for x, spec in ((q, q_spec), (k, kv_spec), (v, kv_spec)))
  mask = jax.tree.map(lambda x, spec: jax.reshard(x, _sharding(mesh, spec)), mask,
                      mask.specs(q_spec, kv_spec, seg_spec))
  return jax.reshard(_attention(q, k, v, mask, passes), _sharding(mesh, out_spec))


def _sink_plan(spec: masks.MaskSpec, seq_len: int) -> sinks.SinkPlan | None:
  """The sink path of a local layer, or None where no query can need one."""
  if not spec.sink_tokens:
    return None
  plan = sinks.SinkPlan(spec.sink_tokens, spec.window, spec.narrowest or spec.window)
  return plan if plan.capacity(seq_len) else None


def _sharding(mesh, spec: P):
  """A NamedSharding on a concrete mesh; a bare spec for the context's abstract mesh."""
  return NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
