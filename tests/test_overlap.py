"""The ring's transfers overlap its kernels in XLA's GPU schedule (`parallelism.overlap`):
ring attention's forward and backward compiled for 8 described H100s (the planner's GPU
compiler, `make plan_gpu`; no GPU) at a real block size, 4,096 tokens of 8 heads of 128
per device, where XLA sends each transfer on its own (at the tiny config's sizes it
combines a step's K/V and dK/dV into one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parallelism import overlap, ring_attention
from trainer.plan import plan_target

SEQ_LEN, HEADS, HEAD_DIM = 32768, 8, 128


def compiled_text(layout, strategy="ring", options=None):
  """The scheduled program of ring attention's gradient on 8 described H100s."""
  devices = plan_target.devices("h100", 8)
  # Hybrid as a ring of 2 outside 4-way Ulysses: the ring XLA scheduled worst (its one K/V
  # transfer waited before step 0's kernel until `ring.in_flight_over`).
  ulysses = 4 if strategy == "hybrid" else 1
  mesh = Mesh(np.array(devices).reshape(8 // ulysses, ulysses), ("sequence", "ulysses"))
  row = NamedSharding(mesh, P(None, ("sequence", "ulysses")))
  x = jax.ShapeDtypeStruct((1, SEQ_LEN, HEADS, HEAD_DIM), jnp.bfloat16, sharding=row)

  def loss(q, k, v):
    out = ring_attention(q, k, v, None, layout=layout, mesh=mesh, strategy=strategy,
                         tile_size=512)
    return out.astype(jnp.float32).sum()

  with plan_target.compiling_for(devices):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=("cuda",))
    return lowered.compile({**plan_target.compiler_options(devices), **(options or {})}).as_text()


@pytest.mark.slow(5)
@pytest.mark.parametrize("layout, strategy", [
    ("ring", "ring"), ("striped", "ring"), ("zigzag", "ring"), ("striped", "hybrid")])
def test_every_ring_step_overlaps_a_kernel(layout, strategy):
  found = overlap.transfers(compiled_text(layout, strategy))
  # K/V and dK/dV at least.
  assert len(found) >= 2 and {t.nbytes for t in found} >= {2 * 4096 * HEADS * HEAD_DIM * 2,
                                                           2 * 4096 * HEADS * HEAD_DIM * 4}
  assert not overlap.exposed(found), overlap.summary(found)
  assert overlap.summary(found).startswith("ring transfers: every ring step's")


def test_one_collective_in_flight_leaves_the_backward_accumulator_bare():
  """Why the trainer raises XLA's limit (`trainer.core.xla_options`): at XLA's own limit of
  one, the dK/dV accumulator waits before the next K/V block is sent, with no kernel."""
  found = overlap.transfers(compiled_text(
      "striped", options={"xla_gpu_experimental_parallel_collective_overlap_limit": 1}))
  bare = overlap.exposed(found)
  assert len(bare) == 1 and bare[0].nbytes == 2 * 4096 * HEADS * HEAD_DIM * 4, found
  assert "1 of " in overlap.summary(found) and "wait with nothing to overlap" in (
      overlap.summary(found))
