"""The `cudnn` block kernel and dense cuDNN attention, as far as a CPU can check them.

- The private JAX API they call has, in this JAX, the names, parameters and result shapes
  the kernel uses: the backward primitive is bound for real, under `jax.eval_shape`.
- On a CPU backend `model.kernel=cudnn` is a one-line config error, not a failed compile.
- Their own code around cuDNN is exact: the decomposition of a block pair by mask shape
  (strictly causal as a causal pair shifted by a row, empty pairs, `general` pairs to the
  fallback kernel, the global out handed to the backward) and packed documents as cuDNN's
  packed layout (`parallelism.cudnn_packing`), with the fallback where a call's packing
  cannot express its mask. The ring with `cudnn` matches dense attention in every layout,
  with cuDNN's calls computed by `_ReferenceCudnn` below: the math cuDNN documents
  (FlashAttention-2's log-sum-exp; the backward from the given statistics and output) in
  float32 jnp. This checks the code around cuDNN, not cuDNN; `make gpu_check` checks cuDNN.
"""

import enum
import inspect
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallelism
from parallelism import cudnn_packing, kernel_cudnn, kernel_pallas, kernel_xla
from parallelism.layouts import LAYOUTS
from parallelism.kernel_grads import Merged
from parallelism.masks import Mask, MaskSpec
from parallelism.ring_attention import ring_attention
from parallelism.schedule import ring_schedule
from attention_helpers import (F32_TOL, assert_close, make_inputs, reference,
                                       ring_in_layout, seq_mesh)


def test_the_private_api_it_calls_is_there_on_this_jax():
  assert jax.__version__ in kernel_cudnn.CHECKED_JAX
  api = kernel_cudnn.api()
  assert {api.MaskType.CAUSAL.name, api.MaskType.NO_MASK.name} == {"CAUSAL", "NO_MASK"}
  assert api.AttentionLayout.BTNH.value == 0
  q = jnp.zeros((2, 64, 4, 16), jnp.bfloat16)
  kv = jnp.zeros((2, 64, 2, 16), jnp.bfloat16)
  # The forward's public entry takes the arguments the kernel passes (it needs cuDNN to run).
  inspect.signature(api.dot_product_attention).bind(
      q, kv, kv, scale=0.25, qkv_layout="BTNH", mask_type=api.MaskType.CAUSAL,
      return_residual=True)
  # Its statistics are [B, H, T] float32, as the kernel transposes them.
  _, stats = jax.eval_shape(lambda q, k, v: api._dot_product_attention_fwd_p_wrapper.bind(
      q, k, v, *[jnp.zeros(0, q.dtype)] * 7, scale=0.25, seed=42, dropout_rate=0.0,
      variadic_args=(False, False), mask_type=api.MaskType.CAUSAL, layout=0,
      sliding_window_length=None, is_training=True), q, kv, kv)
  assert (stats.shape, stats.dtype) == ((2, 4, 64), jnp.float32)
  # The backward primitive, bound exactly as the kernel binds it (abstract evaluation).
  lse = jnp.zeros((2, 64, 4), jnp.float32)
  grads = jax.eval_shape(lambda q, k, v, out, dout, lse: kernel_cudnn._grads(
      q, k, v, Merged.of(out, lse, dout), causal=True), q, kv, kv, q, q, lse)
  assert [(g.shape, g.dtype) for g in grads] == [
      (q.shape, jnp.float32), (kv.shape, jnp.float32), (kv.shape, jnp.float32)]


@pytest.fixture
def real_api_without_a_gpu(monkeypatch):
  """JAX's own cuDNN attention module, its device checks answered as an H100 with cuDNN
  9.12 would: argument checks, custom VJPs and abstract evaluation run for real (under
  `jax.eval_shape`; nothing can lower for the CPU)."""
  api = kernel_cudnn.api()
  monkeypatch.setattr(api, "check_cudnn_version", lambda: 91200)
  monkeypatch.setattr(api, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(api, "is_cuda_compute_capability_equal", lambda capability: False)
  return api


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_the_kernel_calls_the_real_api_as_it_takes_them(real_api_without_a_gpu, causal, packed):
  """Forward and backward of a block pair, unpacked and packed, as JAX's API checks and
  shapes them (the CPU emulation below cannot catch an argument JAX rejects)."""
  q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
  seg = jnp.asarray(_packed_rows())

  def forward_and_backward(q, k, v):
    packing = cudnn_packing.block_pair(seg, seg, causal, 16) if packed else None
    out, lse = kernel_cudnn._attend(q, k, v, causal, packing)
    return out, lse, kernel_cudnn._grads(q, k, v, Merged.of(out, lse, out), causal, packing)

  out, lse, grads = jax.eval_shape(forward_and_backward, q, kv, kv)
  assert (out.shape, out.dtype, lse.shape) == (q.shape, jnp.float32, q.shape[:3])
  assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


def test_dense_attention_takes_the_real_api_forward_and_backward(real_api_without_a_gpu):
  q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
  fallback = lambda q, k, v, seg: ring_attention(q, k, v, Mask.of(segment_ids=seg),
                                                 layout="ring", tile_size=64, kernel="xla")

  def loss(q, k, v):
    out = parallelism.cudnn_dense_attention(q, k, v, jnp.asarray(_packed_rows()), fallback)
    return out.astype(jnp.float32).sum()

  grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


def test_another_jax_version_stops_with_a_message(monkeypatch):
  monkeypatch.setattr(jax, "__version__", "0.0.1")
  with pytest.raises(RuntimeError, match=r"checked against JAX .*this is JAX 0\.0\.1"):
    kernel_cudnn.api()


def test_on_the_cpu_cudnn_is_a_config_error(tiny_config):
  from trainer.config.config_check import ConfigError, check_config
  config = tiny_config("striped", **{"model.kernel": "cudnn"})
  with pytest.raises(ConfigError, match=r"model.kernel='cudnn' needs a CUDA GPU; this run's "
                                        r"backend is cpu"):
    check_config(config, 8)


@pytest.fixture
def gpu_backend(monkeypatch):
  """Kernels chosen as for an attached GPU (JAX itself stays on the CPU)."""
  from parallelism import target  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(target, "backend", lambda: "gpu")


@pytest.fixture
def attached_gpu(gpu_backend, monkeypatch):
  """As on a CUDA GPU: cuDNN can run."""
  monkeypatch.setattr(kernel_cudnn, "unusable", lambda *_: None)


def test_another_jax_version_makes_auto_run_pallas_on_a_gpu(gpu_backend, monkeypatch):
  """`auto` is cudnn on a GPU (as measured by `make gpu_check`) only where cuDNN can run: on
  a JAX whose private cuDNN API was not read, the run goes on with pallas and says why."""
  from parallelism import kernels  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(jax, "__version__", "0.0.1")
  chosen, why = kernels.choose("auto", MaskSpec(), (1, 64, 4, 128), (1, 64, 2, 128), 64,
                               jnp.bfloat16)
  assert chosen == "pallas" and "checked against JAX" in why and "this is JAX 0.0.1" in why


def test_auto_on_a_gpu_is_cudnn_where_cudnn_takes_the_blocks(attached_gpu):
  from parallelism import kernels  # pylint: disable=g-import-not-at-top
  q, kv, causal = (1, 64, 4, 128), (1, 64, 2, 128), MaskSpec()
  assert kernels.choose("auto", causal, q, kv, 64, jnp.bfloat16) == ("cudnn", None)
  assert kernels.choose("auto", causal, q, kv, 64, jnp.float32) == (
      "pallas", "the cudnn kernel cannot take these attention blocks (float32 operands: "
      "cuDNN's flash attention takes bf16 or fp16)")
  assert kernels.choose("auto", MaskSpec(softcap=30.0), q, kv, 64, jnp.bfloat16) == (
      "pallas", "the cudnn kernel has no logit soft-capping (model.attention_softcap)")
  hashed = MaskSpec(sparse="hash", hash_buckets=4)
  assert kernels.choose("auto", hashed, q, kv, 64, jnp.bfloat16)[0] == "xla"
  # Schedules with general blocks (a window, zigzag), which the cudnn kernel hands to
  # pallas: auto runs pallas directly. A named cudnn keeps its own dispatch.
  general = ("pallas", "blocks whose masks cuDNN cannot express (a window, zigzag's halves): "
                       "the cudnn kernel would hand them to pallas")
  assert kernels.choose("auto", causal, q, kv, 64, jnp.bfloat16, general=True) == general
  assert kernels.choose("cudnn", causal, q, kv, 64, jnp.bfloat16, general=True) == (
      "cudnn", None)
  # Blocks Triton cannot take (head size 96): the cudnn kernel's pallas branches could not
  # either, so auto runs xla.
  chosen, why = kernels.choose("auto", causal, (1, 64, 4, 96), (1, 64, 2, 96), 64,
                               jnp.bfloat16)
  assert chosen == "xla" and why.startswith("the pallas kernel cannot take these attention")


def test_a_local_global_model_on_a_gpu_states_each_kinds_kernel(attached_gpu, tiny_config):
  from trainer.config import stages  # pylint: disable=g-import-not-at-top
  from trainer.core.training import model_config  # pylint: disable=g-import-not-at-top
  from trainer.run.setup import stage_lines  # pylint: disable=g-import-not-at-top
  from trainer.track.provenance import run_resolved  # pylint: disable=g-import-not-at-top
  config = tiny_config("striped", **{"model.window": 32, "model.layer_pattern": "LG",
                                     "model.dtype": "bfloat16"})
  line = stage_lines(stages.resolve(config)[0], model_config(config), 0)[-1]
  assert line.startswith("attention: striped, block kernel auto on gpu: pallas (blocks whose "
                         "masks cuDNN cannot express")
  assert "for L layers; cudnn for G layers;" in line
  assert run_resolved(config)["attention_kernel"] == "pallas for L layers; cudnn for G layers"
  config.model.layer_pattern = "G"
  config.model.window = 0
  assert run_resolved(config)["attention_kernel"] == "cudnn"


def test_what_goes_to_pallas_whole():
  shape, reason = (1, 64, 4, 128), kernel_cudnn.pallas_reason
  assert reason(shape, jnp.bfloat16) is None
  assert "float32" in reason(shape, jnp.float32)
  assert "head size 256" in reason((1, 64, 4, 256), jnp.bfloat16)


class _ReferenceCudnn:
  """cuDNN's two calls as the kernels use them, in float32 jnp: BTNH, GQA, no mask or causal,
  and the packed layout (sequences by offsets and lengths [B, M(+1)], -1 past a row's last;
  each query sees only its own sequence's keys, causally within it; statistics per sequence,
  [B*M, H, T], sequence s the s-th valid entry in row-major order). What cuDNN leaves
  outside every sequence (outputs, statistics, gradients) is NaN here, so a caller that
  reads it fails."""

  MaskType = enum.Enum("MaskType", "NO_MASK PADDING CAUSAL PADDING_CAUSAL")
  AttentionLayout = enum.Enum("AttentionLayout", [("BTNH", 0)])

  @staticmethod
  def _tokens(length, lengths, offsets):
    """Each token's sequence s (-1 outside all) and index within it."""
    valid = lengths >= 0
    s_BM = (jnp.cumsum(valid.reshape(-1)) - 1).reshape(valid.shape)
    at = jnp.arange(length)
    inside = valid[..., None] & (at >= offsets[:, :-1, None]) & (
        at < (offsets[:, :-1] + lengths)[..., None])
    run = jnp.argmax(inside, axis=1)
    seq = jnp.where(inside.any(1), jnp.take_along_axis(s_BM, run, 1), -1)
    return seq, at - jnp.take_along_axis(offsets[:, :-1], run, 1)

  @classmethod
  def _visible(cls, q_len, k_len, mask_type, packed):
    causal = "CAUSAL" in mask_type.name
    if packed is None:
      visible = jnp.ones((1, q_len, k_len), bool)
      return visible & jnp.tril(visible) if causal else visible, None
    q_seqlen, kv_seqlen, q_offsets, kv_offsets = packed
    assert "PADDING" in mask_type.name and q_offsets.shape[1] == q_seqlen.shape[1] + 1
    q_seq, q_local = cls._tokens(q_len, q_seqlen, q_offsets)
    k_seq, k_local = cls._tokens(k_len, kv_seqlen, kv_offsets)
    visible = (q_seq[:, :, None] == k_seq[:, None, :]) & (q_seq >= 0)[:, :, None]
    if causal:
      visible &= k_local[:, None, :] <= q_local[:, :, None]
    return visible, (q_seq, q_local, k_seq >= 0, q_seqlen.size)

  @staticmethod
  def _packed(q_seqlen, kv_seqlen, q_offsets, kv_offsets):
    return None if q_seqlen is None or q_seqlen.size == 0 else (
        q_seqlen, kv_seqlen, q_offsets, kv_offsets)

  @staticmethod
  def _scores(q, k, scale, visible):
    group = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32),
                   jnp.repeat(k.astype(jnp.float32), group, 2), precision="highest") * scale
    return jnp.where(visible[:, None], s, -jnp.inf), group

  @classmethod
  def dot_product_attention(cls, q, k, v, bias=None, mask=None, q_seqlen=None, kv_seqlen=None,
                            q_offsets=None, kv_offsets=None, *, scale, qkv_layout, mask_type,
                            return_residual=False):
    assert qkv_layout == "BTNH" and bias is None and mask is None
    packed = cls._packed(q_seqlen, kv_seqlen, q_offsets, kv_offsets)
    visible, tokens = cls._visible(q.shape[1], k.shape[1], mask_type, packed)
    s, group = cls._scores(q, k, scale, visible)
    lse_BHT = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse_BHT[..., None])
    out = jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v.astype(jnp.float32), group, 2),
                     precision="highest")
    stats = lse_BHT
    if tokens is not None:
      q_seq, q_local, _, sequences = tokens
      out = jnp.where((q_seq >= 0)[..., None, None], out, jnp.nan)
      lse_BTH = jnp.swapaxes(lse_BHT, 1, 2)
      at = jnp.where(q_seq >= 0, q_seq, sequences)  # out of range: dropped
      stats = jnp.full((sequences, q.shape[2], q.shape[1]), jnp.nan).at[
          at[..., None], jnp.arange(q.shape[2]), q_local[..., None]].set(lse_BTH, mode="drop")
    out = out.astype(q.dtype)
    return (out, stats) if return_residual else out

  @classmethod
  def _backward(cls, q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_k, page_v,
                stats, out, dout, *, scale, seed, dropout_rate, variadic_args, mask_type, layout,
                sliding_window_length):
    assert bias.size == page_k.size == page_v.size == 0
    assert variadic_args == (False, False) and layout == 0
    packed = cls._packed(q_seqlen, kv_seqlen, q_offsets, kv_offsets)
    visible, tokens = cls._visible(q.shape[1], k.shape[1], mask_type, packed)
    s, group = cls._scores(q, k, scale, visible)
    if tokens is None:
      lse_BHT = stats
    else:  # the GLOBAL lse, read where the kernel put it for each query
      q_seq, q_local, k_in, _ = tokens
      lse_BHT = jnp.swapaxes(stats[jnp.maximum(q_seq, 0)[..., None], jnp.arange(q.shape[2]),
                                   q_local[..., None]], 1, 2)
    p = jnp.where(visible[:, None], jnp.exp(s - lse_BHT[..., None]), 0.0)
    q, k, v, out, dout = (x.astype(jnp.float32) for x in (q, k, v, out, dout))
    v_full = jnp.repeat(v, group, 2)
    dp = jnp.einsum("bqhd,bkhd->bhqk", dout, v_full, precision="highest")
    delta = jnp.einsum("bqhd,bqhd->bhq", dout, out, precision="highest")  # from the given out
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(k, group, 2), precision="highest")
    by_kv = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[3]).sum(3)
    dk = by_kv(jnp.einsum("bhqk,bqhd->bkhd", ds, q, precision="highest"))
    dv = by_kv(jnp.einsum("bhqk,bqhd->bkhd", p, dout, precision="highest"))
    if tokens is not None:
      dq = jnp.where((q_seq >= 0)[..., None, None], dq, jnp.nan)
      dk, dv = (jnp.where(k_in[..., None, None], x, jnp.nan) for x in (dk, dv))
    return dq, dk, dv

  def __init__(self):
    self._dot_product_attention_bwd_p_wrapper = types.SimpleNamespace(bind=self._backward)


@pytest.fixture
def reference_cudnn(monkeypatch):
  """The kernels' cuDNN calls computed by `_ReferenceCudnn`, on float32 operands, with the
  Pallas fallback computed by the xla kernel (the CPU has no Triton)."""
  reference_api = _ReferenceCudnn()
  monkeypatch.setattr(kernel_cudnn, "api", lambda: reference_api)
  monkeypatch.setattr(kernel_cudnn, "unusable", lambda *_: None)
  monkeypatch.setattr(kernel_cudnn, "pallas_reason", lambda *_: None)  # float32 in
  monkeypatch.setattr(kernel_cudnn, "kernel_pallas", kernel_xla)
  return reference_api


def test_the_gpu_checks_ring_emulation_runs_cudnn_blocks(reference_cudnn):
  """`make gpu_check`'s ring part times cudnn blocks on a GPU only: here on the reference,
  so that its path cannot first break on a GPU machine's few minutes."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
  import bench_kernel  # pylint: disable=g-import-not-at-top
  rows = []
  bench_kernel.part_ring(kernel_pallas.DEFAULT_CONFIG, [128], 4, 2,
                         record=lambda **row: rows.append(row), kernel="cudnn")
  assert [(r["link"], r["layout"], r["kernel"]) for r in rows] == [
      (link, l, "cudnn") for link in bench_kernel.LINKS for l in LAYOUTS]
  assert all(r["critical_fwd_bwd_s"] > 0 for r in rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_decomposition_by_mask_shape_is_exact(layout, reference_cudnn):
  """N=4, GQA, one document per row: ring has full, causal and empty pairs, striped causal
  and strictly causal ones, zigzag general ones (the fallback kernel, here `xla`)."""
  inputs = make_inputs(seq_len=128, seed=3)
  got = ring_in_layout(layout, seq_mesh(4), *inputs, packed=False, tile_size=8,
                       kernel="cudnn")
  assert_close(got, reference(*inputs), **F32_TOL)


def _packed_rows(batch_rows=((37, 90), (5, 6, 7, 8, 9, 64, 100, 120)), length=128):
  """Rows of documents starting at the given tokens (the first at 0), the last 8 tokens
  padding (id 0) in the first row."""
  seg = np.zeros((len(batch_rows), length), np.int32)
  for row, starts in enumerate(batch_rows):
    for start in starts:
      seg[row, start:] += 1
    seg[row] += 1
  seg[0, -8:] = 0
  return seg


# Zigzag's pairs are a causal diagonal (packed as ring's and striped's; its packing is its
# mask, test_each_pairs_packing_is_its_mask) and `general` pairs, which the kernel hands to
# the fallback whole, segment ids and all, packed or not (the decomposition test above).
@pytest.mark.parametrize("layout, documents_per_call", [("ring", 16), ("striped", 3)])
def test_packed_documents_are_exact_in_every_layout(layout, documents_per_call,
                                                    reference_cudnn, monkeypatch):
  """Packed rows, GQA, N=4: each document a sequence of cuDNN's packed layout per block pair
  (ring: full, causal and empty pairs); with 3 documents per call (striped: causal and
  strictly causal pairs) the pairs of the busy row's block run the fallback kernel and the
  others cuDNN, in one call."""
  monkeypatch.setattr(kernel_cudnn.cudnn_packing, "DOCUMENTS_PER_CALL", documents_per_call)
  inputs = make_inputs(batch=2, seq_len=128, segments=_packed_rows(), seed=4)
  got = ring_in_layout(layout, seq_mesh(4), *inputs, tile_size=8, kernel="cudnn")
  assert_close(got, reference(*inputs), **F32_TOL)


def test_dense_attention_is_cudnn_with_documents_apart(reference_cudnn):
  """`model.attention='dense'` on a CUDA GPU: cuDNN over whole rows, differentiated by its
  own rule; rows of more documents than a call takes run the fallback. Both from one
  compile: the segment ids are an argument and the route is decided at run time."""
  busy = _packed_rows(((37, 90), tuple(range(2, 128, 6))))
  assert (np.diff(busy[1]) != 0).sum() + 1 > cudnn_packing.DOCUMENTS_PER_CALL
  fallback = lambda q, k, v, seg: ring_attention(q, k, v, Mask.of(segment_ids=seg),
                                                 layout="ring", tile_size=8, kernel="xla")

  @jax.jit
  def run(q, k, v, dout, seg):
    out, vjp = jax.vjp(lambda q, k, v: parallelism.cudnn_dense_attention(
        q, k, v, seg, fallback), q, k, v)
    return (out, *vjp(dout))

  for rows in (_packed_rows(), busy):
    q, k, v, dout, index, seg = make_inputs(batch=2, seq_len=128, segments=rows, seed=5)
    assert_close(run(q, k, v, dout, seg), reference(q, k, v, dout, index, seg), **F32_TOL)


# Jitted: one compile per shape, where op-by-op dispatch compiled each of their ops.
_block_pair = jax.jit(cudnn_packing.block_pair, static_argnums=(2, 3))
_whole_rows = jax.jit(cudnn_packing.whole_rows, static_argnums=1)
_visible = jax.jit(_ReferenceCudnn._visible, static_argnums=(0, 1, 2))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_pairs_packing_is_its_mask(layout):
  """For every block pair of a packed row at N=4, cuDNN's view of the packing (same sequence,
  and causal within it where the pair is) is the pair's own mask, token for token, and the
  packing says so (`exact`): the order argument of `cudnn_packing`'s docstring, checked."""
  seg = _packed_rows()
  n, length = 4, seg.shape[1]
  schedule = ring_schedule(layout, length, n)
  blocks = [np.tile(schedule.order[d], (seg.shape[0], 1)) for d in range(n)]  # positions
  checked = set()
  for q_dev in range(n):
    for k_dev in range(n):
      shape = schedule.shapes[schedule.pair[q_dev, (q_dev - k_dev) % n]]
      if shape not in ("full", "causal", "strictly_causal"):
        continue
      q_index, k_index = blocks[q_dev], blocks[k_dev]
      q_seg, k_seg = (np.take_along_axis(seg, x, 1) for x in (q_index, k_index))
      rule = ((k_index[:, None, :] <= q_index[:, :, None]) if shape != "strictly_causal" else
              (k_index[:, None, :] < q_index[:, :, None])) & (
                  k_seg[:, None, :] == q_seg[:, :, None])
      if shape == "strictly_causal":  # queries from row 1 on keys up to row T-2
        q_seg, k_seg, rule = q_seg[:, 1:], k_seg[:, :-1], rule[:, 1:, :-1]
      packing = _block_pair(jnp.asarray(q_seg), jnp.asarray(k_seg), shape != "full", 16)
      visible, _ = _visible(
          q_seg.shape[1], k_seg.shape[1], _ReferenceCudnn.MaskType[
              "PADDING" if shape == "full" else "PADDING_CAUSAL"],
          (packing.q_lengths, packing.kv_lengths, packing.q_offsets, packing.kv_offsets))
      assert bool(packing.exact), (layout, q_dev, k_dev)
      assert bool(packing.any_pair) == rule.any(), (layout, q_dev, k_dev)
      np.testing.assert_array_equal(np.asarray(visible), rule, err_msg=f"{layout} {q_dev} {k_dev}")
      checked.add(shape)
  assert checked == {"full", "causal"} if layout == "ring" else checked >= {"causal"}


def test_the_statistics_round_trip_and_uncovered_queries_see_nothing():
  seg = jnp.asarray(_packed_rows())
  packing = _block_pair(seg, seg, True, 16)
  lse = np.random.default_rng(0).standard_normal((*seg.shape, 4)).astype(np.float32)

  @jax.jit
  def there_and_back(lse, packing):
    stats = cudnn_packing.stats_of_tokens(lse, packing)
    return stats, cudnn_packing.lse_of_tokens(stats, packing)

  stats, lse_again = there_and_back(lse, packing)
  assert stats.shape == (2 * 16, 4, seg.shape[1])
  np.testing.assert_array_equal(lse_again, lse)
  # A pair where document 2 starts one token later among the keys: its first query sees none.
  q_seg = jnp.asarray([[1, 1, 2, 2, 2, 2]])
  k_seg = jnp.asarray([[1, 1, 1, 2, 2, 2]])
  packing = _block_pair(q_seg, k_seg, True, 16)
  assert bool(packing.exact)
  np.testing.assert_array_equal(packing.q_covered, [[1, 1, 0, 1, 1, 1]])
  np.testing.assert_array_equal(packing.q_offsets, [[0, 3] + [-1] * 15])
  np.testing.assert_array_equal(packing.q_lengths, [[2, 3] + [-1] * 14])


def test_what_the_packing_cannot_express_is_not_exact():
  runs = jnp.asarray([[1, 2, 3, 4, 5, 5]])
  assert not bool(_whole_rows(runs, 4).exact)  # 5 documents, 4 per call
  assert bool(_whole_rows(runs, 5).exact)
  split = jnp.asarray([[1, 1, 2, 2, 1, 1]])  # document 1 in two runs: no layout does this
  assert not bool(_whole_rows(split, 16).exact)
  apart = _block_pair(runs, jnp.asarray([[7] * 6]), False, 16)
  assert bool(apart.exact) and not bool(apart.any_pair)  # no document meets itself
