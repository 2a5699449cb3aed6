"""Non-negative weighted least squares on three features: t ~ a + b x + c y with a, b, c >= 0.

Used by step_fit.py for both sides of a step: decode (x = batch B, y = summed context C) and
prefill (x = prompt tokens N, y = attention pairs A). Each point is a group's medians and counts
as its number of steps, weighted count / t^2 (relative error).

Minimise sum_i w_i (t_i - f(i) . coef)^2 over f = (1, x, y). The least squares of a support S
(the coefficients allowed to be non-zero, the others held at 0) solve the normal equations
sum_i w_i f_j(i) f_k(i) x_k = sum_i w_i f_j(i) t_i for j, k in S (`_normal_equations`), solved
by Gauss-Jordan elimination (`_solve`, at most 3 x 3). Every support the caller allows is solved;
solutions with a negative coefficient or a singular system are dropped; the one with the least
weighted squared error wins. This is the exact optimum under the sign constraints: the objective
is convex, so the constrained optimum also minimises it on the subspace of its own support, and
is among the candidates. On equal error (within TIE of sum w t^2, rounding) the first support in
the caller's order wins, so a feature that does not vary apart from the others gets 0.

Singular: the normal matrix scaled to a unit diagonal (entries M_jk / sqrt(M_jj M_kk)) has a
pivot below SINGULAR_PIVOT during elimination, i.e. one feature is a combination of the others to
within 1 - R^2 < 1e-9.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

SINGULAR_PIVOT = 1e-9  # of the unit-diagonal normal matrix: 1 - R^2 of a feature on the others
TIE = 1e-9  # of sum w t^2: errors closer than this are equal (rounding)
Coefficients = tuple[float, float, float]  # (a, b, c): constant, per x, per y


class Point(NamedTuple):
    """One group of steps: medians of x, of y and of t, and the number of steps it stands for."""

    x: float
    y: float
    seconds: float
    count: int

    def features(self) -> tuple[float, float, float]:
        """f = (1, x, y): what a, b and c multiply."""
        return 1.0, self.x, self.y


def fit(points: Sequence[Point], supports: Sequence[tuple[int, ...]],
        valid: Callable[[Coefficients], bool]) -> Coefficients | None:
    """The least-error (a, b, c) >= 0 among `supports` (indices into (a, b, c), preferred first
    on equal error) that `valid` accepts; None when none does."""
    tie = TIE * sum(p.count for p in points)  # sum w t^2 = sum count
    best: tuple[float, Coefficients] | None = None
    for support in supports:
        x = _solve(*_normal_equations(points, support))
        if x is None or min(x) < 0:
            continue
        coef = [0.0, 0.0, 0.0]
        for i, xi in zip(support, x, strict=True):
            coef[i] = xi
        found = (coef[0], coef[1], coef[2])
        if not valid(found):
            continue
        error = weighted_error(points, found)
        if best is None or error < best[0] - tie:
            best = error, found
    return None if best is None else best[1]


def predict(point: Point, coef: Sequence[float]) -> float:
    return sum(f * c for f, c in zip(point.features(), coef, strict=True))


def max_rel_error(points: Sequence[Point], model: Callable[[Point], float]) -> float:
    """The largest |model(p) - t| / t over the points (`model`: e.g. predict with fitted
    coefficients, or a decode fit with its knee)."""
    return max(abs(model(p) - p.seconds) / p.seconds for p in points)


def weighted_error(points: Sequence[Point], coef: Sequence[float]) -> float:
    """sum_i w_i (t_i - f(i) . coef)^2, the objective."""
    return sum(p.count / p.seconds**2 * (p.seconds - predict(p, coef))**2 for p in points)


def _normal_equations(points: Sequence[Point], support: Sequence[int]
                      ) -> tuple[list[list[float]], list[float]]:
    """M[j][k] = sum_i w_i f_j(i) f_k(i) and v[j] = sum_i w_i f_j(i) t_i for j, k in support,
    w_i = count_i / t_i^2: M x = v is the least-squares optimum."""
    m = [[0.0] * len(support) for _ in support]
    v = [0.0] * len(support)
    for p in points:
        w, f = p.count / p.seconds**2, p.features()
        for j, fj in enumerate(f[i] for i in support):
            v[j] += w * fj * p.seconds
            for k, fk in enumerate(f[i] for i in support):
                m[j][k] += w * fj * fk
    return m, v


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """x with m x = v for a symmetric positive semi-definite m (normal equations, k <= 3): the
    rows and columns are scaled to a unit diagonal (x_j = y_j / sqrt(m_jj)), then Gauss-Jordan
    elimination; None when a pivot falls below SINGULAR_PIVOT (module docstring)."""
    k = len(v)
    if any(m[j][j] <= 0 for j in range(k)):
        return None
    scale = [1 / math.sqrt(m[j][j]) for j in range(k)]
    a = [[m[j][i] * scale[j] * scale[i] for i in range(k)] + [v[j] * scale[j]] for j in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < SINGULAR_PIVOT:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[j][k] / a[j][j] * scale[j] for j in range(k)]
