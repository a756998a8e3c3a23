"""SparseK attention (issue #38; model/sparsek.py, parallelism/kernel_sparsek.py): the operator
and its prefix thresholds, per query and every prefix at once (model/sparsek_prefixes.py),
against a brute-force float64 solve (values and gradients); the soft-masked ring against a
dense reference given the same thresholds and scores (forward, lse, gradients of q, k, v,
thresholds and scores) in ring, striped and zigzag on 1-8 devices, GQA, packed documents,
rows that see nothing; tile skipping; the model's dense and zigzag paths; config errors are
one line.

Tolerances as tests/test_ring_attention.py (`F32_TOL`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import sparsek as sk
from parallelism import kernel_sparsek, kernel_xla
from parallelism.layouts import permute, unpermute
from parallelism.masks import Mask, MaskSpec
from parallelism.schedule import ring_schedule
from tests.test_hash_attention import assert_one_line_config_error
from attention_helpers import F32_TOL, make_inputs, seq_mesh

K, WINDOW = 4, 3  # keys kept per query, keys always seen (itself and the two before)


def brute_threshold(z, k):
  """SparseK's threshold of z (float64): the root of sum clip(z - t, 0, 1) = k found on the
  breakpoints of that piecewise-linear sum; the middle of a flat stretch (the k largest 1 or
  more above the rest: the sum is k all along it); -inf with k entries or fewer."""
  z = np.asarray(z, np.float64)
  if z.size <= k:
    return -np.inf
  top = np.sort(z)[::-1]
  if top[k - 1] - 1.0 >= top[k]:
    return 0.5 * (top[k] + top[k - 1] - 1.0)
  mass = lambda t: np.clip(z - t, 0.0, 1.0).sum()
  points = np.unique(np.concatenate([z, z - 1.0]))
  for a, b in zip(points[:-1], points[1:]):
    if mass(a) >= k >= mass(b) and mass(a) > mass(b):
      return a + (mass(a) - k) / (mass(a) - mass(b)) * (b - a)
  raise AssertionError("no root")


def brute_mask_and_jacobian(z, k):
  """(mask, d mask / d z) of SparseK(z, k) in float64 from the brute-force threshold."""
  tau = brute_threshold(z, k)
  gap = np.asarray(z, np.float64) - tau
  support = (gap > 0) & (gap < 1)
  jac = np.diag(support.astype(np.float64))
  if support.any():
    jac -= np.outer(support, support) / support.sum()
  return np.clip(gap, 0.0, 1.0), jac


def test_the_operator_is_the_capped_simplex_projection_with_its_gradient():
  """Values and the Jacobian (diag(s) - s s^T / |s|) of the mask against the brute-force
  solve, on random vectors of two scales, ties, and one where k scores stand over 1 above the
  rest (a flat stretch of thresholds: the mask is 0/1 and its gradient 0); with n <= k every
  entry is kept."""
  rng = np.random.default_rng(0)
  cases = np.stack([rng.standard_normal(8) * 2, rng.standard_normal(8) / 4, np.zeros(8),
                    [3.0, 2.5, 2.2, -1.0, -2.0, -1.5, -3.0, -1.2]]).astype(np.float32)
  masks, jacobians = jax.jit(jax.vmap(lambda z: (sk.sparsek(z, 3),
                                                 jax.jacrev(sk.sparsek)(z, 3))))(cases)
  for z, got, got_jac in zip(cases, masks, jacobians):
    mask, jac = brute_mask_and_jacobian(z, 3)
    np.testing.assert_allclose(got, mask, atol=2e-6)
    np.testing.assert_allclose(np.sum(got), 3.0, rtol=1e-6)
    np.testing.assert_allclose(got_jac, jac, atol=1e-6)
  np.testing.assert_array_equal(jax.jit(sk.sparsek, static_argnums=1)(cases[0, :3], 3), 1.0)


def test_flat_stretches_take_the_middle_with_gradient_0():
  """Where the k largest scores stand 1 or more above the rest, tau is the stretch's middle
  and its gradient 0; float32 rounding once left it at the upper edge, the edge key's gap
  just below 1 and the gradient 1 there (issue #57's row, the last). Per-query thresholds as
  the model solves them, against the float64 solve on random rows of coarse scores (many
  flat), one row per batch entry."""
  rng = np.random.default_rng(57)
  rows = (np.round(rng.standard_normal((512, 23)) * 8 / 0.7) * 0.7).astype(np.float32)
  issue = (np.random.default_rng(0).standard_normal((2, 512, 2)) * 2).astype(np.float32)
  rows = np.concatenate([rows, issue[None, 1, 150:173, 1]])

  @jax.jit
  def solve(u_BS):  # Each row's one query, at its last position, sees the whole row.
    tau_B1, vjp = jax.vjp(lambda u: sk.decode_thresholds(
        u[..., None], jnp.full(len(rows), 22), 8, 0), u_BS)
    return tau_B1[:, 0], vjp(jnp.ones_like(tau_B1))[0]

  tau, grad = (np.asarray(x) for x in solve(rows))
  flat = 0
  for z, got_tau, got_grad in zip(rows, tau, grad):
    want = brute_threshold(z, 8)
    gap = z.astype(np.float64) - want
    np.testing.assert_allclose(got_tau, want, atol=2e-6)
    if np.min(np.abs(np.concatenate([gap, gap - 1.0]))) < 1e-5:
      continue  # A kink: the gradient is undefined there.
    support = (gap > 0) & (gap < 1)
    flat += not support.any()
    np.testing.assert_allclose(got_grad, support / max(support.sum(), 1), atol=1e-6)
  assert flat > 150
  assert abs(tau[-1] - 0.96254) < 1e-4 and not grad[-1].any()  # Was 0.97549, 1 on one key.


@functools.partial(jax.jit, static_argnums=(2, 3))
def _thresholds_and_vjp(u, seg, k, window, g):
  tau, vjp = jax.vjp(lambda u: sk.prefix_thresholds(u, seg, k, window), u)
  return tau, vjp(jnp.where(jnp.isfinite(tau), g, 0.0))[0]


def test_prefix_thresholds_per_query_and_document():
  """Query i's candidates are its document's keys at least WINDOW back; its mask over them
  and the VJP of its threshold (1/|S| on the support) match the brute force, per kv head."""
  rng = np.random.default_rng(1)
  seg = np.zeros((2, 24), np.int32)
  seg[0, 9:] = 1
  u = rng.standard_normal((2, 24, 2)).astype(np.float32)
  g = rng.standard_normal(u.shape).astype(np.float32)
  tau, du = _thresholds_and_vjp(u, seg, K, WINDOW, g)
  want_du = np.zeros(u.shape)
  for b, i, h in np.ndindex(u.shape):
    cand = [j for j in range(24) if j <= i - WINDOW and seg[b, j] == seg[b, i]]
    if len(cand) <= K:
      assert tau[b, i, h] == -np.inf
      continue
    mask, _ = brute_mask_and_jacobian(u[b, cand, h], K)
    np.testing.assert_allclose(np.clip(u[b, cand, h] - tau[b, i, h], 0, 1), mask, atol=2e-6)
    support = (mask > 0) & (mask < 1)
    if support.any():
      want_du[b, np.asarray(cand)[support], h] += g[b, i, h] / support.sum()
  np.testing.assert_allclose(du, want_du, atol=1e-5)
  # On 4 devices in zigzag each device solves its own queries over the gathered scores: the
  # same thresholds, and the same gradient back through the gather.
  from parallelism import per_query  # pylint: disable=g-import-not-at-top
  perm = functools.partial(permute, layout="zigzag", num_shards=4)
  with jax.set_mesh(seq_mesh(4)):
    split = jax.jit(lambda u, g: jax.vjp(lambda u: per_query(
        lambda u, seg, index, seg_q: sk.thresholds(
            sk.row_mask(sk.spec_of(K, WINDOW), u, seg, index, seg_q)), u, perm(seg),
        layout="zigzag", num_shards=4, rules=(("activation_seq", "sequence"),)), u)[1](g)[0])
    split_du = split(perm(u), perm(np.where(np.isfinite(tau), g, 0.0)))
  np.testing.assert_allclose(unpermute(np.asarray(split_du), "zigzag", 4), want_du, atol=1e-5)


def sorted_brute_threshold(z, k):
  """`brute_threshold` in O(n log n): the mass at every breakpoint from sorted prefix sums."""
  z = np.sort(np.asarray(z, np.float64))
  if z.size <= k:
    return -np.inf
  if z[-k] - 1.0 >= z[-k - 1]:
    return 0.5 * (z[-k - 1] + z[-k] - 1.0)
  sums = np.concatenate([[0.0], np.cumsum(z)])
  t = np.unique(np.concatenate([z, z - 1.0]))
  above, ones = np.searchsorted(z, t, "right"), np.searchsorted(z, t + 1.0, "left")
  mass = z.size - ones + sums[ones] - sums[above] - t * (ones - above)
  i = np.flatnonzero(mass >= k)[-1]
  return t[i] + (mass[i] - k) / (mass[i] - mass[i + 1]) * (t[i + 1] - t[i])


def test_every_prefix_at_once_matches_the_brute_force():
  """Many queries' thresholds come from every prefix of every document solved at once
  (model/sparsek_prefixes.py): values and VJP against the float64 solve, on a row of packed
  documents and one of documents interleaved under arbitrary ids, with a window, smooth and
  coarse scores (ties, flat stretches), queries in a striped device's order (every other
  position, permuted)."""
  rng = np.random.default_rng(54)
  seq, k, window = 512, 8, 5
  seg = np.stack([np.repeat(np.arange(4), [100, 37, 250, 125]),
                  rng.choice([-9, 3, 2**30], seq)]).astype(np.int32)
  u = np.stack([rng.standard_normal((2, seq)) * 2,  # kv head 0 smooth, 1 coarse
                np.round(rng.standard_normal((2, seq)) * 5 / 0.7) * 0.7], -1).astype(np.float32)
  index = np.stack([rng.permutation(np.arange(1, seq, 2)) for _ in range(2)]).astype(np.int32)
  seg_q = np.take_along_axis(seg, index, 1)
  g = rng.standard_normal(index.shape + (2,)).astype(np.float32)
  want, want_du, flat = np.full(g.shape, -np.inf), np.zeros(u.shape), 0
  for b, q, h in np.ndindex(g.shape):
    cand = np.flatnonzero((seg[b] == seg_q[b, q]) & (np.arange(seq) <= index[b, q] - window))
    want[b, q, h] = sorted_brute_threshold(u[b, cand, h], k)
    gap = u[b, cand, h] - want[b, q, h]
    support = (gap > 0) & (gap < 1)
    flat += np.isfinite(want[b, q, h]) and not support.any()
    if np.isinf(want[b, q, h]) or np.min(np.abs(np.concatenate([gap, gap - 1.0]))) < 1e-5:
      g[b, q, h] = 0.0  # No support, or a kink: the gradient is undefined there.
    elif support.any():
      want_du[b, cand[support], h] += g[b, q, h] / support.sum()
  assert np.isinf(want).any() and flat > 20, flat

  @jax.jit
  def solve(u, g):
    mask = lambda u: sk.row_mask(sk.spec_of(k, window), u, seg, index, seg_q)
    tau, vjp = jax.vjp(lambda u: sk._prefix_thresholds(mask(u)), u)
    return tau, vjp(g)[0]

  tau, du = solve(u, g)
  np.testing.assert_allclose(tau, want, atol=2e-6)
  np.testing.assert_allclose(du, want_du, atol=1e-5)


def _weights(index, seg, tau_BSH, u_BSK, window):
  """[B, Hq, Sq, Sk] mask weights of the dense reference, and what is seen (weight > 0)."""
  group = tau_BSH.shape[2] // u_BSK.shape[2]
  behind = index[:, :, None] - index[:, None, :]
  visible = ((behind >= 0) & (seg[:, :, None] == seg[:, None, :]))[:, None]
  near = (behind < window)[:, None]
  u_BHK = jnp.repeat(u_BSK, group, axis=2).transpose(0, 2, 1)[:, :, None, :]
  m = jnp.clip(u_BHK - tau_BSH.transpose(0, 2, 1)[..., None], 0.0, 1.0)
  seen = visible & (near | (m > 0))
  return jnp.where(near, 0.0, jnp.log(jnp.where(m > 0, m, 1.0))), seen


@functools.partial(jax.jit, static_argnames=("window",))
def sparsek_reference(q, k, v, dout, index, seg, tau, u, window=WINDOW):
  """Dense attention with log m added to the logits: (out, dq, dk, dv, dtau, du), lse."""

  def attend(q, k, v, tau, u):
    group = q.shape[2] // k.shape[2]
    kh, vh = (jnp.repeat(x, group, axis=2) for x in (k, v))
    log_m, seen = _weights(index, seg, tau, u, window)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kh, precision="highest") * q.shape[-1] ** -0.5
    s = jnp.where(seen, s + log_m, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.where(seen, jnp.exp(s - top), 0.0)
    total = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(total > 0, total, 1.0), vh,
                     precision="highest")
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + top, -jnp.inf)
    return out, lse[..., 0].transpose(0, 2, 1)

  (out, lse), vjp = jax.vjp(attend, q, k, v, tau, u)
  return (out, *vjp((dout, jnp.zeros_like(lse)))), lse


@functools.cache
def _inputs(num_kv=2, seq_len=64, seed=3, empty=True):
  """Packed rows (row 0: documents [0, 21), [21, 40), [40, S); row 1: one), scores u and
  the exact prefix thresholds; with `empty`, query 5 of head 0 gets a threshold above every
  score and, as a window of 0 leaves it, sees nothing."""
  seg = np.zeros((2, seq_len), np.int32)
  seg[0, 21:40], seg[0, 40:] = 1, 2
  inputs = make_inputs(batch=2, seq_len=seq_len, num_heads=4, num_kv=num_kv, segments=seg,
                       seed=seed)
  u = np.random.default_rng(seed).standard_normal((2, seq_len, num_kv)).astype(np.float32)
  tau = np.repeat(np.asarray(sk.prefix_thresholds(jnp.asarray(u), jnp.asarray(seg), K,
                                                  WINDOW)), 4 // num_kv, axis=2)
  if empty:
    tau[0, 5, 0] = u.max() + 1.0
  return inputs, tau, u


def _spec(window=WINDOW):
  return MaskSpec(sparse="sparsek", sparsek_k=K, sparsek_window=window)



def test_block_kernel_lse_and_tile_skipping():
  """One whole block: lse (-inf where nothing is seen) against dense; the kernel computes
  fewer tiles than causal once thresholds exceed whole tiles' scores, and all of causal's
  when every threshold is -inf (every mask 1)."""
  (q, k, v, dout, index, seg), tau, u = _inputs(num_kv=1)  # the striped test's reference
  schedule = ring_schedule("ring", 64, 1)
  at = dict(schedule=schedule, pair=schedule.pair[0, 0], tile=8)
  out, lse = jax.jit(functools.partial(kernel_xla.block_fwd, **at))(
      q, k, v, Mask.of(_spec(0), seg, scores=(tau, u)))
  _, want_lse = sparsek_reference(q, k, v, dout, index, seg, tau, u, window=0)
  np.testing.assert_allclose(lse, want_lse, **F32_TOL)
  assert lse[0, 5, 0] == -np.inf
  index_T = schedule.pair_index[0][0]
  count = lambda tau, u, w: int(kernel_sparsek.computed_tiles(
      Mask.of(_spec(w), scores=(tau, u)), index_T, index_T, 8))
  causal = int(schedule.computed_tiles(8)[0, 0]) * 2 * 4
  assert count(np.full_like(tau, -np.inf), u, 0) == causal
  # Thresholds of 0 over scores below 0 in the first half: that half is skipped past the window.
  low = np.where(np.arange(64)[None, :, None] < 32, -1.0, 1.0).astype(np.float32)
  low = np.broadcast_to(low, u.shape)
  zero = np.zeros_like(tau)
  assert count(zero, low, 0) < causal and count(zero, low, 8) > count(zero, low, 0)


def test_the_model_dense_and_zigzag_agree():
  """A 1-layer decoder with SparseK (k=4, window 3; packed documents): a zigzag ring on 4
  devices (thresholds solved per device) gives the dense path's logits, and the scorer
  matters (its weights at 0 give other logits). Forward only: the tests above check the
  gradients of the scores through the ring and through the thresholds, per device too."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  from model import Decoder, ModelConfig  # pylint: disable=g-import-not-at-top
  fields = dict(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, vocab_size=61,
                dtype="float32", sparse="sparsek", sparsek_k=K, sparsek_window=WINDOW,
                attention_tile=8)
  rng = np.random.default_rng(4)
  first = np.arange(64) < 29
  batch = [np.asarray(rng.integers(0, 61, (1, 64)), np.int32),
           np.where(first, np.arange(64), np.arange(64) - 29)[None].astype(np.int32),
           np.where(first, 0, 1)[None].astype(np.int32)]
  dense = Decoder(ModelConfig(**fields))
  # Random parameters of the model's shapes, without compiling its init.
  shapes = jax.eval_shape(dense.init, jax.random.key(0), *batch)
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), s.dtype), shapes)

  apply = jax.jit(dense.apply)
  want = np.asarray(apply(params, *batch))
  scorer = params["params"]["blocks"]["attention"]["sparsek_score"]["kernel"]
  unscored = jax.tree.map(lambda x: x, params)
  unscored["params"]["blocks"]["attention"]["sparsek_score"]["kernel"] = scorer.replace_boxed(
      jnp.zeros_like(scorer.value))
  assert np.abs(np.asarray(apply(unscored, *batch)) - want).max() > 1e-3
  zigzag = Decoder(ModelConfig(**fields, attention="zigzag", kernel="xla"))
  mesh = jax.make_mesh((4,), ("sequence",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:4])
  with jax.set_mesh(mesh), nn.logical_axis_rules((("activation_seq", "sequence"),)):
    got = jax.jit(zigzag.apply)(params, *(permute(x, "zigzag", 4) for x in batch))
  np.testing.assert_allclose(unpermute(np.asarray(got), "zigzag", 4), want, **F32_TOL)


@pytest.mark.parametrize("overrides,field", [
    ({"model.sparse": "sparsek"}, "model.sparsek_k=0 must be >= 1"),
    ({"model.sparsek_k": 8}, "but model.sparse='none'"),
    ({"model.sparse": "sparsek", "model.sparsek_k": 8, "model.sparsek_window": -1},
     "model.sparsek_window=-1 must be >= 0"),
    ({"model.sparse": "sparsek", "model.sparsek_k": 8, "model.window": 16},
     "does not combine with local layers"),
    ({"model.sparse": "sparsek", "model.sparsek_k": 8, "model.attention_softcap": 30.0},
     "model.attention_softcap=30 does not combine"),
    ({"model.sparse": "sparsek", "model.sparsek_k": 8, "model.sequence_parallel": "allgather"},
     "model.sequence_parallel='allgather' does not carry SparseK"),
])
def test_config_errors_are_one_line(overrides, field):
  assert_one_line_config_error(overrides, field)
