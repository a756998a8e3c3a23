"""The `pallas` block kernel: fused flash attention of one query block on one key block.

Same contract as `kernel_xla` (see `parallelism.kernels`), written as Pallas kernels: one
forward call and a flash-attention-2 backward in two calls (dK/dV with the key tile fixed,
dQ with the query tile fixed). GPU through the Triton backend; on a CPU backend the same
kernels run in Pallas interpret mode (chosen automatically), which is how the tests check
them. This module sizes the tiles, builds the grids, specs and tables and launches the
programs; what each program computes is `parallelism.kernel_pallas_programs`.

Tile skipping is the static schedule's (`parallelism.schedule`), at this kernel's own tile
sizes: SKIP tiles are never loaded. Segment ids, when given, are an elementwise mask on
every computed tile. GQA: q head h reads kv head h // G; K/V are never repeated.

The metadata tables are padded to powers of 2 (Triton's block shapes) and read by scalar
loads. With per-head spans (`spans_H`) the pair's token indices
(`RingSchedule.pair_index`) come in as two more operands beside the spans.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from parallelism import target
from parallelism.kernel_grads import Grads, Merged
from parallelism.kernel_pallas_programs import dkv_program, dq_program, fwd_program, query_tile
from parallelism.masks import Mask, MaskSpec
from parallelism.schedule import RingSchedule, TileLists

_F32 = jnp.float32


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








def _pow2(n: int) -> int:
  """Triton wants power-of-2 block shapes: tables are padded to them."""
  return 1 << max(0, n - 1).bit_length()


def _pair_tables(lists: TileLists, masks: np.ndarray, pair) -> list[jax.Array]:
  """The pair's rows of the tile lists, then the distinct masks (int8), padded to powers
  of 2 (padding is never read: loops stop at the counts)."""
  out = []
  for table in lists:
    pad = [(0, 0)] + [(0, _pow2(n) - n) for n in table.shape[1:]]
    out.append(jnp.asarray(np.pad(table, pad))[pair])
  out.append(jnp.asarray(np.pad(masks, [(0, _pow2(masks.shape[0]) - masks.shape[0]), (0, 0),
                                        (0, 0)]).astype(np.int8)))
  return out


def _whole(x):
  """BlockSpec of a whole (small) array, the same for every program."""
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)






















def _size(wanted: int, tile: int, length: int, what: str) -> int:
  size = min(wanted, tile, length)
  if length % size:
    raise ValueError(f"{what} length {length} is not divisible by the kernel tile {size}")
  return size


def _interpret() -> bool:
  """The CPU has no Pallas compiler: there the kernels run in interpret mode (not when a
  plan compiles for described GPUs, `parallelism.target`)."""
  return target.backend() == "cpu"


def gpu_unsupported(q_shape, k_shape, tile: int, dtype,
                    config: KernelConfig = DEFAULT_CONFIG) -> str | None:
  """Why these kernels cannot run on a GPU for q [B,Tq,Hq,D] and k [B,Tk,Hkv,D] of `dtype`
  at `tile` (None if they can). Every array a Triton kernel computes on must have a
  power-of-2 size, so the head dim and the tiles (the config's, clipped to `tile` and the
  block; `_size`) must be powers of 2, and each block a whole number of its tiles. Whole
  blocks, GQA groups and tables are padded by Pallas (all checked against the CUDA
  cross-lowering in tests/test_kernel_pallas.py)."""
  config = config.for_operands(dtype)
  len_q, head_dim, len_k = q_shape[1], q_shape[3], k_shape[1]
  problems = [f"head_dim {head_dim} is not a power of 2"] if head_dim & (head_dim - 1) else []
  for name, wanted, length in (("query", (config.fwd_q, config.dkv_q, config.dq_q), len_q),
                               ("key", (config.fwd_k, config.dkv_k, config.dq_k), len_k)):
    for w in sorted(set(wanted)):
      try:
        size = _size(w, tile, length, name)
      except ValueError as error:  # The block is not a whole number of tiles.
        problems.append(str(error))
        continue
      if size & (size - 1):
        problems.append(f"the {name} tile {size} is not a power of 2")
  return "; ".join(dict.fromkeys(problems)) or None


def _check_shapes(q_shape, k_shape, tile: int, dtype, config: KernelConfig) -> None:
  reason = None if _interpret() else gpu_unsupported(q_shape, k_shape, tile, dtype, config)
  if reason:
    raise ValueError(f"model.kernel='pallas' cannot run these attention blocks: {reason}; "
                     f"use 'auto' (xla for such blocks) or 'xla'")


def _call(kernel, grid, in_specs, out_specs, out_shape, warps: int, stages: int, name: str):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=_interpret(), name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))


def _q_grid_specs(num_q: int, block_q: int, head_dim: int):
  """Specs of per-query-tile operands for grid (query tile, b, q head), tiles last-first:
  [B,T,H,D] tile, [B,T,H] tile (lse, delta), [B,T] tile (segment ids)."""
  tile = lambda i: query_tile(i, num_q)
  return (pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, tile(i), h, 0)),
          pl.BlockSpec((None, block_q, None), lambda i, b, h: (b, tile(i), h)),
          pl.BlockSpec((None, block_q), lambda i, b, h: (b, tile(i))))


def _index_specs(block_q: int, len_k: int, num_q: int):
  """Specs of the pair's token indices for grid (query tile, b, q head): the query tile's,
  the whole key block's."""
  return (pl.BlockSpec((block_q,), lambda i, b, h: (query_tile(i, num_q),)),
          pl.BlockSpec((len_k,), lambda i, b, h: (0,)))


def _after_dense(*groups):
  """The operands after the dense ones and their specs, from (arrays, specs) groups in the
  programs' order (`kernel_pallas_programs._split_refs`): a group whose arrays are None is
  left out (segment ids without documents, spans without per-head spans); a spec of None is
  the whole array."""
  args, specs = [], []
  for arrays, group_specs in groups:
    if arrays is None or arrays[0] is None:
      continue
    args += arrays
    specs += [_whole(x) if spec is None else spec for x, spec in zip(arrays, group_specs)]
  return args, specs


def unsupported(spec: MaskSpec) -> str | None:
  """What of a mask spec these kernels cannot apply (`kernels.choose` runs xla)."""
  if spec.sparse != "none":
    return "the pallas kernel has no run-time mask (model.sparse)"
  return None


def _span_args(schedule: RingSchedule, pair, spans_H):
  """The pair's query and key token indices ([T] int32 each) and the spans padded to a power
  of 2, or None without per-head spans."""
  if spans_H is None:
    return None
  heads = spans_H.shape[0]
  return [*(jnp.asarray(index_PT)[pair] for index_PT in schedule.pair_index),
          jnp.pad(spans_H.astype(jnp.int32), (0, _pow2(heads) - heads))]


def _operands(mask: Mask):
  """(query and key segment ids, per-head spans), each None where the mask has none; a
  ValueError for what it cannot apply."""
  reason = unsupported(mask.spec)
  if reason:
    raise ValueError(f"{reason}: kernels.choose runs xla")
  return mask.q.segment_ids, mask.k.segment_ids, mask.q.spans


def block_fwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, *, schedule: RingSchedule, pair, tile: int,
              index=None, config: KernelConfig = DEFAULT_CONFIG) -> tuple[jax.Array, jax.Array]:
  """Attention of a query block on a key block: (out [B,Tq,Hq,D] f32, lse [B,Tq,Hq] f32)."""
  q_seg_BT, k_seg_BT, spans_H = _operands(mask)
  _check_shapes(q_BTHD.shape, k_BTKD.shape, tile, q_BTHD.dtype, config)
  config = config.for_operands(q_BTHD.dtype)
  batch, len_q, num_heads, head_dim = q_BTHD.shape
  len_k, num_kv = k_BTKD.shape[1], k_BTKD.shape[2]
  block_q = _size(config.fwd_q, tile, len_q, "query")
  block_k = _size(config.fwd_k, tile, len_k, "key")
  tables = schedule.tiles(block_q, block_k)
  num_q, group = len_q // block_q, num_heads // num_kv
  q_spec, stat_spec, seg_spec = _q_grid_specs(num_q, block_q, head_dim)
  kv_spec = pl.BlockSpec((None, len_k, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
  k_row_spec = pl.BlockSpec((None, len_k), lambda i, b, h: (b, 0))
  table_args = _pair_tables(tables.by_query, tables.masks, pair)
  rest, rest_specs = _after_dense(
      ((q_seg_BT, k_seg_BT), (seg_spec, k_row_spec)), (table_args, [None] * len(table_args)),
      (_span_args(schedule, pair, spans_H), (*_index_specs(block_q, len_k, num_q), None)))
  out_shape = [jax.ShapeDtypeStruct(q_BTHD.shape, _F32),
               jax.ShapeDtypeStruct((batch, len_q, num_heads), _F32)]
  kernel = functools.partial(fwd_program, spec=mask.spec, scale=head_dim ** -0.5,
                             block_k=block_k, has_seg=q_seg_BT is not None)
  return _call(kernel, (num_q, batch, num_heads), [q_spec, kv_spec, kv_spec, *rest_specs],
               [q_spec, stat_spec], out_shape, config.fwd_warps, config.fwd_stages,
               "block_fwd")(q_BTHD, k_BTKD, v_BTKD, *rest)


def block_bwd(q_BTHD, k_BTKD, v_BTKD, mask: Mask, merged: Merged, *, schedule: RingSchedule,
              pair, tile: int, index=None, config: KernelConfig = DEFAULT_CONFIG) -> Grads:
  """Gradient contributions (float32) of one query block x key block.

  `merged`'s lse and `delta = sum(dout * out, -1)` are the GLOBAL ones (merged over all key
  blocks), as in `kernel_xla.block_bwd`. dout is cast to q's dtype (the matmul operands).
  """
  q_seg_BT, k_seg_BT, spans_H = _operands(mask)
  _check_shapes(q_BTHD.shape, k_BTKD.shape, tile, q_BTHD.dtype, config)
  batch, len_q, num_heads, head_dim = q_BTHD.shape
  len_k, num_kv = k_BTKD.shape[1], k_BTKD.shape[2]
  group = num_heads // num_kv
  scale = head_dim ** -0.5
  has_seg = q_seg_BT is not None
  span_args = _span_args(schedule, pair, spans_H)
  args = (q_BTHD, k_BTKD, v_BTKD, merged.dout.astype(q_BTHD.dtype), merged.lse.astype(_F32),
          merged.delta.astype(_F32))

  # dK, dV: one program per (key tile, row, kv head), looping over the group's q heads.
  block_k = _size(config.dkv_k, tile, len_k, "key")
  block_q = _size(config.dkv_q, tile, len_q, "query")
  tables = schedule.tiles(block_q, block_k)
  q_spec = pl.BlockSpec((None, len_q, group, head_dim), lambda j, b, h: (b, 0, h, 0))
  k_spec = pl.BlockSpec((None, block_k, None, head_dim), lambda j, b, h: (b, j, h, 0))
  stat_spec = pl.BlockSpec((None, len_q, group), lambda j, b, h: (b, 0, h))
  table_args = _pair_tables(tables.by_key, tables.masks, pair)
  rest, rest_specs = _after_dense(
      ((q_seg_BT, k_seg_BT), (pl.BlockSpec((None, len_q), lambda j, b, h: (b, 0)),
                              pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)))),
      (table_args, [None] * len(table_args)),
      (span_args, (pl.BlockSpec((len_q,), lambda j, b, h: (0,)),
                   pl.BlockSpec((block_k,), lambda j, b, h: (j,)), None)))
  kernel = functools.partial(dkv_program, spec=mask.spec, scale=scale, block_q=block_q,
                             group=group, has_seg=has_seg)
  dk_BTKD, dv_BTKD = _call(
      kernel, (len_k // block_k, batch, num_kv),
      [q_spec, k_spec, k_spec, q_spec, stat_spec, stat_spec, *rest_specs], [k_spec, k_spec],
      [jax.ShapeDtypeStruct(k_BTKD.shape, _F32)] * 2, config.bwd_warps, config.bwd_stages,
      "block_bwd_dkv")(*args, *rest)

  # dQ: one program per (query tile, row, q head), looping over key tiles.
  block_q = _size(config.dq_q, tile, len_q, "query")
  block_k = _size(config.dq_k, tile, len_k, "key")
  tables = schedule.tiles(block_q, block_k)
  num_q = len_q // block_q
  q_spec, stat_spec, seg_spec = _q_grid_specs(num_q, block_q, head_dim)
  kv_spec = pl.BlockSpec((None, len_k, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
  table_args = _pair_tables(tables.by_query, tables.masks, pair)
  rest, rest_specs = _after_dense(
      ((q_seg_BT, k_seg_BT), (seg_spec, pl.BlockSpec((None, len_k), lambda i, b, h: (b, 0)))),
      (table_args, [None] * len(table_args)),
      (span_args, (*_index_specs(block_q, len_k, num_q), None)))
  kernel = functools.partial(dq_program, spec=mask.spec, scale=scale, block_k=block_k,
                             has_seg=has_seg)
  dq_BTHD = _call(kernel, (num_q, batch, num_heads),
                  [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, *rest_specs], q_spec,
                  jax.ShapeDtypeStruct(q_BTHD.shape, _F32), config.bwd_warps,
                  config.bwd_stages, "block_bwd_dq")(*args, *rest)
  return Grads(dq_BTHD, dk_BTKD, dv_BTKD)
