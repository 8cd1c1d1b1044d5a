"""Per-rank peak memory versus world size: fit a simple model, say how good it is, predict.

CI runners often have 2 or 4 GPUs while the question is "does this fit at 8 (or 64)?". The
inflations this plugin exists for grow steadily with N (LiBai Swin eager: 5734 MiB at 1 process,
15190 at 8), so a few measured sizes say a lot about a larger one -- if the model is chosen
honestly. Four shapes, each with a reason to exist:

* ``flat``      ``a``               replicated state, per-rank batch fixed (healthy DDP)
* ``linear``    ``a + b*N``         something gathered from every rank (S->B of the batch, all-gather)
* ``sharded``   ``a + b/N``         state split over the ranks (ZeRO, S(0) parameters); with b < 0
                                    a step that saturates (buffers that exist only when N > 1)
* ``sum``       ``a + b*N + c/N``   both at once

Each is fitted by least squares, and judged by how well it predicts the points it did not see:
leave-one-out (LOO), fit on all sizes but one, predict that one; the error is the worst relative
miss. The model with the smallest LOO error wins; a model with more parameters must beat a simpler
one by more than :data:`TIE` to be preferred. A model is eligible only where LOO can judge it
(more points than parameters). From two points nothing can be judged, so the only model used is
the straight line through them (``linear``), reported without a LOO error; the issue's rule:
never more than a linear model from two points.

One process is often another regime (no communicator, no collective): when every model misses by
more than :data:`REGIME_GAP` with nproc=1 in, at least two larger sizes were launched and nproc=1
lies below their trend, the larger sizes alone are fitted, and nproc=1 is reported as left out
(see :func:`fit`).

Plain Python (no numpy): the systems are at most 3 x 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

TIE = 0.005  # 0.5 percentage points of LOO error: below that, the simpler model is as good
REGIME_GAP = 0.05  # a fit over every size that misses a held-out one by more: is nproc=1 another regime?


class PredictError(ValueError):
    """No honest prediction can be made from these points; the message says why."""


@dataclass(frozen=True)
class Model:
    name: str
    formula: str
    terms: tuple[Callable[[float], float], ...]

    @property
    def params(self) -> int:
        return len(self.terms)


def _one(n: float) -> float:
    return 1.0


def _n(n: float) -> float:
    return float(n)


def _inv(n: float) -> float:
    return 1.0 / n


FLAT = Model("flat", "a (flat)", (_one,))
LINEAR = Model("linear", "a + b*N", (_one, _n))
SHARDED = Model("sharded", "a + b/N", (_one, _inv))
SUM = Model("sum", "a + b*N + c/N", (_one, _n, _inv))
MODELS: tuple[Model, ...] = (FLAT, LINEAR, SHARDED, SUM)  # simplest first: ties go to the earlier
MODELS_BY_NAME = {model.name: model for model in MODELS}  # a fit read back from a report


@dataclass(frozen=True)
class Candidate:
    """One model's showing on the points: its LOO error, or why it was not eligible."""

    model: Model
    loo_error: float | None
    reason: str = ""  # why it was not judged ("needs 4 sizes"), empty when it was


@dataclass(frozen=True)
class Fit:
    """The chosen model fitted on every point, with the evidence for choosing it."""

    model: Model
    coefficients: tuple[float, ...]
    points: tuple[tuple[int, float], ...]  # (world size, MiB), sizes ascending
    loo_error: float | None  # worst relative miss on a held-out point; None from two points
    candidates: tuple[Candidate, ...] = ()
    left_out: tuple[tuple[int, float], ...] = ()  # nproc=1 when it is off the larger sizes' trend
    loo_error_with_left_out: float | None = None  # the best fit's LOO error with them kept

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(n for n, _ in self.points)

    def at(self, world_size: float) -> float:
        return sum(c * term(world_size) for c, term in zip(self.coefficients, self.model.terms))

    def describe(self) -> str:
        """``a + b*N from nproc 1,2,4; LOO error 1.2%``: what a predicted figure stands on."""
        sizes = ",".join(map(str, self.sizes))
        error = ("LOO error n/a: two sizes" if self.loo_error is None
                 else f"LOO error {self.loo_error * 100:.1f}%")
        text = f"{self.model.formula} from nproc {sizes}; {error}"
        if self.left_out:
            kept = self.loo_error_with_left_out or 0.0
            text += (f"; nproc {','.join(str(n) for n, _ in self.left_out)} left out: off the larger "
                     f"sizes' trend (LOO error {kept * 100:.1f}% with it)")
        return text

    def as_dict(self) -> dict:
        return {
            "model": self.model.name,
            "formula": self.model.formula,
            "coefficients": [round(c, 6) for c in self.coefficients],
            "fitted_on": {str(n): round(v, 3) for n, v in self.points},
            "loo_error": None if self.loo_error is None else round(self.loo_error, 6),
            "candidates": {c.model.name: (None if c.loo_error is None else round(c.loo_error, 6))
                           for c in self.candidates},
            "left_out": {str(n): round(v, 3) for n, v in self.left_out},
            "loo_error_with_left_out": (None if self.loo_error_with_left_out is None
                                        else round(self.loo_error_with_left_out, 6)),
        }


@dataclass(frozen=True)
class Prediction:
    """A peak at a world size that was not launched: typed apart from every measurement."""

    world_size: int
    mib: float
    fit: Fit
    rank_label: str = "rank 0"
    floor_mib: float | None = None  # set: the fit is of the job's part, and this floor was added
    floor_size: int | None = None  # the launched size whose floor stands for the predicted one's

    @property
    def validated(self) -> bool:
        """Judged on sizes it did not see (leave-one-out: three launched sizes at least)."""
        return self.fit.loo_error is not None

    def describe(self) -> str:
        text = f"predicted by {self.fit.describe()}"
        if self.floor_mib is not None:
            text += (f"; fitted above the floor, plus the floor measured at nproc={self.floor_size} "
                     f"({self.floor_mib:.0f} MiB: the communicator's own growth past it not measured)")
        return text

    def as_dict(self) -> dict:
        out = {"mib": round(self.mib, 3), "rank": self.rank_label, "basis": self.describe(), **self.fit.as_dict()}
        if self.floor_mib is not None:
            out.update(floor_mib=round(self.floor_mib, 3), floor_size=self.floor_size)
        return out


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the system is singular."""
    size = len(vector)
    rows = [row[:] + [v] for row, v in zip(matrix, vector)]
    scale = max((abs(x) for row in matrix for x in row), default=0.0) or 1.0
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, size + 1):
                rows[r][c] -= factor * rows[col][c]
    out = [0.0] * size
    for r in range(size - 1, -1, -1):
        out[r] = (rows[r][size] - sum(rows[r][c] * out[c] for c in range(r + 1, size))) / rows[r][r]
    return out


def least_squares(model: Model, points: Sequence[tuple[int, float]]) -> tuple[float, ...] | None:
    """Coefficients minimising the squared error; None when the sizes cannot determine them."""
    if len({n for n, _ in points}) < model.params:
        return None
    design = [[term(n) for term in model.terms] for n, _ in points]
    normal = [[sum(row[i] * row[j] for row in design) for j in range(model.params)] for i in range(model.params)]
    rhs = [sum(row[i] * v for row, (_, v) in zip(design, points)) for i in range(model.params)]
    solution = _solve(normal, rhs)
    return None if solution is None else tuple(solution)


def _relative(miss: float, actual: float) -> float:
    # Against 1 MiB at least: a zero-MiB point must not turn a 0.1 MiB miss into infinity.
    return abs(miss) / max(abs(actual), 1.0)


def loo_error(model: Model, points: Sequence[tuple[int, float]]) -> float | None:
    """Worst relative miss when each point is predicted from the others; None when not judgeable."""
    worst = 0.0
    for i, (n, actual) in enumerate(points):
        rest = [p for j, p in enumerate(points) if j != i]
        coefficients = least_squares(model, rest)
        if coefficients is None:
            return None
        predicted = sum(c * term(n) for c, term in zip(coefficients, model.terms))
        worst = max(worst, _relative(predicted - actual, actual))
    return worst


def _checked(points: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    out = []
    for n, mib in points:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PredictError(f"world size {n!r} is not accepted: expected an int >= 1")
        if mib is None or not math.isfinite(float(mib)) or float(mib) < 0:
            raise PredictError(f"peak at nproc={n} is {mib!r}: expected a finite number of MiB >= 0")
        out.append((n, float(mib)))
    sizes = [n for n, _ in out]
    if len(set(sizes)) != len(sizes):
        raise PredictError(f"world sizes {sorted(sizes)} repeat: expected one peak per size")
    if len(out) < 2:
        raise PredictError(f"{len(out)} measured size(s) ({', '.join(map(str, sizes)) or 'none'}): "
                           "a prediction needs at least two distinct world sizes")
    return tuple(sorted(out))


def fit(points: Iterable[tuple[int, float]], models: Sequence[Model] = MODELS) -> Fit:
    """Choose and fit a model of peak MiB versus world size (see the module docstring).

    One process is often another program: no communicator, no collective, no distributed start-up
    (OneFlow's multi-rank runtime, NCCL's buffers), so it uses *less* than the larger sizes' trend
    says. When the best model over every size misses a held-out size by more than
    :data:`REGIME_GAP`, at least two sizes above 1 were launched, and nproc=1 lies below what the
    fit over those larger sizes gives at 1, that fit is used instead if it predicts its own
    held-out sizes better (or cannot be judged: two sizes); nproc=1 is then reported as left out,
    with the error it caused. An nproc=1 *above* the trend is kept: that is what sharded state
    (``a + b/N``) looks like.
    """
    pts = _checked(points)
    chosen = _fit(pts, models)
    above = tuple(p for p in pts if p[0] > 1)
    if len(above) < 2 or len(above) == len(pts) or chosen.loo_error is None or chosen.loo_error <= REGIME_GAP:
        return chosen
    regime = _fit(above, models)
    one = pts[0][1]
    if regime.at(1) <= one or (regime.loo_error is not None and regime.loo_error >= chosen.loo_error):
        return chosen  # nproc=1 above the trend is no missing communicator: sharded state looks so
    return replace(regime, left_out=tuple(p for p in pts if p[0] == 1), loo_error_with_left_out=chosen.loo_error)


def _fit(pts: tuple[tuple[int, float], ...], models: Sequence[Model]) -> Fit:
    if len(pts) == 2:  # nothing can be judged: the line through both, and no more than that
        coefficients = least_squares(LINEAR, pts)
        assert coefficients is not None  # two distinct sizes determine a line
        reason = "two sizes: only the line through them"
        return Fit(LINEAR, coefficients, pts, None,
                   tuple(Candidate(m, None, "" if m is LINEAR else reason) for m in models))
    candidates: list[Candidate] = []
    for model in models:
        if len(pts) <= model.params:
            candidates.append(Candidate(model, None, f"needs {model.params + 1} sizes to be judged"))
            continue
        candidates.append(Candidate(model, loo_error(model, pts)))
    judged = [c for c in candidates if c.loo_error is not None]
    if not judged:
        raise PredictError("no model could be judged on these sizes")
    best = min(c.loo_error for c in judged if c.loo_error is not None)
    chosen = next(c for c in judged if c.loo_error is not None and c.loo_error <= best + TIE)
    coefficients = least_squares(chosen.model, pts)
    if coefficients is None:  # judged on subsets, so the full set determines it too
        raise PredictError(f"{chosen.model.formula} cannot be fitted on nproc {[n for n, _ in pts]}")
    return Fit(chosen.model, coefficients, pts, chosen.loo_error, tuple(candidates))


def predict(points: Iterable[tuple[int, float]], world_size: int, rank_label: str = "rank 0",
            floors: Mapping[int, float] | None = None) -> Prediction:
    """The peak at ``world_size`` from the fitted model.

    With ``floors`` (an empty job's figure at each launched size: the CUDA context, the framework's
    start-up, from 2 ranks the communicator), the part above the floor is what is fitted: on a GPU
    the step from 1 to 2 ranks is mostly the communicator (612 -> 1452 MiB), which a line through
    1 and 2 would carry on to every size. The floor at the predicted size is taken as the one of
    the largest launched size, and the prediction says so.
    """
    points = list(points)
    if floors and points and all(n in floors for n, _ in points):
        chosen = fit([(n, mib - floors[n]) for n, mib in points])
        top = max(n for n, _ in points)
        job = max(chosen.at(world_size), 0.0)  # a job's own part is never below nothing
        return Prediction(world_size, job + floors[top], chosen, rank_label, floors[top], top)
    chosen = fit(points)
    return Prediction(world_size, chosen.at(world_size), chosen, rank_label)
