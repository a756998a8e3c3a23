"""The mask contract (`parallelism.masks`): `ring_attention` under each mask spec against one
dense reference, over a table of cases (layouts, ring sizes, strategies, kernels, GQA, packed
rows): the output and the gradients of q, k, v and, with SparseK, of its thresholds and
scores. Then the spec's rules, each bad spec in one line naming its field.

The reference is written from the masks' definitions, not from `parallelism.masks`: query i
sees key j (original positions) iff j <= i, they are in the same document, and
- with a window w (per-head spans: head h's w_h), i - j < w; with sink tokens s, also any
  earlier key of the document at an in-document position below s;
- with codes (hash buckets, QK-dropping's flags), the query's code of its head equals the
  key's of its kv head;
- with SparseK, i - j < window or u_j > tau_i; outside the window the key weighs
  m = clip(u_j - tau_i, 0, 1) (log m added to the logit);
and logits are capped at c tanh(logit / c) with a soft cap c. Inputs are made in the
original order, permuted into the layout, and the results unpermuted for comparison.
Tolerance: float32 rounding (tests/test_ring_attention.py's `F32_TOL`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.dropping import drop_codes
from model.hashing import bucket_codes, projections
from model.sparsek import prefix_thresholds
from parallelism.layouts import permute, unpermute
from parallelism.masks import Mask, MaskSpec, Side, problem
from parallelism.ring_attention import ring_attention
from attention_helpers import F32_TOL

HEADS, HEAD_DIM, SINKS = 4, 16, 3
SPANS = (3, 17, 9, 40)  # per query head; GQA 4:2 pairs heads (0, 1) and (2, 3)
RULES = (("activation_seq", ("sequence", "ulysses")),)


@dataclasses.dataclass(frozen=True)
class Case:
  spec: MaskSpec
  layout: str = "striped"
  ring: int = 4
  ulysses: int = 1
  strategy: str = "ring"
  kernel: str = "xla"
  num_kv: int = 2
  packed: bool = True
  seq_len: int = 128

  def __str__(self):
    parts = [self.spec.text.replace(" ", ""), self.layout, f"N{self.ring}", f"S{self.seq_len}"]
    parts += [f"{self.strategy}{self.ulysses}"] * (self.strategy != "ring")
    parts += [self.kernel] * (self.kernel != "xla") + [f"kv{self.num_kv}"]
    return "-".join(parts + ["packed"] * self.packed)


WINDOWED = MaskSpec(window=24, softcap=2.0)
BAND = MaskSpec(window=max(SPANS), narrowest=min(SPANS))
HASH = MaskSpec(sparse="hash", hash_buckets=4)
DROP = MaskSpec(sparse="qk_drop", qk_drop_rate=0.5)
SPARSEK = MaskSpec(sparse="sparsek", sparsek_k=8, sparsek_window=3)
# Plain causal masks in the ring and zigzag layouts are checked against dense in
# tests/test_ring_attention.py, tests/test_strategies.py and tests/test_kernel_cudnn.py;
# here striped on 8 and an uneven ring of 3. Hash attention in striped order is the hybrid
# case's below; striped on 8 is the causal and SparseK cases'.
CASES = [
    Case(MaskSpec(), "striped", 8),
    Case(MaskSpec(), "ring", 3, num_kv=4, packed=False, seq_len=96),
    Case(WINDOWED, "striped"), Case(MaskSpec(window=8), "zigzag", 8, num_kv=1),
    Case(BAND, "ring", 3, seq_len=96), Case(dataclasses.replace(BAND, sink_tokens=SINKS), "zigzag"),
    Case(HASH, "ring"), Case(dataclasses.replace(HASH, window=24), "zigzag", 2, num_kv=1,
                             packed=False),
    Case(DROP, "striped"), Case(SPARSEK, "ring", 2), Case(dataclasses.replace(
        SPARSEK, sparsek_window=0), "striped", 8, num_kv=1),
    # Strategies beyond the ring (tests/test_strategies.py: each with causal masks).
    Case(MaskSpec(window=16, sink_tokens=SINKS), "striped", strategy="allgather"),
    Case(HASH, "striped", 2, 2, "hybrid", num_kv=1),
    Case(MaskSpec(window=1, sink_tokens=SINKS), "zigzag", 2, 2, "hybrid"),
    # The fused kernel (interpreted here; its blocks: tests/test_kernel_pallas.py).
    Case(WINDOWED, "zigzag", kernel="pallas"), Case(BAND, "zigzag", 8, kernel="pallas"),
]


def _row_inputs(case: Case, seed: int = 3):
  """q, k, v, dout (original order), segment ids (row 0: documents [0, 37), [37, 39),
  [39, 90), [90, S); row 1: one) and in-document positions, as the data pipeline packs."""
  rng, length = np.random.default_rng(seed), case.seq_len
  q, dout = (rng.standard_normal((2, length, HEADS, HEAD_DIM), np.float32) for _ in range(2))
  k, v = (rng.standard_normal((2, length, case.num_kv, HEAD_DIM), np.float32) for _ in range(2))
  seg = np.zeros((2, length), np.int32)
  if case.packed:
    seg[0, 37:39], seg[0, 39:90], seg[0, 90:] = 1, 2, 3
  starts = np.maximum.accumulate(
      np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(length), 0), axis=1)
  return q, k, v, dout, seg, (np.arange(length) - starts).astype(np.int32)


# Jitted: one compile, where op-by-op dispatch compiled each of its ops (5x the CPU).
_drop_codes = jax.jit(drop_codes, static_argnums=(0, 1, 2, 3, 4, 6))


def _operands(case: Case, q, k, seg, seed: int = 3):
  """The spec's run-time operands in the original order: codes (queries', keys') or
  SparseK's (thresholds, scores), per-head spans."""
  spec, codes, scores = case.spec, (None, None), (None, None)
  if spec.sparse == "hash":
    proj = jnp.asarray(projections(1, k.shape[2], HEAD_DIM, spec.hash_buckets)[0])
    codes = tuple(np.asarray(bucket_codes(x, proj)) for x in (q, k))
  elif spec.sparse == "qk_drop":
    codes = tuple(np.asarray(c) for c in _drop_codes(2, q.shape[1], HEADS, k.shape[2],
                                                     spec.qk_drop_rate, jnp.int32(0), "ring"))
  elif spec.selects:
    u = (np.random.default_rng(seed).standard_normal(k.shape[:3]) * 2).astype(np.float32)
    tau = np.asarray(prefix_thresholds(jnp.asarray(u), jnp.asarray(seg), spec.sparsek_k,
                                       spec.sparsek_window))
    scores = (np.repeat(tau, HEADS // k.shape[2], axis=2), u)
  spans = jnp.asarray(SPANS, jnp.int32) if spec.head_spans else None
  return codes, scores, spans


def reference(q, k, v, dout, seg, positions, q_codes, k_codes, tau, u, spans, *,
              spec: MaskSpec):
  """Dense attention under `spec` from its definitions: (out, dq, dk, dv, dtau, du); rows
  that see nothing give 0. The spec's numbers go in as operands (a window as wide as the row
  where there is none, no codes as zeros: every code equal), so one compile serves every
  spec of a shape (compiled per spec, the references took nearly twice the CPU)."""
  width = jnp.full((HEADS,), q.shape[1] if spec.window is None else spec.window)
  zeros = lambda n: jnp.zeros((*q.shape[:2], n), jnp.int32)
  return _reference(q, k, v, dout, seg, positions,
                    zeros(HEADS) if q_codes is None else q_codes,
                    zeros(k.shape[2]) if k_codes is None else k_codes, tau, u,
                    width if spans is None else spans, spec.sink_tokens, spec.softcap,
                    spec.selects, spec.sparsek_window)


@jax.jit
def _reference(q, k, v, dout, seg, positions, q_codes, k_codes, tau, u, width, sinks, softcap,
               selects, sparsek_window):
  """`reference` on operands: query i sees key j iff j <= i, same document, i - j < its head's
  width or j at an in-document position below `sinks`, equal codes; logits capped where
  `softcap` > 0; with `selects`, SparseK's window and weights."""
  group = HEADS // k.shape[2]
  index = jnp.arange(q.shape[1])
  behind = (index[:, None] - index[None, :])[None, None]  # [1, 1, Sq, Sk]
  head_kv = jnp.arange(HEADS) // group
  visible = (behind >= 0) & (seg[:, None, :, None] == seg[:, None, None, :])
  near = (behind < width[None, :, None, None]) | (positions[:, None, None, :] < sinks)
  visible = visible & near & (jnp.swapaxes(q_codes, 1, 2)[..., None]
                              == jnp.swapaxes(k_codes, 1, 2)[:, head_kv, None, :])

  def attend(q, k, v, tau, u):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k[:, :, head_kv], precision="highest")
    s = s * HEAD_DIM ** -0.5
    cap = jnp.where(softcap > 0, softcap, 1.0)  # 1: no 0/0 in the branch not taken
    s = jnp.where(softcap > 0, cap * jnp.tanh(s / cap), s)
    gap = jnp.swapaxes(u, 1, 2)[:, head_kv, None, :] - jnp.swapaxes(tau, 1, 2)[..., None]
    close = behind < sparsek_window
    m = jnp.where(close, 1.0, jnp.clip(gap, 0.0, 1.0))
    seen = jnp.where(selects, visible & (close | (gap > 0)), visible)
    s = s + jnp.log(jnp.where(selects & seen, m, 1.0))  # log 1: no log 0 where not SparseK
    s = jnp.where(seen, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v[:, :, head_kv], precision="highest")

  out, vjp = jax.vjp(attend, q, k, v, tau, u)
  return (out, *vjp(dout))


def _mesh(case: Case):
  return jax.make_mesh((case.ring, case.ulysses), ("sequence", "ulysses"),
                       devices=jax.devices()[:case.ring * case.ulysses])


def run(case: Case, q, k, v, dout, seg, positions, codes, scores, spans):
  """`ring_attention` under the case's mask, jitted, with its VJP: (out, dq, dk, dv, dtau,
  du) in the original order (the last two zeros without SparseK)."""
  perm = functools.partial(permute, layout=case.layout, num_shards=case.ring)
  optional = lambda x: None if x is None else perm(x)
  tau, u = (np.zeros((*k.shape[:2], n), np.float32) if x is None else x
            for x, n in zip(scores, (HEADS, k.shape[2])))
  mesh = _mesh(case)

  @jax.jit
  def attend(q, k, v, dout, tau, u):
    def f(q, k, v, tau, u):
      mask = Mask.of(case.spec, perm(seg) if case.packed else None,
                     positions=perm(positions) if case.spec.sink_tokens else None,
                     spans=spans, codes=tuple(map(optional, codes)),
                     scores=(tau, u) if case.spec.selects else (None, None))
      return ring_attention(q, k, v, mask, layout=case.layout, mesh=mesh, rules=RULES,
                            kernel=case.kernel, tile_size=8, strategy=case.strategy)
    out, vjp = jax.vjp(f, q, k, v, tau, u)
    return (out, *vjp(dout))

  got = attend(*(perm(x) for x in (q, k, v, dout, tau, u)))
  return [unpermute(np.asarray(x, np.float32), case.layout, case.ring) for x in got]


@pytest.mark.slow(6)  # each case compiles a ring; the module goes first (tests/conftest.py)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_mask_matches_its_dense_reference(case):
  q, k, v, dout, seg, positions = _row_inputs(case)
  codes, scores, spans = _operands(case, q, k, seg)
  got = run(case, q, k, v, dout, seg, positions, codes, scores, spans)
  zeros = lambda n: np.zeros((2, case.seq_len, n), np.float32)
  want = reference(q, k, v, dout, seg, positions, *codes, *(
      x if x is not None else zeros(n) for x, n in zip(scores, (HEADS, case.num_kv))),
                   spans, spec=case.spec)
  for name, g, w in zip(("out", "dq", "dk", "dv", "dtau", "du"), got, want):
    assert np.isfinite(g).all(), name
    np.testing.assert_allclose(g, np.asarray(w), err_msg=name, **F32_TOL)
  if case.spec.selects:  # the scorer's gradients are not all zero
    assert np.abs(got[4]).max() > 1e-2 and np.abs(got[5]).max() > 1e-2
  if case.spec != MaskSpec():  # the mask is not ignored: plain causal attention differs
    causal = reference(q, k, v, dout, seg, positions, None, None, zeros(HEADS),
                       zeros(case.num_kv), None, spec=MaskSpec())[0]
    assert np.abs(np.asarray(causal) - got[0]).max() > 1e-2


@pytest.mark.parametrize("spec,field", [
    (MaskSpec(window=0), "mask.window=0 must be a whole number"),
    (MaskSpec(window=8, narrowest=9), "mask.narrowest=9"),
    (MaskSpec(narrowest=4), "mask.narrowest=4"),
    (MaskSpec(sink_tokens=2), "mask.sink_tokens=2 needs a window"),
    (MaskSpec(softcap=float("nan")), "mask.softcap=nan must be a finite number"),
    (MaskSpec(sparse="lsh"), "mask.sparse='lsh' must be one of"),
    (MaskSpec(hash_buckets=4), "mask.hash_buckets=4 is set but mask.sparse='none'"),
    (MaskSpec(sparse="hash", hash_buckets=3), "mask.hash_buckets=3 must be even"),
    (MaskSpec(sparse="qk_drop", qk_drop_rate=1.0), "mask.qk_drop_rate=1 must be in (0, 1)"),
    (MaskSpec(window=8, sink_tokens=2, sparse="hash", hash_buckets=2),
     "mask.sink_tokens=2 does not combine with mask.sparse='hash'"),
    (MaskSpec(sparse="sparsek"), "mask.sparsek_k=0 must be >= 1"),
    (MaskSpec(window=8, sparse="sparsek", sparsek_k=4), "does not combine with local layers"),
    (MaskSpec(softcap=1.0, sparse="sparsek", sparsek_k=4), "mask.softcap=1 does not combine"),
])
def test_a_bad_spec_is_one_line_naming_its_field(spec, field):
  message = problem(spec)
  assert field in message and "\n" not in message
  q = jnp.zeros((1, 16, 2, 8))
  with pytest.raises(ValueError, match="mask."):  # ring_attention checks it before tracing
    ring_attention(q, q, q, Mask(spec), layout="ring")


def test_operands_the_spec_needs_or_reads_not_are_named():
  q, kv = jnp.zeros((1, 16, 2, 8)), jnp.zeros((1, 16, 1, 8))
  attend = lambda mask: ring_attention(q, kv, kv, mask, layout="ring")
  with pytest.raises(ValueError, match=r"mask.q.codes: hash attention .* \[B, S, H\]"):
    attend(Mask(HASH))
  with pytest.raises(ValueError, match=r"mask.k.codes \(1, 16, 2\) must be \(1, 16, 1\)"):
    attend(Mask(HASH, Side(codes=jnp.zeros((1, 16, 2))), Side(codes=jnp.zeros((1, 16, 2)))))
  with pytest.raises(ValueError, match=r"mask.q.positions is given but mask.spec \(causal\)"):
    attend(Mask.of(positions=jnp.zeros((1, 16))))
  with pytest.raises(TypeError, match="mask must be a parallelism.Mask"):
    attend(jnp.zeros((1, 16), jnp.int32))
