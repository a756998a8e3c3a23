"""The `pallas` block kernel: fused flash attention of one query block on one key block.

Same contract as `kernel_xla` (shapes, GQA pairing, natural-log float32 lse, a query that
sees no key gives out 0 and lse -inf), written as Pallas kernels: one forward call and a
flash-attention-2 backward in two calls (dK/dV with the key tile fixed, dQ with the query
tile fixed). GPU through the Triton backend; on a CPU backend the same kernels run in
Pallas interpret mode (chosen automatically), which is how the tests check them.

Tile skipping: per-tile min/max of token_index and segment ids are taken per batch row
outside the kernels (`tiles.summarize_tiles`); inside, each program calls
`tiles.classify_tile` on the summaries of all the tiles it may visit at once (vectors) and
splits them into three loops: live tiles before the first UNMASKED one, the run of
UNMASKED tiles that follows, and the live tiles after it. The middle loop has no branch and
builds no mask, so Triton pipelines it (on an H100 a branch in every iteration cost
12-17%); the edge loops classify each tile again on its scalars and run SKIP tiles as no-ops
(no load, no matmul), MASKED tiles with the elementwise mask. GQA: q head h reads kv head
h // G; K/V are never repeated.

Kernel tiles are `min(config size, tile)`; finer tiles than the xla kernel's classify at
least as precisely, and the rule is exact at any granularity, so the results agree.
Softmax runs in base 2 (exp2 with log2(e) folded into the scale); lse is converted back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from parallelism import tiles

_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_I32_MAX, _I32_MIN = np.iinfo(np.int32).max, np.iinfo(np.int32).min


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tile sizes and Triton launch parameters (tuned on an H100 by scripts/bench_kernel.py)."""
  fwd_q: int = 128
  fwd_k: int = 128
  fwd_warps: int = 8
  fwd_stages: int = 3
  dkv_k: int = 64   # dK/dV call: key tile per program ...
  dkv_q: int = 64   # ... and the query tiles it loops over
  dq_q: int = 64
  dq_k: int = 64
  bwd_warps: int = 4
  bwd_stages: int = 2

  def for_operands(self, dtype) -> KernelConfig:
    """4-byte operands take twice the shared memory per pipelined tile: the forward's
    128-key, 3-stage K/V pipeline (384 KiB in float32) would exceed an H100's 227 KiB."""
    if jnp.dtype(dtype).itemsize <= 2:
      return self
    return dataclasses.replace(self, fwd_k=min(self.fwd_k, 64))


DEFAULT_CONFIG = KernelConfig()


# HIGHEST keeps float32 operands in IEEE float32 on the GPU (Triton would use tf32);
# bf16 operands are unaffected.
_PRECISION = lax.Precision.HIGHEST


def _dot(a, b, contract_b: int):
  """a @ b (contract_b=0) or a @ b.T (contract_b=1), float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=_PRECISION,
                         preferred_element_type=_F32)


def _dot_tn(a, b):
  """a.T @ b, float32 accumulation."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_PRECISION,
                         preferred_element_type=_F32)


def _summaries(index_BT, seg_BT, size: int, pad_to: int):
  """Per batch row and tile: (index_min, index_max, seg_min, seg_max), each [B, pad_to] int32.

  Rows are flattened into one so `summarize_tiles` summarises each row's tiles on their
  own (tiles never straddle rows). Padding tiles get an empty index range, so the rule
  classifies them SKIP against anything.
  """
  batch, length = index_BT.shape
  flat = tiles.summarize_tiles(index_BT.reshape(1, -1), seg_BT.reshape(1, -1), size)
  pad = [(0, 0), (0, pad_to - length // size)]
  out = []
  for field, fill in zip(flat, (_I32_MAX, _I32_MIN, 0, 0)):
    out.append(jnp.pad(field.reshape(batch, -1).astype(jnp.int32), pad, constant_values=fill))
  return out


def _load_summary(refs, at=None) -> tiles.TileSummary:
  """The summary fields of one tile (`at`), or of all tiles, from their refs."""
  return tiles.TileSummary(*(ref[...] if at is None else ref[at] for ref in refs))


def _loop_bounds(class_N):
  """(lo, u_lo, u_hi, hi) from a class vector: the live tiles are [lo, hi), and
  [u_lo, u_hi) is the run of UNMASKED tiles starting at the first one (empty when none)."""
  n = class_N.shape[0]
  tile_N = jnp.arange(n, dtype=jnp.int32)
  live = class_N != tiles.SKIP
  lo = jnp.min(jnp.where(live, tile_N, n))
  hi = jnp.maximum(lo, jnp.max(jnp.where(live, tile_N + 1, 0)))
  unmasked = class_N == tiles.UNMASKED
  u_lo = jnp.min(jnp.where(unmasked, tile_N, hi))
  # Tiles from hi on are SKIP, so the run ends at hi at the latest.
  u_hi = jnp.min(jnp.where((class_N != tiles.UNMASKED) & (tile_N >= u_lo), tile_N, hi))
  return lo, u_lo, u_hi, hi


def _three_loops(bounds, step, carry):
  """Edge tiles through `step(j, carry, None)` (classify per tile), the UNMASKED run through
  `step(j, carry, True)`; `step` returns the new carry."""
  lo, u_lo, u_hi, hi = bounds
  carry = lax.fori_loop(lo, u_lo, lambda j, c: step(j, c, None), carry)
  carry = lax.fori_loop(u_lo, u_hi, lambda j, c: step(j, c, True), carry)
  return lax.fori_loop(u_hi, hi, lambda j, c: step(j, c, None), carry)


def _visit(cls, compute, carry):
  """An edge tile of class `cls`: SKIP is a no-op, else compute with UNMASKED as a flag
  OR-ed into the mask (one branch rather than three keeps the loop simple)."""
  return lax.cond(cls == tiles.SKIP, lambda c: c,
                  lambda c: compute(cls == tiles.UNMASKED, c), carry)


def _mask(q_idx_t, q_seg_t, k_idx_t, k_seg_t, all_visible):
  """Visibility [tq, tk] OR-ed with the flag `all_visible` (a traced bool)."""
  mask = tiles.visible(q_idx_t[:, None], q_seg_t[:, None], k_idx_t[None, :], k_seg_t[None, :])
  return mask | all_visible


def _fwd_kernel(q_ref, k_ref, v_ref, q_idx_ref, q_seg_ref, k_idx_ref, k_seg_ref, *refs,
                scale: float, block_k: int):
  q_sum_refs, k_sum_refs, (o_ref, lse_ref) = refs[:4], refs[4:8], refs[8:]
  q_sum = _load_summary(q_sum_refs, _query_tile(pl.program_id(0), pl.num_programs(0)))
  bounds = _loop_bounds(tiles.classify_pair(q_sum, _load_summary(k_sum_refs)))
  q_tD = q_ref[...]
  q_idx_t, q_seg_t = q_idx_ref[...], q_seg_ref[...]
  scale2 = scale * _LOG2E  # base-2 logits: exp2(s * log2 e) == exp(s)

  def step(j, carry, unmasked):
    keys = pl.ds(j * block_k, block_k)

    def compute(all_visible, carry):
      m_t, l_t, acc_tD = carry
      k_kD, v_kD = k_ref[keys, :], v_ref[keys, :]
      s_tk = _dot(q_tD, k_kD, 1) * scale2
      if all_visible is not True:
        mask = _mask(q_idx_t, q_seg_t, k_idx_ref[keys], k_seg_ref[keys], all_visible)
        s_tk = jnp.where(mask, s_tk, -jnp.inf)
      m_new = jnp.maximum(m_t, jnp.max(s_tk, axis=1))
      # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p_tk = jnp.exp2(s_tk - m_safe[:, None])
      alpha = jnp.exp2(m_t - m_safe)
      acc_tD = alpha[:, None] * acc_tD + _dot(p_tk.astype(v_kD.dtype), v_kD, 0)
      return m_new, alpha * l_t + jnp.sum(p_tk, axis=1), acc_tD

    if unmasked:
      return compute(True, carry)
    return _visit(tiles.classify_pair(q_sum, _load_summary(k_sum_refs, j)), compute, carry)

  t, d = q_tD.shape
  init = (jnp.full((t,), -jnp.inf, _F32), jnp.zeros((t,), _F32), jnp.zeros((t, d), _F32))
  m_t, l_t, acc_tD = _three_loops(bounds, step, init)
  seen = l_t > 0
  l_safe = jnp.where(seen, l_t, 1.0)
  o_ref[...] = (acc_tD / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m_t + jnp.log2(l_safe)) / _LOG2E, -jnp.inf)


def _bwd_tile(q_tD, k_kD, v_kD, do_tD, lse2_t, delta_t, scale: float, mask_tk):
  """Shared FA-2 backward algebra of one tile pair: (p, ds) in float32."""
  p_tk = jnp.exp2(_dot(q_tD, k_kD, 1) * (scale * _LOG2E) - lse2_t[:, None])
  if mask_tk is not None:
    p_tk = jnp.where(mask_tk, p_tk, 0.0)
  dp_tk = _dot(do_tD, v_kD, 1)
  return p_tk, p_tk * (dp_tk - delta_t[:, None]) * scale


def _lse2(lse_t):
  """Global lse in base 2; -inf (a query that sees nothing) -> +inf so p is 0, not NaN."""
  return jnp.where(lse_t == -jnp.inf, jnp.inf, lse_t * _LOG2E)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_idx_ref, q_seg_ref,
                k_idx_ref, k_seg_ref, *refs, scale: float, block_q: int, group: int):
  q_sum_refs, k_sum_refs, (dk_ref, dv_ref) = refs[:4], refs[4:8], refs[8:]
  k_sum = _load_summary(k_sum_refs, pl.program_id(0))
  bounds = _loop_bounds(tiles.classify_pair(_load_summary(q_sum_refs), k_sum))
  k_kD, v_kD = k_ref[...], v_ref[...]
  k_idx_t, k_seg_t = k_idx_ref[...], k_seg_ref[...]

  def step(g, i, carry, unmasked):
    rows = pl.ds(i * block_q, block_q)

    def compute(all_visible, carry):
      dk_kD, dv_kD = carry
      q_tD, do_tD = q_ref[rows, g, :], do_ref[rows, g, :]
      mask = None
      if all_visible is not True:
        mask = _mask(q_idx_ref[rows], q_seg_ref[rows], k_idx_t, k_seg_t, all_visible)
      p_tk, ds_tk = _bwd_tile(q_tD, k_kD, v_kD, do_tD, _lse2(lse_ref[rows, g]),
                              delta_ref[rows, g], scale, mask)
      dv_kD = dv_kD + _dot_tn(p_tk.astype(do_tD.dtype), do_tD)
      dk_kD = dk_kD + _dot_tn(ds_tk.astype(q_tD.dtype), q_tD)
      return dk_kD, dv_kD

    if unmasked:
      return compute(True, carry)
    return _visit(tiles.classify_pair(_load_summary(q_sum_refs, i), k_sum), compute, carry)

  # The q heads of this kv head's group, one after another (no K/V repeat).
  zeros = jnp.zeros(k_kD.shape, _F32)
  dk_kD, dv_kD = lax.fori_loop(
      0, group, lambda g, c: _three_loops(bounds, functools.partial(step, g), c), (zeros, zeros))
  dk_ref[...], dv_ref[...] = dk_kD, dv_kD


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_idx_ref, q_seg_ref,
               k_idx_ref, k_seg_ref, *refs, scale: float, block_k: int):
  q_sum_refs, k_sum_refs, (dq_ref,) = refs[:4], refs[4:8], refs[8:]
  q_sum = _load_summary(q_sum_refs, _query_tile(pl.program_id(0), pl.num_programs(0)))
  bounds = _loop_bounds(tiles.classify_pair(q_sum, _load_summary(k_sum_refs)))
  q_tD, do_tD = q_ref[...], do_ref[...]
  lse2_t, delta_t = _lse2(lse_ref[...]), delta_ref[...]
  q_idx_t, q_seg_t = q_idx_ref[...], q_seg_ref[...]

  def step(j, dq_tD, unmasked):
    keys = pl.ds(j * block_k, block_k)

    def compute(all_visible, dq_tD):
      k_kD = k_ref[keys, :]
      mask = None
      if all_visible is not True:
        mask = _mask(q_idx_t, q_seg_t, k_idx_ref[keys], k_seg_ref[keys], all_visible)
      _, ds_tk = _bwd_tile(q_tD, k_kD, v_ref[keys, :], do_tD, lse2_t, delta_t, scale, mask)
      return dq_tD + _dot(ds_tk.astype(k_kD.dtype), k_kD, 0)

    if unmasked:
      return compute(True, dq_tD)
    return _visit(tiles.classify_pair(q_sum, _load_summary(k_sum_refs, j)), compute, dq_tD)

  dq_ref[...] = _three_loops(bounds, step, jnp.zeros(q_tD.shape, _F32))


def _query_tile(i, num_q):
  """The query tile of grid step `i`: last-first, because in a causal order the late tiles
  see the most keys, and launching them first evens out the tail of the grid."""
  return num_q - 1 - i


def _size(wanted: int, tile: int, length: int, what: str) -> int:
  size = min(wanted, tile, length)
  if length % size:
    raise ValueError(f"{what} length {length} is not divisible by the kernel tile {size}")
  return size


def _pow2(n: int) -> int:
  """Vector loads in Triton need power-of-2 lengths; summaries are padded to one."""
  return 1 << max(0, n - 1).bit_length()


def _call(kernel, grid, in_specs, out_specs, out_shape, warps: int, stages: int, name: str):
  interpret = jax.default_backend() == "cpu"  # CPU has no Pallas compiler: interpret
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))


def _whole_row(length: int):
  """BlockSpec of a whole [B, L] row (indices, summaries) for grid (tile, b, head)."""
  return pl.BlockSpec((None, length), lambda t, b, h: (b, 0))


def _q_grid_specs(num_q: int, block_q: int, head_dim: int):
  """Specs of per-query-tile operands for grid (query tile, b, q head), tiles last-first:
  [B,T,H,D] tile, [B,T,H] tile (lse, delta), [B,T] tile (index, segment)."""
  tile = lambda i: _query_tile(i, num_q)
  return (pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, tile(i), h, 0)),
          pl.BlockSpec((None, block_q, None), lambda i, b, h: (b, tile(i), h)),
          pl.BlockSpec((None, block_q), lambda i, b, h: (b, tile(i))))


class _QueryTileGrid(NamedTuple):
  """Grid (query tile, b, q head) of the forward and dQ calls, each program looping over
  key tiles: tile counts, the tile summaries and the BlockSpecs of every operand kind."""
  num_q: int
  block_k: int
  sums: tuple  # q then k summaries, as _summaries gives them
  q_spec: pl.BlockSpec  # [B,T,H,D] query tile
  stat_spec: pl.BlockSpec  # [B,T,H] query tile (lse, delta)
  index_spec: pl.BlockSpec  # [B,T] query tile (index, segment)
  kv_spec: pl.BlockSpec  # the whole K/V block of the program's kv head
  k_row_spec: pl.BlockSpec  # the whole [B,Tk] key index / segment row
  sum_specs: list  # the summaries' specs


def _query_tile_grid(q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, block_q: int, block_k: int,
                     head_dim: int, group: int) -> _QueryTileGrid:
  len_q, len_k = q_index_BT.shape[1], k_index_BT.shape[1]
  num_q, num_k = len_q // block_q, len_k // block_k
  sums = (*_summaries(q_index_BT, q_seg_BT, block_q, num_q),
          *_summaries(k_index_BT, k_seg_BT, block_k, _pow2(num_k)))
  q_spec, stat_spec, index_spec = _q_grid_specs(num_q, block_q, head_dim)
  kv_spec = pl.BlockSpec((None, len_k, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
  sum_specs = [*[_whole_row(num_q)] * 4, *[_whole_row(_pow2(num_k))] * 4]
  return _QueryTileGrid(num_q, block_k, sums, q_spec, stat_spec, index_spec, kv_spec,
                        _whole_row(len_k), sum_specs)


def block_fwd(q_BTHD, k_BTKD, v_BTKD, q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, *, tile: int,
              config: KernelConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32)."""
  config = config.for_operands(q_BTHD.dtype)
  batch, len_q, num_heads, head_dim = q_BTHD.shape
  len_k, num_kv = k_BTKD.shape[1], k_BTKD.shape[2]
  g = _query_tile_grid(q_index_BT, q_seg_BT, k_index_BT, k_seg_BT,
                       _size(config.fwd_q, tile, len_q, "query"),
                       _size(config.fwd_k, tile, len_k, "key"), head_dim, num_heads // num_kv)
  in_specs = [g.q_spec, g.kv_spec, g.kv_spec, g.index_spec, g.index_spec, g.k_row_spec,
              g.k_row_spec, *g.sum_specs]
  out_shape = [jax.ShapeDtypeStruct(q_BTHD.shape, _F32),
               jax.ShapeDtypeStruct((batch, len_q, num_heads), _F32)]
  kernel = functools.partial(_fwd_kernel, scale=head_dim ** -0.5, block_k=g.block_k)
  out_BTHD, lse_BTH = _call(kernel, (g.num_q, batch, num_heads), in_specs,
                            [g.q_spec, g.stat_spec], out_shape, config.fwd_warps,
                            config.fwd_stages, "block_fwd")(
      q_BTHD, k_BTKD, v_BTKD, q_index_BT, q_seg_BT, k_index_BT, k_seg_BT, *g.sums)
  return out_BTHD, lse_BTH


def block_bwd(q_BTHD, k_BTKD, v_BTKD, dout_BTHD, lse_BTH, delta_BTH, q_index_BT, q_seg_BT,
              k_index_BT, k_seg_BT, *, tile: int,
              config: KernelConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradient contributions (dq, dk, dv, all float32) of one query block x key block.

  `lse_BTH` and `delta_BTH = sum(dout * out, -1)` are the GLOBAL ones (merged over all key
  blocks), as in `kernel_xla.block_bwd`. dout is cast to q's dtype (the matmul operands).
  """
  batch, len_q, num_heads, head_dim = q_BTHD.shape
  len_k, num_kv = k_BTKD.shape[1], k_BTKD.shape[2]
  group = num_heads // num_kv
  scale = head_dim ** -0.5
  args = (q_BTHD, k_BTKD, v_BTKD, dout_BTHD.astype(q_BTHD.dtype), lse_BTH.astype(_F32),
          delta_BTH.astype(_F32), q_index_BT, q_seg_BT, k_index_BT, k_seg_BT)

  # dK, dV: one program per (key tile, row, kv head), looping over the group's q heads.
  block_k = _size(config.dkv_k, tile, len_k, "key")
  block_q = _size(config.dkv_q, tile, len_q, "query")
  num_q, num_k = len_q // block_q, len_k // block_k
  sums = (*_summaries(q_index_BT, q_seg_BT, block_q, _pow2(num_q)),
          *_summaries(k_index_BT, k_seg_BT, block_k, num_k))
  q_spec = pl.BlockSpec((None, len_q, group, head_dim), lambda j, b, h: (b, 0, h, 0))
  k_spec = pl.BlockSpec((None, block_k, None, head_dim), lambda j, b, h: (b, j, h, 0))
  stat_spec = pl.BlockSpec((None, len_q, group), lambda j, b, h: (b, 0, h))
  k_index_spec = pl.BlockSpec((None, block_k), lambda j, b, h: (b, j))
  in_specs = [q_spec, k_spec, k_spec, q_spec, stat_spec, stat_spec, _whole_row(len_q),
              _whole_row(len_q), k_index_spec, k_index_spec, *[_whole_row(_pow2(num_q))] * 4,
              *[_whole_row(num_k)] * 4]
  out_shape = [jax.ShapeDtypeStruct(k_BTKD.shape, _F32)] * 2
  kernel = functools.partial(_dkv_kernel, scale=scale, block_q=block_q, group=group)
  dk_BTKD, dv_BTKD = _call(kernel, (num_k, batch, num_kv), in_specs, [k_spec, k_spec],
                           out_shape, config.bwd_warps, config.bwd_stages, "block_bwd_dkv")(
      *args, *sums)

  # dQ: one program per (query tile, row, q head), looping over key tiles.
  g = _query_tile_grid(q_index_BT, q_seg_BT, k_index_BT, k_seg_BT,
                       _size(config.dq_q, tile, len_q, "query"),
                       _size(config.dq_k, tile, len_k, "key"), head_dim, group)
  in_specs = [g.q_spec, g.kv_spec, g.kv_spec, g.q_spec, g.stat_spec, g.stat_spec, g.index_spec,
              g.index_spec, g.k_row_spec, g.k_row_spec, *g.sum_specs]
  kernel = functools.partial(_dq_kernel, scale=scale, block_k=g.block_k)
  dq_BTHD = _call(kernel, (g.num_q, batch, num_heads), in_specs, g.q_spec,
                  jax.ShapeDtypeStruct(q_BTHD.shape, _F32), config.bwd_warps,
                  config.bwd_stages, "block_bwd_dq")(*args, *g.sums)
  return dq_BTHD, dk_BTKD, dv_BTKD
