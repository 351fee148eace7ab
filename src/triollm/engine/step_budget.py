"""One step's budget while the scheduler fills it: the tokens left under
``max_num_batched_tokens`` and, under the ``slo`` policy, the room left in the step's
predicted time (``StepTimeModel``, engine/step_time.py) below the time limit the
tightest SLO sets. No torch, no event loop.
"""

from __future__ import annotations

from triollm.engine.request import Request
from triollm.engine.step_time import StepShape, StepTimeModel, attention_pairs

__all__ = ["SLO_HEADROOM", "UNFITTED_FILL_TOKENS", "StepBudget"]

#: Fraction of the tightest SLO a step is planned to take: the rest absorbs the scatter
#: of real steps around the fitted step-time model.
SLO_HEADROOM = 0.8
#: Tokens a step may add for requests without an SLO while the step-time model is still
#: learning (it learns from every step, so this only matters just after start-up).
UNFITTED_FILL_TOKENS = 32


class StepBudget:
    """Tokens left in this step, and, under a time limit, room left in its predicted
    time."""

    def __init__(self, max_tokens: int, time_limit: float | None,
                 model: StepTimeModel | None, *, chunked_prefill: bool) -> None:
        self.tokens_left = max_tokens
        self.chunked_prefill = chunked_prefill
        self.time_limit = time_limit
        self.model = model
        self.num_tokens = 0
        self.num_sequences = 0
        self.attention = 0
        self.unlimited_tokens_left = UNFITTED_FILL_TOKENS

    def grant(self, request: Request, start: int, wanted: int) -> int:
        """How many of ``wanted`` tokens ``request`` may compute in this step, from
        position ``start``."""
        limit = min(wanted, self.tokens_left)
        if limit <= 0 or self.time_limit is None or self.model is None:
            return limit
        if request.is_latency_sensitive:
            # Latency-sensitive work defines the limit; it only keeps prefill chunks
            # from stretching the step beyond it (when prompts can be chunked at all).
            if not self.chunked_prefill:
                return limit
            return max(1, self._fits(start, limit))
        if not self.model.is_fitted:
            return min(limit, self.unlimited_tokens_left)
        return self._fits(start, limit)

    def _fits(self, start: int, limit: int) -> int:
        """The largest n <= limit whose addition keeps the predicted time in the limit."""
        assert self.model is not None and self.time_limit is not None
        if not self.model.is_fitted:
            return limit
        low, high = 0, limit
        while low < high:
            middle = (low + high + 1) // 2
            if self._predict_with(start, middle) <= self.time_limit:
                low = middle
            else:
                high = middle - 1
        return low

    def _predict_with(self, start: int, num_tokens: int) -> float:
        assert self.model is not None
        predicted = self.model.predict(StepShape(
            self.num_tokens + num_tokens, self.num_sequences + 1,
            self.attention + attention_pairs(start, num_tokens)))
        return predicted if predicted is not None else 0.0

    def take(self, request: Request, start: int, num_tokens: int) -> None:
        self.tokens_left -= num_tokens
        self.num_tokens += num_tokens
        self.num_sequences += 1
        self.attention += attention_pairs(start, num_tokens)
        if not request.is_latency_sensitive:
            self.unlimited_tokens_left -= num_tokens
