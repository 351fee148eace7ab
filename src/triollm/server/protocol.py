"""OpenAI request and response models, with vLLM's extra sampling fields.

Requests are validated by pydantic (unknown fields are ignored, as OpenAI and vLLM do;
wrong types and out-of-range values are 400s) and turned into ``SamplingParams``, whose
own validation names the offending field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from triollm.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams
from triollm.server.limits import MAX_N

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "ErrorResponse",
    "GenerateRequest",
    "TokenizeRequest",
    "UsageInfo",
]



def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """The sampling fields shared by completions and chat, with vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
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
    length_penalty: float = 1.0
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
    # Structured output (OpenAI's response_format, vLLM's guided_* and
    # structured_outputs) is not implemented. These are refused rather than ignored: a
    # client that asked for JSON would otherwise get free text it then fails to parse.
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def check_supported(self) -> None:
        """Raise ``ValueError`` naming the first field that asks for what this server
        does not do."""
        if self.response_format is not None:
            kind = self.response_format.get("type")
            if kind != "text":
                raise ValueError(f"response_format: type {kind!r} is not supported (this "
                                 f"server has no structured output); only 'text' is")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs"):
            if getattr(self, name) not in (None, "", {}, []):
                raise ValueError(f"{name}: guided decoding is not supported by this server")

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """``SamplingParams`` for this request (raises ``ValueError`` naming the field).
        The request's own ``prompt_logprobs`` wins over the one its endpoint derives."""
        if self.prompt_logprobs is not None:
            if self.stream:
                raise ValueError("prompt_logprobs: not available when stream is true")
            prompt_logprobs = self.prompt_logprobs
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k < 0 else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
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
            output_kind=RequestOutputKind.DELTA if self.stream
            else RequestOutputKind.FINAL_ONLY,
        )

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


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise ValueError("suffix: not supported")
        if self.best_of not in (None, 1, self.n):
            # vLLM's V1 engine dropped best_of too; n samples plus logprobs replace it.
            raise ValueError("best_of: not supported (use n and logprobs)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    echo: bool = False
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        # As vLLM: tools without a tool_choice mean "auto". This server has no tool-call
        # parser (vLLM's --enable-auto-tool-choice) and no structured output, so only
        # "none" is served; the tools still reach the chat template.
        if self.tools == []:
            raise ValueError("tools: must not be an empty list (omit the field instead)")
        choice = self.tool_choice
        if choice is None and self.tools:
            choice = "auto"
        if choice is not None and choice != "none":
            if not self.tools:
                raise ValueError("tool_choice: given without tools")
            shown = choice if isinstance(choice, str) else "a named tool"
            raise ValueError(f"tool_choice: {shown!r} is not supported (this server has no "
                             f"tool-call parser); send tool_choice 'none' or no tools")


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """vLLM's ``Logprob``: one token's log-probability, 1-based rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per prompt position (``None`` for the first): token id -> its log-probability.
PromptLogprobs = list[dict[int, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "triollm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # shown to the chat template, as in vLLM


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class GenerateRequest(BaseModel):
    """vLLM's minimal ``POST /generate`` (the seed's api_server): a prompt, ``stream``,
    and any ``SamplingParams`` field."""

    model_config = ConfigDict(extra="allow")

    prompt: str
    stream: bool = False
