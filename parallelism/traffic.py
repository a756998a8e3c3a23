"""Bytes each device sends for attention, by formula and as counted in compiled HLO.

`formula` says what each strategy's code sends per device for one attention call (one
layer), forward and backward; `hlo_bytes` counts what a compiled program's collectives
send per device, loops multiplied by their trip counts. `scripts/bench_strategies.py`
prints both side by side for a model, sequence and mesh; tests/test_traffic.py checks that
they agree exactly on 8 fake devices.

Bytes a device sends, per collective over a group of G devices (result size R bytes):
collective-permute R; all-gather R (G-1)/G; all-to-all R (G-1)/G; reduce-scatter R (G-1);
all-reduce 2 R (G-1)/G (the ring algorithm).

When forward and backward compile together (a gradient without remat), XLA computes an
identical collective once: the backward reuses the forward's all-to-alls of q, k, v (and
the segment ids' all-gather), its all-gather of K/V, and the ring's first K/V hop. The
formula lists those as `reused`; the compiled gradient sends `forward + backward - reused`.
A train step's remat changes that (`layer_bytes`): a policy that recomputes attention
shares between the recomputed forward and the backward, and the first forward sends once
more; `save_attention` recomputes only q, k, v, behind remat's barrier, so nothing is
shared.

Only synchronous collectives are counted exactly (what the CPU compiler emits); an async
`-start` counts its largest array (`async_collectives` counts them). `attention_balance` is
the other half of comparing strategies: how evenly the static
schedule spreads the attention work over the devices.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from parallelism.masks import Mask, MaskSpec
from parallelism.ring_attention import ring_attention
from parallelism.split import block_tile
from parallelism.schedule import critical_path, ring_schedule
from parallelism.strategies import ULYSSES, kv_repeat

_KINDS = ("collective-permute", "all-gather", "all-to-all", "reduce-scatter", "all-reduce")
_COLLECTIVE = re.compile(r"^\s*%\S+ = (.+?) (" + "|".join(_KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_WHILE = re.compile(r" while\(.*body=%([^\s,]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"(?:to_apply|calls)=%([^\s,}]+)")
_CONDITIONAL = re.compile(r" conditional\(.*branch_computations=\{([^}]*)\}")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) ")


def array_bytes(type_text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(type_text):
    bits = int(re.sub(r"\D", "", dtype) or 8) if dtype != "pred" else 8
    total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
  return total


def _group_size(line: str) -> int:
  """The devices in each of a collective's groups, in any of the forms XLA prints: iota
  (`[groups,size]<=[...]`), explicit (`{{0,1},{2,3}}`), or, from JAX 0.11, the mesh axes the
  groups run along (`mesh['sequence'=4,'ulysses'=2] {'ulysses'}`: 2)."""
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota.group(2))
  groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if groups:
    return len(groups.group(1).split(","))
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if mesh:
    sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
    return math.prod(sizes[name] for name in re.findall(r"'([^']+)'", mesh.group(2)))
  # Counting such a collective as one device's would report no traffic without a word.
  raise ValueError(f"unknown replica_groups form in: {line.strip()[:300]}")


def _sent(kind: str, result_bytes: int, line: str) -> float:
  if kind == "collective-permute":  # pairs, not groups
    return result_bytes
  group = _group_size(line)
  if kind == "reduce-scatter":
    return result_bytes * (group - 1)
  if kind == "all-reduce":
    return 2 * result_bytes * (group - 1) / group
  return result_bytes * (group - 1) / group  # all-gather, all-to-all


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """A compiled module's text split into its computations: (name -> the lines after its
  header, in the module's order, which is the schedule's in a scheduled module; the entry
  computation's name). Lines after a computation's closing brace belong to none."""
  found, current, entry = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and line.rstrip().endswith("{"):
      current = found.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  return found, entry


def hlo_bytes(hlo_text: str) -> dict[str, float]:
  """Bytes each device sends per run of the compiled module `hlo_text`, by collective kind
  (key 'unknown_trips' counts while loops with collectives whose trip count XLA did not
  record: their bodies count once)."""
  computations_, entry = computations(hlo_text)
  unknown = [0]

  def total(name: str, seen: tuple = ()) -> dict[str, float]:
    out = dict.fromkeys(_KINDS + ("async_collectives",), 0.0)
    if name not in computations_ or name in seen:
      return out
    for line in computations_[name]:
      collective = _COLLECTIVE.match(line)
      if collective and "-done" not in line:
        type_text, kind, started = collective.groups()
        if started:  # async: a tuple of operand, result and context; count the largest
          out["async_collectives"] += 1
          result = max(array_bytes(f"{dtype}[{dims}]")
                       for dtype, dims in _ARRAY.findall(type_text))
        else:
          result = array_bytes(type_text)
        out[kind] += _sent(kind, result, line)
        continue
      loop = _WHILE.search(line)
      if loop:
        trips = _TRIP.search(line)
        body = total(loop.group(1), seen + (name,))
        unknown[0] += trips is None and sent_total(body) > 0
        for kind, value in body.items():
          out[kind] += value * (int(trips.group(1)) if trips else 1)
        continue
      branches = _CONDITIONAL.search(line)
      callees = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                 else _CALLS.findall(line))
      # A conditional runs one branch: count the one that sends the most.
      parts = [total(c, seen + (name,)) for c in callees]
      if branches and parts:
        parts = [max(parts, key=lambda p: sum(p.values()))]
      for part in parts:
        for kind, value in part.items():
          out[kind] += value
    return out

  out = total(entry)
  out["unknown_trips"] = unknown[0]
  return out


@dataclasses.dataclass(frozen=True)
class Shapes:
  """One attention call as one device sees it: rows and heads after data and tensor
  sharding, the whole sequence length."""
  rows: int
  seq_len: int
  heads: int
  kv_heads: int
  head_dim: int
  itemsize: int  # of q, k, v (the compute dtype)
  packed: bool  # segment ids travel with K/V


def block_bytes(shapes: Shapes, ring: int, ulysses: int = 1) -> tuple[int, int]:
  """(K/V block, its dK/dV): the bytes of one ring hop of each pass's block. Blocks are
  S / ring tokens with the heads split over Ulysses (`ulysses` 1 for a ring alone); dK/dV
  travel in float32."""
  s = shapes
  block_tokens = s.seq_len // ring
  kv_heads = s.kv_heads * kv_repeat(s.kv_heads, ulysses) // ulysses
  kv_block = 2 * s.rows * block_tokens * kv_heads * s.head_dim * s.itemsize
  kv_block += s.rows * block_tokens * 4 if s.packed else 0
  return kv_block, 2 * s.rows * block_tokens * kv_heads * s.head_dim * 4


def formula(strategy: str, shapes: Shapes, ring: int, ulysses: int = 1,
            steps: int | None = None) -> dict[str, float]:
  """Bytes one device sends for one attention call: 'forward', 'backward' (as the code
  issues them) and 'reused' (what a compiled gradient computes once for both); the same
  three for the Ulysses all-to-alls alone under 'ulysses_forward' and so on (the rest is
  the ring's or the all-gather's). `steps`: the ring steps a ring cut short runs
  (`RingSchedule.needed_steps`; None: all), each block sent straight by its shift."""
  s = shapes
  ulysses = ulysses if strategy in ULYSSES else 1
  repeat = kv_repeat(s.kv_heads, ulysses)
  kv_block, dkv_block = block_bytes(shapes, ring, ulysses)
  cut_short = strategy != "allgather" and steps is not None and steps < ring
  hops = steps - 1 if cut_short else ring - 1
  forward = hops * kv_block
  # dK/dV of a whole ring travel one step behind their block and make the last hop home
  # too (`ring.backward_pass`): one hop more than K/V. The all-gather's reduce-scatter
  # sends N - 1 blocks.
  whole_ring = strategy != "allgather" and not cut_short and hops
  dkv_hops = hops + 1 if whole_ring else hops
  backward = hops * kv_block + dkv_hops * dkv_block
  # The gradient computes an identical send once: every block of the all-gather or of a
  # ring cut short (sent straight), the first hop of a whole ring.
  reused = hops * kv_block if strategy == "allgather" or cut_short else kv_block if hops else 0
  parts = {"ulysses_forward": 0.0, "ulysses_backward": 0.0, "ulysses_reused": 0.0}
  if ulysses > 1:
    # Each all-to-all sends (U - 1) / U of a device's [rows, S / (ring U), heads, D] array.
    part = (ulysses - 1) / ulysses
    tokens = s.seq_len // (ring * ulysses)
    q = s.rows * tokens * s.heads * s.head_dim * s.itemsize
    kv = s.rows * tokens * s.kv_heads * repeat * s.head_dim * s.itemsize
    lse = s.rows * tokens * s.heads * 4
    segments = (ulysses - 1) * s.rows * tokens * 4 if s.packed else 0
    # dK/dV of repeated heads go back in float32 (their copies are summed after).
    dkv = kv * (4 / s.itemsize if repeat > 1 else 1)
    parts = {"ulysses_forward": part * (2 * q + 2 * kv) + segments,  # q, k, v in; out back
             # The forward's lse goes back only for a backward (a forward alone drops it);
             # then q, k, v, out, dout, lse in; dq, dk, dv back.
             "ulysses_backward": part * (4 * q + 2 * kv + 2 * dkv + 2 * lse) + segments,
             "ulysses_reused": part * (q + 2 * kv) + segments}
  return {"forward": forward + parts["ulysses_forward"],
          "backward": backward + parts["ulysses_backward"],
          "reused": reused + parts["ulysses_reused"], **parts}


def sent_total(counted: dict[str, float]) -> float:
  return float(np.sum([counted[kind] for kind in _KINDS]))


# Remat policies whose backward runs each layer's attention forward again.
RECOMPUTES_ATTENTION = ("full", "offload", "save_dots")


def layer_bytes(sent: dict[str, float], remat: str, part: str = "") -> float:
  """Bytes one layer's attention sends per train step under `remat`, from `formula`'s
  `sent` (`part` 'ulysses_' for the all-to-alls alone)."""
  forward, backward, reused = (sent[part + name] for name in ("forward", "backward", "reused"))
  if remat == "save_attention":
    return forward + backward
  return forward + backward - reused + (forward if remat in RECOMPUTES_ATTENTION else 0)


def compiled_bytes(strategy: str, shapes: Shapes, ring: int, ulysses: int = 1,
                   layout: str = "striped", tile_size: int = 512,
                   window: int | None = None) -> dict[str, dict]:
  """`hlo_bytes` of one attention call compiled on fake devices from abstract shapes (no
  array is allocated): 'forward' alone and 'gradient' (forward with backward). Operands
  are float32 when `shapes.itemsize` is 4, else bf16; the CPU compiler moves bf16
  all-to-alls as float32, so count float32 to compare with the formula."""
  mesh = jax.make_mesh((ring, ulysses), ("sequence", "ulysses"),
                       devices=jax.devices()[:ring * ulysses])
  spec = NamedSharding(mesh, P(None, ("sequence", "ulysses")))
  dtype = jnp.float32 if shapes.itemsize == 4 else jnp.bfloat16
  rows, seq_len, head_dim = shapes.rows, shapes.seq_len, shapes.head_dim
  q = jax.ShapeDtypeStruct((rows, seq_len, shapes.heads, head_dim), dtype, sharding=spec)
  kv = jax.ShapeDtypeStruct((rows, seq_len, shapes.kv_heads, head_dim), dtype, sharding=spec)
  seg = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=spec)
  rules = (("activation_seq", ("sequence", "ulysses")),)
  attend = lambda q, k, v, *seg: ring_attention(
      q, k, v, Mask.of(MaskSpec(window=window), *seg), layout=layout, mesh=mesh, rules=rules,
      tile_size=tile_size, strategy=strategy)
  loss = lambda q, k, v, *seg: jnp.sum(attend(q, k, v, *seg).astype(jnp.float32))
  args = (q, kv, kv, seg) if shapes.packed else (q, kv, kv)
  return {"forward": hlo_bytes(jax.jit(attend).lower(*args).compile().as_text()),
          "gradient": hlo_bytes(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
              *args).compile().as_text())}


def attention_balance(layout: str, seq_len: int, ring: int, tile_size: int,
                      per_step: bool = True) -> float:
  """An even split's attention work over the busiest device's (the static schedule's
  tiles, whole tiles counted). `per_step`: the ring waits for its busiest device at every
  step, so the busiest per step are summed (1.0: every device busy at every step);
  otherwise (the all-gather, which holds every block at once) the busiest device's total.
  Heads split evenly (tensor, Ulysses), so only the ring's layout unbalances."""
  tile = block_tile(seq_len, ring, tile_size)
  work_SN = ring_schedule(layout, seq_len, ring).computed_tiles(tile)
  busiest = (critical_path(work_SN) if per_step else float(work_SN.sum(axis=0).max())) * tile**2
  return seq_len * (seq_len + 1) / 2 / ring / busiest
