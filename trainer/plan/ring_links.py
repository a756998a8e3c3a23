"""Each ring step's transfer on a link against its block's compute: which ring is link-bound.

For one causal layer, per device and ring step: the K/V block the forward sends, and the
K/V block plus its float32 dK/dV the backward sends (`parallelism.traffic.block_bytes`),
over NVLink (about 450 GB/s each way from an H100 or H200 through its node's NVSwitch) and
over a 400 Gb/s link between nodes (50 GB/s: one InfiniBand NIC per GPU); against the
step's attention FLOPs (the layer's causal attention, an even share per device and step;
forward a third, backward two) at the plan's MFU. A transfer longer than its step's compute
cannot hide behind it, and the ring then runs at the link's speed. A ring waits for its
slowest hop: one whose devices span nodes runs at the link between them.

The mesh puts its later axes inside a node (`parallelism.MESH_AXES`: data, fsdp, sequence,
ulysses, tensor; `plan_target` describes hosts of 8), so the ring (with Ulysses and tensor)
stays in a node while sequence x ulysses x tensor is at most 8 and data or fsdp take the rest.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections

from parallelism import traffic
from trainer.config import flops
from trainer.plan import plan_report

LINKS = (("NVLink", flops.LINK_BYTES_PER_S["nvlink"]),
         ("400 Gb/s between nodes", flops.LINK_BYTES_PER_S["ib_400g"]))
NODE_SIZE = flops.GPUS_PER_NODE


def shapes(config: ml_collections.ConfigDict, shape: dict[str, int]) -> traffic.Shapes:
  """One attention call of the config as one device of mesh `shape` sees it."""
  m, t = config.model, config.train
  rows = t.batch_size // (shape["data"] * shape["fsdp"]) // t.micro_batches
  return traffic.Shapes(rows=rows, seq_len=config.data.seq_len,
                        heads=m.num_heads // shape["tensor"],
                        kv_heads=m.num_kv_heads // shape["tensor"],
                        head_dim=m.head_dim or m.d_model // m.num_heads,
                        itemsize=jnp.dtype(m.dtype).itemsize,
                        packed=not config.data.cross_document_attention)


def ring_step(config: ml_collections.ConfigDict, shape: dict[str, int], peak: float,
              mfu: float) -> dict[str, float]:
  """Bytes each pass sends per device and ring step of a causal layer, and seconds of
  compute it has to hide behind at `mfu` of `peak` FLOP/s."""
  s = shapes(config, shape)
  ring, ulysses = shape["sequence"], shape["ulysses"]
  kv_block, dkv_block = traffic.block_bytes(
      s, ring, ulysses if config.model.sequence_parallel in ("ulysses", "hybrid") else 1)
  # fwd + bwd attention FLOPs of one causal layer over the rows: 12 H D (S / 2) per token.
  layer = 12 * s.heads * s.head_dim * (s.seq_len / 2) * s.rows * s.seq_len
  per_step = layer / (ring * ulysses) / ring / (peak * mfu)
  return {"forward_bytes": kv_block, "backward_bytes": kv_block + dkv_block,
          "forward_s": per_step / 3, "backward_s": 2 * per_step / 3}


def lines(config: ml_collections.ConfigDict, shape: dict[str, int], peak: float,
          mfu: float) -> list[str]:
  """The plan's lines: each pass's transfer per ring step on each link against its compute,
  and which link this mesh's ring crosses. None for a ring of one or the all-gather."""
  if shape["sequence"] < 2 or config.model.sequence_parallel in ("allgather", "ulysses"):
    return []
  step = ring_step(config, shape, peak, mfu)
  group = shape["sequence"] * shape["ulysses"] * shape["tensor"]
  crosses = group > NODE_SIZE
  out = [f"ring step of a causal layer at {mfu:.0%} MFU (per device; ring of "
         f"{shape['sequence']}, {config.data.seq_len // shape['sequence']:,}-token blocks):"]
  for name in ("forward", "backward"):
    sent, compute = step[f"{name}_bytes"], step[f"{name}_s"]
    links = ", ".join(
        f"{plan_report.human_seconds(sent / bps)} on {link} "
        f"({'hidden' if sent / bps <= compute else f'{sent / bps / compute:.1f}x: link-bound'})"
        for link, bps in LINKS)
    out.append(f"  {name:<8} sends {plan_report.human_bytes(sent).strip()} against "
               f"{plan_report.human_seconds(compute)} of compute: {links}")
  inter_bps = LINKS[-1][1]
  bound = any(step[f"{name}_bytes"] / inter_bps > step[f"{name}_s"]
              for name in ("forward", "backward"))
  if not crosses:
    where = f"stays inside one node ({group} of {NODE_SIZE} devices): NVLink"
  elif bound:
    where = (f"spans nodes ({group} devices with Ulysses and tensor, nodes of {NODE_SIZE}) "
             f"and waits on the {inter_bps * 8 / 1e9:.0f} Gb/s link between them: keep "
             f"sequence x ulysses x tensor within "
             f"{NODE_SIZE} (data or fsdp across nodes), or give each device a longer block")
  else:
    where = (f"spans nodes ({group} devices with Ulysses and tensor, nodes of {NODE_SIZE}): "
             f"its slowest hop is the {inter_bps * 8 / 1e9:.0f} Gb/s link between them, still "
             f"hidden behind compute")
  out.append(f"  this mesh's ring {where}")
  return out
