"""How long an engine step takes, learned online from the steps the engine ran.

The SLO-aware scheduler sizes each step so that its predicted time stays under the
tightest per-token SLO among the running latency-sensitive requests. The prediction is
linear in what a step computes:

    seconds ~ c0 + c1 * tokens + c2 * sequences + c3 * attention

where ``attention`` counts query-key pairs (each new token attends to every earlier
token of its sequence). The coefficients are least squares over past steps, with older
steps weighted down geometrically so the model follows changes in load and machine
speed; a coefficient that comes out negative is dropped and the rest refitted, so
predictions grow with every feature. Pure Python: no torch, no event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepShape", "StepTimeModel", "attention_pairs"]

#: Features are scaled to similar magnitudes before fitting.
_SCALES = (1.0, 1e-3, 1e-2, 1e-6)


def attention_pairs(start_position: int, num_tokens: int) -> int:
    """Query-key pairs computed when ``num_tokens`` tokens start at ``start_position``."""
    return num_tokens * start_position + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, as far as its running time is concerned."""

    num_tokens: int
    num_sequences: int
    attention: int

    def features(self) -> tuple[float, ...]:
        raw = (1.0, float(self.num_tokens), float(self.num_sequences), float(self.attention))
        return tuple(value * scale for value, scale in zip(raw, _SCALES, strict=True))


class StepTimeModel:
    """Online least-squares fit of step time to ``StepShape``.

    ``predict`` returns ``None`` until ``min_observations`` steps have been observed.
    """

    def __init__(self, *, forgetting: float = 0.99, min_observations: int = 8) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting: must be in (0, 1], got {forgetting}")
        self.forgetting = forgetting
        self.min_observations = min_observations
        size = len(_SCALES)
        self._xtx = [[0.0] * size for _ in range(size)]
        self._xty = [0.0] * size
        self._coefficients: list[float] | None = None
        self.num_observations = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not seconds >= 0.0:
            return
        x = shape.features()
        keep = self.forgetting
        for i, xi in enumerate(x):
            row = self._xtx[i]
            for j, xj in enumerate(x):
                row[j] = keep * row[j] + xi * xj
            self._xty[i] = keep * self._xty[i] + xi * seconds
        self.num_observations += 1
        self._coefficients = None

    @property
    def is_fitted(self) -> bool:
        return self.num_observations >= self.min_observations

    def coefficients(self) -> list[float] | None:
        """Seconds per unit of each feature (constant, token, sequence, attention pair)."""
        if not self.is_fitted:
            return None
        if self._coefficients is None:
            self._coefficients = self._fit()
        return [c * s for c, s in zip(self._coefficients, _SCALES, strict=True)]

    def predict(self, shape: StepShape) -> float | None:
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        return (coefficients[0] + coefficients[1] * shape.num_tokens
                + coefficients[2] * shape.num_sequences + coefficients[3] * shape.attention)

    def _fit(self) -> list[float]:
        active = list(range(len(_SCALES)))
        while True:
            solution = _solve([[self._xtx[i][j] for j in active] for i in active],
                              [self._xty[i] for i in active])
            negative = [k for k, value in zip(active, solution, strict=True) if value < 0.0]
            if not negative:
                coefficients = [0.0] * len(_SCALES)
                for k, value in zip(active, solution, strict=True):
                    coefficients[k] = value
                return coefficients
            # Drop the most negative feature (the constant last of all) and refit.
            worst = min(negative, key=lambda k: (k == 0, solution[active.index(k)]))
            active.remove(worst)
            if not active:
                return [0.0] * len(_SCALES)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve a small symmetric system by Gaussian elimination, with a ridge so that
    collinear features (decode-only steps have tokens == sequences) stay solvable."""
    size = len(rhs)
    trace = sum(matrix[i][i] for i in range(size)) or 1.0
    ridge = 1e-9 * trace
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for i in range(size):
        a[i][i] += ridge
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(a[r][column]))
        a[column], a[pivot] = a[pivot], a[column]
        if a[column][column] == 0.0:
            continue
        for row in range(column + 1, size):
            factor = a[row][column] / a[column][column]
            for k in range(column, size + 1):
                a[row][k] -= factor * a[column][k]
    solution = [0.0] * size
    for row in range(size - 1, -1, -1):
        if a[row][row] == 0.0:
            continue
        total = a[row][size] - sum(a[row][k] * solution[k] for k in range(row + 1, size))
        solution[row] = total / a[row][row]
    return solution
