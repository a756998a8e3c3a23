"""Per-head attention spans (MoA, Fu et al. 2024) from a plan file, resolved once.

A plan is a JSON file of MoA's elastic form, one (alpha, beta) per layer and query head:

    {"alpha": [[64, 64, 512, 8], ...],      # one row per layer, one entry per query head
     "beta":  [[0.0, 0.25, 0.0, 0.0], ...]}

Head h of layer l sees `round(alpha + beta * N)` keys up to itself (the query included, as
`model.window` counts: `parallelism.tiles`), N being the row length the plan is resolved
at (`data.seq_len`); a span of N or more (JSON's Infinity too) is causal. Each query head
keeps its own span, under GQA too (its kv head's keys are read as far back as its widest
query head needs).
"""

from __future__ import annotations

import json
import math


def resolve(path: str, num_layers: int, num_heads: int,
            length: int) -> tuple[tuple[int, ...], ...]:
  """Spans [layer][query head] of the plan at `path` for rows of `length` tokens, each clipped
  to `length` (causal); a ValueError of one line says what is wrong with the file."""
  where = f"model.head_spans={path!r}"
  try:
    with open(path) as f:
      plan = json.load(f)
  except (OSError, ValueError) as error:
    raise ValueError(f"{where}: cannot read the plan ({error})") from None
  if not isinstance(plan, dict) or set(plan) != {"alpha", "beta"}:
    raise ValueError(f"{where}: a plan is a JSON object with keys 'alpha' and 'beta' (per "
                     f"layer, per query head: span = alpha + beta * row length)")
  for key in ("alpha", "beta"):
    rows = plan[key]
    if not isinstance(rows, list) or len(rows) != num_layers:
      raise ValueError(f"{where}: '{key}' must have one row per layer, {num_layers} "
                       f"(model.num_layers); it has {_count(rows)}")
    for layer, row in enumerate(rows):
      if not isinstance(row, list) or len(row) != num_heads:
        raise ValueError(f"{where}: '{key}' row {layer} must have one entry per query head, "
                         f"{num_heads} (model.num_heads); it has {_count(row)}")
      if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row):
        raise ValueError(f"{where}: '{key}' row {layer} must hold numbers, got {row}")
  spans = []
  for layer, rows in enumerate(zip(plan["alpha"], plan["beta"])):
    spans.append([])
    for head, (alpha, beta) in enumerate(zip(*rows)):
      span = _float(alpha) + _float(beta) * length
      if math.isnan(span):
        raise ValueError(f"{where}: layer {layer} head {head} has alpha {alpha} and beta {beta}"
                         f": alpha + beta * length is not a number")
      # Of the row or more, infinity too, is causal; round() has no integer for infinity.
      span = length if span >= length else round(span) if math.isfinite(span) else span
      if span < 1:
        raise ValueError(f"{where}: layer {layer} head {head} has span {span} at length "
                         f"{length} (alpha + beta * length); every span must be >= 1 key")
      spans[-1].append(span)
  return tuple(map(tuple, spans))


def _float(number: int | float) -> float:
  """The plan's number as a float; an integer too large for one (JSON has no bound) as the
  infinity of its sign, which is what it means for a span."""
  try:
    return float(number)
  except OverflowError:
    return math.inf if number > 0 else -math.inf


def _count(value) -> str:
  return str(len(value)) if isinstance(value, list) else f"no list ({type(value).__name__})"
