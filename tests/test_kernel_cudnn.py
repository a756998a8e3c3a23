"""The `cudnn` block kernel, as far as a CPU can check it (it has not run on a GPU yet).

- The private JAX API it calls has, in this JAX, the names, parameters and result shapes
  the kernel uses: the backward primitive is bound for real, under `jax.eval_shape`.
- On a CPU backend `model.kernel=cudnn` is a one-line config error, not a failed compile.
- Its decomposition of a block pair by mask shape (strictly causal as a causal pair shifted
  by a row, empty pairs, `general` pairs to the fallback kernel, the global out handed to
  the backward) is exact: the ring with `cudnn` matches dense attention in every layout,
  with cuDNN's two calls computed by `_ReferenceCudnn` below, the math cuDNN documents
  (FlashAttention-2's log-sum-exp; the backward from the given statistics and output) in
  float32 jnp. This checks the kernel's own code around cuDNN, not cuDNN.
"""

import enum
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallelism import kernel_cudnn, kernel_xla
from parallelism.layouts import LAYOUTS
from tests.test_ring_attention import (_F32_TOL, assert_close, make_inputs, reference,
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
  grads = jax.eval_shape(lambda *a: kernel_cudnn._grads(*a, causal=True), q, kv, kv, q, q, lse)
  assert [(g.shape, g.dtype) for g in grads] == [
      (q.shape, jnp.float32), (kv.shape, jnp.float32), (kv.shape, jnp.float32)]


def test_another_jax_version_stops_with_a_message(monkeypatch):
  monkeypatch.setattr(jax, "__version__", "0.0.1")
  with pytest.raises(RuntimeError, match=r"checked against JAX .*this is JAX 0\.0\.1"):
    kernel_cudnn.api()


def test_on_the_cpu_cudnn_is_a_config_error(tiny_config):
  from trainer.config_check import ConfigError, check_config
  config = tiny_config("striped", **{"model.kernel": "cudnn"})
  with pytest.raises(ConfigError, match=r"model.kernel='cudnn' needs a CUDA GPU; this run's "
                                        r"backend is cpu"):
    check_config(config, 8)


def test_what_goes_to_pallas_whole():
  shape, reason = (1, 64, 4, 128), kernel_cudnn.pallas_reason
  assert reason(shape, jnp.bfloat16, False) is None
  assert "segment ids" in reason(shape, jnp.bfloat16, True)
  assert "float32" in reason(shape, jnp.float32, False)
  assert "head size 256" in reason((1, 64, 4, 256), jnp.bfloat16, False)


class _ReferenceCudnn:
  """cuDNN's two calls as the kernel uses them, in float32 jnp (BTNH, GQA, causal or none)."""

  MaskType = enum.Enum("MaskType", "NO_MASK CAUSAL")
  AttentionLayout = enum.Enum("AttentionLayout", [("BTNH", 0)])

  @staticmethod
  def _scores(q, k, scale, mask_type):
    group = q.shape[2] // k.shape[2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, 2), precision="highest") * scale
    if mask_type.name == "CAUSAL":
      s = jnp.where(jnp.tril(jnp.ones(s.shape[2:], bool)), s, -jnp.inf)
    return s, group

  @classmethod
  def dot_product_attention(cls, q, k, v, *, scale, qkv_layout, mask_type, return_residual):
    assert qkv_layout == "BTNH" and return_residual
    s, group = cls._scores(q, k, scale, mask_type)
    lse_BHT = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse_BHT[..., None])
    out = jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, group, 2), precision="highest")
    return out.astype(q.dtype), lse_BHT

  @classmethod
  def _backward(cls, q, k, v, *unused_and_rest, scale, seed, dropout_rate, variadic_args,
                mask_type, layout, sliding_window_length):
    *unused, lse_BHT, out, dout = unused_and_rest
    assert len(unused) == 7 and variadic_args == (False, False) and layout == 0
    s, group = cls._scores(q, k, scale, mask_type)
    p = jnp.exp(s - lse_BHT[..., None])  # the GLOBAL softmax, from the given statistics
    v_full = jnp.repeat(v, group, 2)
    dp = jnp.einsum("bqhd,bkhd->bhqk", dout, v_full, precision="highest")
    delta = jnp.einsum("bqhd,bqhd->bhq", dout, out, precision="highest")  # from the given out
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(k, group, 2), precision="highest")
    by_kv = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[3]).sum(3)
    dk = by_kv(jnp.einsum("bhqk,bqhd->bkhd", ds, q, precision="highest"))
    dv = by_kv(jnp.einsum("bhqk,bqhd->bkhd", p, dout, precision="highest"))
    return dq, dk, dv

  def __init__(self):
    self._dot_product_attention_bwd_p_wrapper = types.SimpleNamespace(bind=self._backward)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_decomposition_by_mask_shape_is_exact(layout, monkeypatch):
  """N=4, GQA, one document per row: ring has full, causal and empty pairs, striped causal
  and strictly causal ones, zigzag general ones (the fallback kernel, here `xla`)."""
  reference_api = _ReferenceCudnn()
  monkeypatch.setattr(kernel_cudnn, "api", lambda: reference_api)
  monkeypatch.setattr(kernel_cudnn, "pallas_reason", lambda *_: None)  # float32 in
  monkeypatch.setattr(kernel_cudnn, "kernel_pallas", kernel_xla)  # CPU: no interpret mode
  inputs = make_inputs(seq_len=128, seed=3)
  got = ring_in_layout(layout, seq_mesh(4), *inputs, packed=False, tile_size=8,
                       kernel="cudnn")
  assert_close(got, reference(*inputs), **_F32_TOL)
