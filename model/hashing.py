"""Hash attention's buckets (SCFA, Pagliardini et al. 2023, after Reformer's LSH).

Each layer and kv head has a fixed random projection R [D, b/2] (unit columns); a vector x
falls in bucket `argmax([xR, -xR])`, one of b. The paper hashes the normalized vectors; the
argmax does not change with a positive scale, so x is hashed as it is. The projection is drawn
once from `HASH_SEED` and never trained, so a run, its resumption and its export all agree.

What is hashed are the roped q and k the attention takes: their dot product is the logit,
so vectors that fall together are the ones with the larger logits (LSH of the angle).
Under GQA a kv head's projection is shared by its query group: a query head's code and its
kv head's key code come from the same R, so "same bucket" compares like with like.

Codes are integers and carry no gradient: the argmax is piecewise constant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

HASH_SEED = 38  # Issue #38; any fixed value: the projection is part of the model's definition.


def projections(num_layers: int, num_kv_heads: int, head_size: int,
                buckets: int) -> np.ndarray:
  """Every layer's projections, [layers, Hkv, D, buckets / 2] float32 with unit columns."""
  rng = np.random.default_rng(HASH_SEED)
  r = rng.standard_normal((num_layers, num_kv_heads, head_size, buckets // 2))
  return (r / np.linalg.norm(r, axis=2, keepdims=True)).astype(np.float32)


def bucket_codes(x_BSHD: jax.Array, proj_KDR: jax.Array) -> jax.Array:
  """The bucket of each token and head, [B, S, H] int32, of q (H = Hq, each query head by
  its kv head's projection) or k (H = Hkv); `proj_KDR` is one layer's [Hkv, D, b/2]."""
  batch, seq, heads, head_size = x_BSHD.shape
  num_kv = proj_KDR.shape[0]
  x_BSKGD = x_BSHD.astype(jnp.float32).reshape(batch, seq, num_kv, heads // num_kv, head_size)
  xr_BSKGR = jnp.einsum("bskgd,kdr->bskgr", x_BSKGD, proj_KDR.astype(jnp.float32),
                        precision="highest")
  codes_BSKG = jnp.argmax(jnp.concatenate([xr_BSKGR, -xr_BSKGR], axis=-1), axis=-1)
  return codes_BSKG.reshape(batch, seq, heads).astype(jnp.int32)
