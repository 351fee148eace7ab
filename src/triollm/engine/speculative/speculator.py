"""Which decodes speculate, with how many draft tokens, and what came of it.

The scheduler asks ``Speculator.propose`` for each running request about to decode one
token, and reports each verified step to ``observe``. With ``ngram`` the drafts are
looked up here; with ``draft_model`` the runner's draft model proposed them after the
request's previous step (``num_proposals`` asks for them, ``receive`` keeps them).
A request speculates only where the runner's verification reproduces its sampling
exactly: not with repetition, frequency or presence penalties, bad words or
``min_tokens`` still to reach (they depend on the tokens before each position). A
LoRA request's drafts are verified through its adapter (a draft model proposes without
it). Under a structured-output constraint the runner cuts the drafts at the
first token the grammar forbids and samples each position under its mask. A step
speculates only while at most ``disable_by_batch_size`` requests run.
A request whose drafts keep failing pauses: over its last ``ACCEPTANCE_WINDOW``
drafting steps, fewer than ``MIN_ACCEPTANCE_RATE`` of the draft tokens accepted stops
its proposals (and a draft model's work for it) for ``PAUSE_STEPS`` of its steps, then
it tries afresh.
No torch, no event loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from triollm.config import SpeculativeConfig
from triollm.engine.request import Request
from triollm.engine.speculative.ngram import NgramIndex
from triollm.step import RunnerOutput, ScheduledRequest, SchedulerOutput

__all__ = ["ACCEPTANCE_WINDOW", "MIN_ACCEPTANCE_RATE", "PAUSE_STEPS", "SpecDecodingStatistics",
           "Speculator", "can_speculate"]

#: Drafting steps over which a request's acceptance rate is judged.
ACCEPTANCE_WINDOW = 8
#: Below this fraction of its draft tokens accepted over the window, a request pauses.
MIN_ACCEPTANCE_RATE = 0.1
#: A paused request's steps without proposals before it tries again.
PAUSE_STEPS = 32


@dataclass(frozen=True)
class SpecDecodingStatistics:
    """vLLM's spec-decode counters since start: verified drafts (a request's drafts in
    one step), their tokens, the tokens accepted, and per draft position how often it
    was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over draft tokens (None before any draft)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens


class _RequestState:
    __slots__ = ("index", "paused", "proposals", "window")

    def __init__(self, config: SpeculativeConfig) -> None:
        self.index = (NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        #: ``draft_model``: the runner's proposals for the request's next step.
        self.proposals: list[int] = []
        #: (draft tokens, accepted) of its latest drafting steps.
        self.window: deque[tuple[int, int]] = deque(maxlen=ACCEPTANCE_WINDOW)
        #: Steps left without proposals.
        self.paused = 0


def can_speculate(request: Request) -> bool:
    """Whether the runner's verification reproduces this request's sampling."""
    params = request.sampling_params
    return (params is not None and not params.has_penalties
            and not params.bad_words_token_ids
            and request.num_output_tokens >= params.min_tokens)


class Speculator:
    """Proposes draft tokens per request and counts how they fared."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._states: dict[str, _RequestState] = {}
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._accepted_per_pos = [0] * config.num_speculative_tokens

    def propose(self, request: Request, num_running: int) -> list[int]:
        """Draft tokens for ``request``'s next decode (empty: decode one token)."""
        if num_running > self.config.disable_by_batch_size or not can_speculate(request):
            return []
        state = self._state(request)
        # The step's own token comes on top of the drafts: stay within the limits.
        room = self.max_model_len - request.num_tokens - 1
        params = request.sampling_params
        if params is not None and params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        k = max(0, min(self.config.num_speculative_tokens, room))
        if state.index is None:  # the draft model proposed them (paused: it did not)
            proposals, state.proposals = state.proposals, []
            return proposals[:k]
        if state.paused:
            state.paused -= 1
            return []
        return state.index.propose(request.all_token_ids, k)

    def num_proposals(self, request: Request, num_running: int) -> int:
        """``draft_model``: how many draft tokens the runner proposes after a step that
        samples for ``request`` (0: none, as with ``ngram``)."""
        if (self.config.method != "draft_model" or not can_speculate(request)
                or num_running > self.config.disable_by_batch_size):
            return 0
        state = self._state(request)
        if state.paused:
            state.paused -= 1
            return 0
        return self.config.num_speculative_tokens

    def receive(self, output: SchedulerOutput, runner_output: RunnerOutput) -> None:
        """A step ran: keep the draft model's proposals for each request it sampled for
        (none where it proposed none, so that a proposal is never a step late)."""
        for item in output.scheduled:
            if item.sample and (state := self._states.get(item.request_id)) is not None:
                state.proposals = runner_output.draft_token_ids.get(item.request_id, [])

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _RequestState(self.config)
        return state

    def observe(self, item: ScheduledRequest, output: RunnerOutput | None) -> int:
        """A step with ``item``'s drafts ran: how many of them ``output`` accepted (none
        where it failed)."""
        more = output.more_token_ids.get(item.request_id) if output is not None else None
        num_accepted = len(more) if more else 0
        self._count(item.request_id, item.num_draft_tokens, num_accepted)
        return num_accepted

    def _count(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        self._num_drafts += 1
        self._num_draft_tokens += num_draft_tokens
        self._num_accepted += num_accepted
        for position in range(num_accepted):
            self._accepted_per_pos[position] += 1
        state = self._states.get(request_id)
        if state is None:
            return
        state.window.append((num_draft_tokens, num_accepted))
        if len(state.window) == ACCEPTANCE_WINDOW:
            drafted = sum(d for d, _ in state.window)
            accepted = sum(a for _, a in state.window)
            if accepted < MIN_ACCEPTANCE_RATE * drafted:
                state.paused = PAUSE_STEPS
                state.window.clear()

    def forget(self, request_id: str) -> None:
        """A request finished: drop its index and proposals."""
        self._states.pop(request_id, None)

    def statistics(self) -> SpecDecodingStatistics:
        """vLLM's spec-decode counters since start."""
        return SpecDecodingStatistics(self._num_drafts, self._num_draft_tokens,
                                      self._num_accepted, tuple(self._accepted_per_pos))
