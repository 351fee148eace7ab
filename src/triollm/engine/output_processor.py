"""From sampled tokens to what the caller sees: text, stops, logprobs, ``RequestOutput``.

The engine core does the bookkeeping of a step (computed tokens, finished requests,
timings); for every sampled token it asks the ``OutputProcessor`` whether the token
stops its sequence (stop strings through the incremental detokenizer, eos, stop token
ids, ``max_tokens``, the context length), and for every request touched by the step it
asks for the output to deliver. No torch, no event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from triollm.engine.detokenizer import IncrementalDetokenizer, Tokenizer, decode_text
from triollm.engine.request import Request, RequestStatus
from triollm.engine.stop_strings import StopStrings
from triollm.outputs import CompletionOutput, Logprob, RequestOutput
from triollm.sampling_params import RequestOutputKind, SamplingParams
from triollm.step import TokenLogprobs

__all__ = ["OutputProcessor", "ParentRequest"]


@dataclass
class ParentRequest:
    """A user request: ``n`` sampled sequences that share one prompt and one output."""

    #: The caller's id (what its outputs carry) and the engine's (what it is keyed by).
    request_id: str
    engine_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    children: list[Request]
    prompt_logprobs_sent: bool = False
    #: A pooling request: one child, no text, one output made by the core.
    pooling: bool = False
    #: The caller's W3C trace context (``traceparent``, ``tracestate``), for its span.
    trace_headers: Mapping[str, str] | None = None

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:
            return children[0].is_finished
        return all(child.is_finished for child in children)


class OutputProcessor:
    """Detokenizes, checks stops, and builds each request's ``RequestOutput``."""

    def __init__(self, tokenizer: Tokenizer | None, *, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def make_detokenizer(self, params: SamplingParams, prompt_token_ids: list[int],
                         stop: StopStrings | None = None) -> IncrementalDetokenizer | None:
        """The incremental detokenizer of one sequence (None if it wants no text);
        ``stop``: the automaton of ``params.stop``, when the caller built it already."""
        if not params.detokenize:
            return None
        if self.tokenizer is None:
            raise ValueError("detokenize: this engine has no tokenizer; pass "
                             "detokenize=False")
        return IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=stop if stop is not None else list(params.stop or []),
            include_stop_str_in_output=params.include_stop_str_in_output)

    # -- one sampled token -----------------------------------------------------------

    def check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Detokenize ``token`` (already appended) and say whether it ends the sequence;
        a stop string or stop token id is recorded as the request's ``stop_reason``."""
        params = request.sampling_params
        assert params is not None, "pooling requests sample no tokens"
        stops_here = request.num_output_tokens >= params.min_tokens
        eos = stops_here and not params.ignore_eos and token in self.eos_token_ids
        stop_token = stops_here and token in (params.stop_token_ids or ())
        # As vLLM: the text of an eos or stop token is left out unless
        # include_stop_str_in_output (it shows once skip_special_tokens is off).
        if request.detokenizer is not None and not (
                (eos or stop_token) and not params.include_stop_str_in_output):
            stop = request.detokenizer.append_token(token, check_stop=stops_here)
            if stop is not None:
                request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        if eos:
            return RequestStatus.FINISHED_STOPPED
        if stop_token:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def append_logprobs(self, request: Request, token_lp: TokenLogprobs) -> None:
        if request.logprobs is None:
            return
        request.logprobs.append(self.logprob_dict(token_lp))
        previous = request.cumulative_logprob or 0.0
        request.cumulative_logprob = previous + token_lp.logprobs[0]

    def append_prompt_logprobs(self, request: Request, prompt_lps: list[TokenLogprobs], *,
                               first_position: int) -> None:
        """Record the logprobs of prompt positions ``first_position, ...``; positions
        already recorded (computed again after a preemption) are skipped."""
        recorded = request.prompt_logprobs
        if recorded is None:
            return
        new = prompt_lps[max(0, len(recorded) - first_position):]
        recorded.extend(self.logprob_dict(lp) for lp in new)

    def logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """One position's logprobs as vLLM shows them: token id -> ``Logprob``."""
        result: dict[int, Logprob] = {}
        for token_id, value, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True):
            if token_id not in result:
                text = (decode_text(self.tokenizer, [token_id]) if self.tokenizer is not None
                        else None)
                result[token_id] = Logprob(logprob=value, rank=rank, decoded_token=text)
        return result

    # -- outputs ---------------------------------------------------------------------

    def make_output(self, parent: ParentRequest, finished: bool) -> RequestOutput | None:
        """The output to deliver now (None for a FINAL_ONLY request still running, or
        when no sample has anything new).

        Streaming (DELTA, CUMULATIVE), as vLLM does for ``n > 1``: an output carries the
        samples that changed since the last one (new tokens, or their finish), each one's
        finish exactly once; DELTA gives the new part, CUMULATIVE all of it so far.
        FINAL_ONLY: every sample, once, when the request finishes.
        """
        kind = parent.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = [_completion(child, False) for child in parent.children]
        else:
            delta = kind is RequestOutputKind.DELTA
            completions = [_completion(child, delta) for child in parent.children
                           if _has_news(child)]
            if not completions:
                return None
        first = parent.children[0]
        prompt_logprobs = first.prompt_logprobs
        if kind is RequestOutputKind.DELTA and parent.prompt_logprobs_sent:
            prompt_logprobs = None
        parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=first.metrics,
        )


def _has_news(request: Request) -> bool:
    """Whether a sample has tokens or a finish that no output has carried yet."""
    if request.finish_delivered:
        return False
    return request.is_finished or request.num_output_tokens > request.num_delivered_tokens


def _completion(request: Request, delta: bool) -> CompletionOutput:
    finished = request.is_finished
    text = request.detokenizer.text_to_deliver(finished) if request.detokenizer else ""
    logprobs = request.logprobs
    text_start, token_start = request.num_delivered_chars, request.num_delivered_tokens
    request.num_delivered_chars = len(text)
    request.num_delivered_tokens = request.num_output_tokens
    request.finish_delivered = finished
    if delta:
        text = text[text_start:]
        tokens = request.all_token_ids[request.num_prompt_tokens + token_start:]
        logprobs = logprobs[token_start:] if logprobs is not None else None
    else:
        tokens = request.output_token_ids
        logprobs = list(logprobs) if logprobs is not None else None
    return CompletionOutput(
        index=request.index,
        text=text,
        token_ids=tokens,
        cumulative_logprob=request.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
    )
