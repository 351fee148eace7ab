"""Per-request sampling parameters, validated once at construction (pooling's are in
pooling_params.py).

Field names and meanings follow vLLM's ``SamplingParams`` so that code written for
vLLM runs unchanged. Every invalid value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["SEED_MAX", "SEED_MIN", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams",
           "check_text"]

_GREEDY_EPSILON = 1e-5
#: vLLM's bounds for ``seed``: a signed 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(enum.Enum):
    """What each streamed ``RequestOutput`` carries."""

    CUMULATIVE = 0  #: all text and tokens produced so far
    DELTA = 1  #: only what is new since the previous output
    FINAL_ONLY = 2  #: nothing until the request finishes


def _fail(field_name: str, message: str) -> ValueError:
    return ValueError(f"{field_name}: {message}")


def check_text(field_name: str, text: str) -> None:
    """Refuse text that is not valid Unicode (JSON can carry a lone surrogate such as
    ``"\\ud800"``, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _fail(field_name, f"is not valid Unicode text ({error.reason} at position "
                                f"{error.start})") from None


@dataclass
class SamplingParams:
    """How to pick the tokens of one request (vLLM's fields and defaults).

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``seed`` makes
    one request's sampling reproducible whatever else is in the batch. ``logit_bias``
    adds to the logits of the given token ids (OpenAI's field; greedy rows see it too)
    and ``allowed_token_ids`` restricts sampling to those ids; the engine refuses ids
    outside the model's vocabulary. ``bad_words`` are never generated: as in vLLM, a
    word's last token is banned whenever the output ends with the word's other tokens
    (each word is tried with and without a leading space). ``truncate_prompt_tokens``
    keeps only that many tokens from the end of the prompt.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: The constraint the output must satisfy (JSON schema, regex, choice, grammar...).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine: the tokenizer's end-of-sequence ids, and each bad word
    # as token ids (with and without a leading space).
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False,
                                         compare=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False,
                                                 repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None and not isinstance(self.bad_words, str):
            self.bad_words = list(self.bad_words)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.output_kind, int):
            self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_real(value: object) -> bool:
            return (isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value))

        if not is_int(self.n) or self.n < 1:
            raise _fail("n", f"must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            if not is_real(getattr(self, name)):
                raise _fail(name, f"must be a finite number, got {getattr(self, name)!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not self.temperature >= 0.0:
            raise _fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise _fail("top_k", f"must be -1 (disabled) or an integer >= 0, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not is_int(self.seed)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise _fail("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (a signed "
                                f"64-bit integer), got {self.seed!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise _fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail(
                "min_tokens",
                f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise _fail(name, f"must be an integer >= 0, got {value!r}")
        for name in ("stop", "bad_words"):
            words = getattr(self, name) or []
            if not isinstance(words, list) or any(not isinstance(w, str) or not w
                                                  for w in words):
                raise _fail(name, "must contain only non-empty strings")
            for word in words:
                check_text(name, word)
        stops: list[str] = self.stop if isinstance(self.stop, list) else []
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(not is_int(t) or t < 0 for t in getattr(self, name) or []):
                raise _fail(name, "must contain only non-negative integers")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise _fail("allowed_token_ids", "must not be empty")
        if self.truncate_prompt_tokens is not None and (
                not is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1):
            raise _fail("truncate_prompt_tokens",
                        f"must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if stops and not self.detokenize:
            raise _fail("stop", "stop strings need detokenize=True")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise _fail("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _fail("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _fail("logit_bias", "must map token ids to biases")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise _fail("logit_bias", f"keys must be token ids >= 0, got {token!r}")
                if (not isinstance(bias, int | float) or isinstance(bias, bool)
                        or not math.isfinite(bias)):
                    raise _fail("logit_bias", f"bias for token {token} must be a finite "
                                              f"number, got {bias!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse ``logit_bias`` and ``allowed_token_ids`` entries outside a vocabulary
        of ``vocab_size`` tokens (the engine calls this when a request arrives)."""
        for name, ids in (("logit_bias", self.logit_bias or {}),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            outside = sorted(t for t in ids if t >= vocab_size)
            if outside:
                raise _fail(name, f"token ids {outside[:5]} are outside the vocabulary "
                                  f"(size {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """A copy that shares no mutable state with this one (the engine works on its
        own copy: the caller may reuse or change theirs)."""
        params = self.child(0, n=self.n)
        if self.structured_outputs is not None:
            params.structured_outputs = self.structured_outputs.copy()
        return params

    def child(self, index: int, *, n: int = 1) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n > 1`` request: the seed offset by
        ``index``, wrapped around within the signed 64-bit range. The constraint
        (``structured_outputs``) is this one's, shared: nothing changes it once the
        engine holds its own copy, and a schema can be megabytes."""
        seed = (None if self.seed is None
                else (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN)
        params = SamplingParams(**{**self._as_kwargs(), "n": n, "seed": seed})
        params.all_stop_token_ids = set(self.all_stop_token_ids)
        params.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        return params

    def _as_kwargs(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if name not in ("all_stop_token_ids", "bad_words_token_ids")
        }
