"""MoA's search: one elastic rule `alpha + beta * N` per head under a density budget.

From a profile (model/moa_profile.py: per layer, head and distance, the influence of the
attention values at that distance, at each profiled length N), a rule's estimated loss at N
is the influence of the pairs its span drops (distances >= span), and its density the share
of causal (query, key) pairs it keeps. One rule per head is chosen by a mixed-integer
program (SciPy's HiGHS `milp`), as MoA's `MoA/universal/optimizer.py` does with CVXPY:
binary x[head, rule], one rule per head, the model's mean density at every profiled length
at most the budget, minimising the estimated loss summed over lengths. Each length's loss is
divided by the total influence at that length first, so a length's larger profile (more
pairs) does not outvote the others: MoA states one objective per length (and picks from
their Pareto front); their normalised sum is one point of that front.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from scipy import optimize


class Rule(NamedTuple):
  alpha: float
  beta: float


@dataclasses.dataclass(frozen=True)
class Request:
  """What a search is asked: the budget, the lengths, the calibration rows, the grid."""
  density: float
  lengths: tuple[int, ...]
  rows: int
  rules: tuple[Rule, ...]
  chunk: int = 256  # Queries whose [heads, chunk, length] matrices are formed at a time.
  seed: int = 0
  loss_on: str = "auto"  # Tokens whose loss is profiled: answers, all, or auto (moa_calibrate).


class Choice(NamedTuple):
  rules: list[list[Rule]]  # [layer][head]
  density: dict[int, float]  # The plan's density at each profiled length.
  lost: dict[int, float]  # Share of the profiled influence the plan drops, per length.


def span_at(rule: Rule, length: int) -> int:
  """Keys a head with `rule` sees at `length`, as model/spans.py resolves it."""
  span = rule.alpha + rule.beta * length
  return length if span >= length else round(span)


def kept_pairs(span: int, length: int) -> int:
  """Causal (query, key) pairs a span keeps in a row: query i sees min(i + 1, span) keys."""
  span = min(span, length)
  return span * (span + 1) // 2 + (length - span) * span


def candidates(alphas: list[float], betas: list[float], lengths: list[int]) -> list[Rule]:
  """The grid's rules whose span is at least 1 key at every length; each span pattern once
  (rules that resolve to the same spans at every length are one choice), plus the causal
  rule (beta 1), so the budget 1 is always reachable."""
  rules, seen = [], set()
  for rule in [Rule(a, b) for a in alphas for b in betas] + [Rule(0.0, 1.0)]:
    spans = tuple(span_at(rule, n) for n in lengths)
    if min(spans) >= 1 and spans not in seen:
      seen.add(spans)
      rules.append(rule)
  return rules


def tables(profiles: dict[int, np.ndarray], rules: list[Rule]):
  """(loss [N, L*H, R], density [N, L*H, R]) over lengths N, heads and rules: each length's
  loss as a share of its total influence, density as a share of its causal pairs."""
  losses, densities = [], []
  for length, influence_LHS in profiles.items():
    heads_XS = influence_LHS.reshape(-1, influence_LHS.shape[-1]).astype(np.float64)
    # Influence lost by a span w: distances w..N-1, a suffix sum.
    suffix_XS = np.cumsum(heads_XS[:, ::-1], axis=1)[:, ::-1]
    suffix_XS = np.concatenate([suffix_XS, np.zeros((len(heads_XS), 1))], axis=1)
    spans = [span_at(rule, length) for rule in rules]
    total = max(heads_XS.sum(), np.finfo(np.float64).tiny)
    losses.append(suffix_XS[:, spans] / total)
    all_pairs = length * (length + 1) / 2
    densities.append(np.broadcast_to(
        [kept_pairs(s, length) / all_pairs for s in spans], suffix_XS[:, spans].shape))
  return np.stack(losses), np.stack(densities)


def choose(profiles: dict[int, np.ndarray], rules: list[Rule], budget: float) -> Choice:
  """One rule per head minimising the summed normalised loss, with the mean density at each
  profiled length at most `budget`; `profiles` maps a length to its [L, H, N] influence."""
  layers, heads = next(iter(profiles.values())).shape[:2]
  loss_NXR, density_NXR = tables(profiles, rules)
  count, choices = layers * heads, len(rules)
  one_rule = optimize.LinearConstraint(
      np.kron(np.eye(count), np.ones(choices)), lb=1, ub=1)
  # Mean density over heads <= budget, at every length (a tiny slack for float sums).
  within = optimize.LinearConstraint(density_NXR.reshape(len(profiles), -1) / count,
                                     ub=budget + 1e-9)
  result = optimize.milp(loss_NXR.sum(axis=0).reshape(-1), constraints=[one_rule, within],
                         integrality=np.ones(count * choices), bounds=optimize.Bounds(0, 1))
  if result.x is None:
    # The least each length can keep: every head on its narrowest rule there.
    narrowest = density_NXR.min(axis=2).mean(axis=1).max()
    raise ValueError(f"no plan of these candidate rules meets the density {budget} at every "
                     f"length ({result.message}); the narrowest rules keep {narrowest:.3f}")
  picked_X = np.round(result.x).reshape(count, choices).argmax(axis=1)
  rows = np.arange(count)
  return Choice(
      rules=[[rules[r] for r in picked_X[l * heads:(l + 1) * heads]] for l in range(layers)],
      density={n: float(density_NXR[i, rows, picked_X].mean()) for i, n in enumerate(profiles)},
      lost={n: float(loss_NXR[i, rows, picked_X].sum()) for i, n in enumerate(profiles)})


def plan_json(choice: Choice) -> dict:
  """The plan file model/spans.py reads: alpha and beta per layer and query head."""
  return {"alpha": [[r.alpha for r in row] for row in choice.rules],
          "beta": [[r.beta for r in row] for row in choice.rules]}
