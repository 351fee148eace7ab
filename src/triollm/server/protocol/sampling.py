"""The sampling fields that completions and chat share, with vLLM's extras, and how
they become ``SamplingParams`` (whose own validation names the offending field)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from triollm.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams
from triollm.server.body_text import string_list_problem as bounded_list_problem
from triollm.server.limits import MAX_N, MAX_STRING_LIST_CHARS, MAX_STRING_LIST_ITEMS
from triollm.server.protocol.base import CheckedRequest, StreamOptions
from triollm.server.protocol.structured import Constraint, StructuredOutputFields

__all__ = ["SamplingRequest", "string_list_problem"]


def string_list_problem(value: object) -> str | None:
    """What is wrong with a ``stop`` or ``bad_words`` value past the server's bounds
    (None: nothing). The engine prepares each on the event loop (the stop strings'
    automaton, the bad words tokenized), in time proportional to its size."""
    return bounded_list_problem(value, MAX_STRING_LIST_ITEMS, MAX_STRING_LIST_CHARS)


class SamplingRequest(StructuredOutputFields, CheckedRequest):
    """The sampling fields shared by completions and chat, with vLLM's extras and the
    structured-output fields (``StructuredOutputFields``)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    priority: int = 0
    # co-serving (the seed's fields): served first, and steps sized to keep to the SLO,
    # under --scheduling-policy slo; ttft_slo is an optional first-token target
    is_latency_sensitive: bool | str = False
    slo: float | None = Field(default=None, gt=0)
    ttft_slo: float | None = Field(default=None, gt=0)
    request_id: str | None = None
    #: vLLM's field: only requests with the same salt share prefix-cache blocks.
    cache_salt: str | None = Field(default=None, min_length=1)
    #: vLLM's field: logprob tokens as ``token_id:N`` (text that cannot be decoded
    #: alone, such as part of a UTF-8 character, stays exact).
    return_tokens_as_token_ids: bool | None = None
    #: vLLM's field: the prompt's and each choice's token ids in the reply (streamed:
    #: the prompt's in the first event, each event's new tokens in it).
    return_token_ids: bool = False

    def check_supported(self) -> None:
        """Raise ``ValueError`` naming the first field that asks for what this server
        does not do."""

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: Mapping[str, Any] | None = None,
                        structured: Constraint | None = None) -> SamplingParams:
        """``SamplingParams`` for this request (raises ``ValueError`` naming the field).
        The request's own ``prompt_logprobs`` wins over the one its endpoint derives.
        Fields the request leaves out take ``defaults`` (the model's generation config)
        and then vLLM's neutral values. ``structured`` is the output's constraint
        (``structured_output()``)."""
        if self.prompt_logprobs is not None:
            if self.stream:
                raise ValueError("prompt_logprobs: not available when stream is true")
            prompt_logprobs = self.prompt_logprobs
        defaults = defaults or {}

        def pick(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        top_k = pick("top_k", 0)
        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=0 if top_k < 0 else top_k,
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words,
            structured_outputs=None if structured is None else structured.params,
            output_kind=RequestOutputKind.DELTA if self.stream
            else RequestOutputKind.FINAL_ONLY,
        )

    @field_validator("stop", "bad_words", mode="before")
    @classmethod
    def _bounded(cls, value: object) -> object:
        problem = string_list_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    def _logit_bias(self) -> dict[int, float] | None:
        # OpenAI sends token ids as JSON object keys (strings); like vLLM, biases are
        # clamped to OpenAI's [-100, 100].
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
            bias[token] = min(max(value, -100.0), 100.0)
        return bias

    @property
    def latency_sensitive(self) -> bool:
        value = self.is_latency_sensitive
        return value.strip().lower() in ("true", "1", "yes") if isinstance(value, str) else value
