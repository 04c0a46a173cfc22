"""Choose each tensor's type under a size budget: minimise the summed predicted KL increase
Σ_t cost[t][type] subject to Σ_t bytes[t][type] <= budget.

Lagrangian relaxation: for a multiplier λ every tensor takes argmin cost + λ·bytes (its lower
convex hull); bisecting λ gives the largest total that fits, then a greedy pass spends what is
left on the upgrades with the best cost drop per byte that still fit. The result never exceeds
the budget (tests/test_allocate.py), and is optimal whenever the bisection lands on a hull
vertex (the classic knapsack-by-Lagrange argument, as llama.cpp's PR #15550 and exllamav3 use).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from poly.errors import UsageError

__all__ = ["Option", "allocate"]


@dataclass(frozen=True)
class Option:
    kind: str  # a type name (e.g. "Q4_K")
    nbytes: int
    cost: float  # predicted KL increase (or any additive error) of the tensor at this type


def _pick(opts: list[Option], lam: float) -> Option:
    return min(opts, key=lambda o: (o.cost + lam * o.nbytes, o.nbytes))


def _total(choice: Mapping[str, Option]) -> int:
    return sum(o.nbytes for o in choice.values())


def allocate(options: Mapping[str, list[Option]], budget: int) -> dict[str, Option]:
    """tensor -> chosen Option with Σ nbytes <= ``budget`` (UsageError when even the smallest
    options do not fit)."""
    smallest = {t: min(o, key=lambda o: (o.nbytes, o.cost)) for t, o in options.items()}
    if _total(smallest) > budget:
        raise UsageError(
            f"the budget ({budget} bytes) is below the smallest types ({_total(smallest)} bytes)"
        )
    lo, hi = 0.0, 1.0  # λ = 0: best cost regardless of size; grow hi until it fits
    while _total({t: _pick(o, hi) for t, o in options.items()}) > budget:
        hi *= 4.0
        if hi > 1e30:
            return _fill(options, dict(smallest), budget)
    for _ in range(100):  # bisect: the smallest λ whose choice fits
        mid = (lo + hi) / 2
        if _total({t: _pick(o, mid) for t, o in options.items()}) > budget:
            lo = mid
        else:
            hi = mid
    return _fill(options, {t: _pick(o, hi) for t, o in options.items()}, budget)


def _fill(options: Mapping[str, list[Option]], choice: dict[str, Option], budget: int):
    """Spend the leftover bytes: repeatedly the fitting upgrade with the best cost drop per byte."""
    left = budget - _total(choice)
    while True:
        best, gain = None, 0.0
        for t, opts in options.items():
            cur = choice[t]
            for o in opts:
                extra = o.nbytes - cur.nbytes
                drop = cur.cost - o.cost
                if 0 < extra <= left and drop > 0 and drop / extra > gain:
                    best, gain = (t, o), drop / extra
        if best is None:
            return choice
        left -= best[1].nbytes - choice[best[0]].nbytes
        choice[best[0]] = best[1]
