"""OpenAI request and response models, with vLLM's extra sampling fields.

Requests are validated by pydantic (wrong types and out-of-range values are 400s) and
turned into ``SamplingParams``, whose own validation names the offending field. Every
field is honoured or refused: vLLM's fields this server does not implement are 400s
unless they carry their neutral value (``REFUSED_FIELDS``), and fields nobody defines
(a typo such as ``max_tokns``) are logged as ignored, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from triollm.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams
from triollm.server.limits import MAX_N

__all__ = [
    "REFUSED_FIELDS",
    "ChatCompletionRequest",
    "CheckedRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "ErrorResponse",
    "GenerateRequest",
    "TokenizeRequest",
    "UsageInfo",
]



#: vLLM request fields this server does not implement, with the values that ask for
#: nothing (a client that sends one of those loses nothing); any other value is a 400.
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False, None), "beam search is not supported"),
    "length_penalty": ((1.0, 1, None), "applies only to beam search, which is not "
                                       "supported"),
    "watermarking": ((None,), "watermarking is not supported"),
    "logprob_token_ids": ((None, []), "not supported; use logprobs / top_logprobs"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported"),
    "reasoning_effort": ((None,), "this server has no reasoning parser"),
    "thinking_token_budget": ((None,), "this server has no reasoning parser"),
    "include_reasoning": ((True, None), "this server has no reasoning parser"),
    "media_io_kwargs": ((None, {}), "this server serves text-only models"),
    "mm_processor_kwargs": ((None, {}), "this server serves text-only models"),
    "return_mm_kwargs": ((None, False), "this server serves text-only models"),
    "mm_payload": (("tensors", None), "this server serves text-only models"),
    "kv_transfer_params": ((None, {}), "disaggregated serving is not supported"),
    "ec_transfer_params": ((None, {}), "disaggregated serving is not supported"),
    "vllm_xargs": ((None, {}), "custom logits processors are not supported"),
    "repetition_detection": ((None,), "not supported"),
    "return_token_offsets": ((False, None), "not supported"),
    "return_prompt_text": ((None, False), "not supported"),
    "routed_experts_prompt_start": ((0, None), "not supported"),
    "truncation_side": ((None, "left"), "prompts are truncated on the left only"),
    "stream_interval": ((None, 1), "every token is streamed as it is produced"),
    "session_id": ((None,), "sessions are not supported"),
    "instruction": ((None, ""), "score instructions (reranker prompt templates) are not "
                                "supported"),
    "max_tokens_per_query": ((None,), "not supported; use truncate_prompt_tokens"),
    "max_tokens_per_doc": ((None,), "not supported; use truncate_prompt_tokens"),
    "padding": ((None,), "not supported: prompts are packed without padding"),
}


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


class CheckedRequest(BaseModel):
    """A request body whose unknown fields are kept, to be refused or reported."""

    model_config = ConfigDict(extra="allow")

    def refused_or_ignored(self) -> list[str]:
        """Raise ``ValueError`` for a vLLM field this server does not implement, set to
        anything but its neutral value; return the names of fields nobody defines."""
        ignored = []
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED_FIELDS:
                neutral, reason = REFUSED_FIELDS[name]
                if not any((value == ok and type(value) is type(ok)) or value is ok
                           for ok in neutral):
                    raise ValueError(f"{name}: {reason}")
            else:
                ignored.append(name)
        return ignored


class _SamplingRequest(CheckedRequest):
    """The sampling fields shared by completions and chat, with vLLM's extras."""

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
                        prompt_logprobs: int | None = None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """``SamplingParams`` for this request (raises ``ValueError`` naming the field).
        The request's own ``prompt_logprobs`` wins over the one its endpoint derives.
        Fields the request leaves out take ``defaults`` (the model's generation config)
        and then vLLM's neutral values."""
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
    add_special_tokens: bool = True

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


class _ChatTemplateFields(CheckedRequest):
    """What a request that carries messages says about rendering them (chat completions
    and ``/tokenize``)."""

    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # shown to the chat template, as in vLLM
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def generation_prompt(self) -> bool:
        """``add_generation_prompt`` as vLLM reads it: off when the final message is to
        be continued, unless the request set both (which the rendering refuses)."""
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            return False
        return self.add_generation_prompt


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_special_tokens: bool = False
    echo: bool = False
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
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
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


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
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "triollm"
    root: str | None = None
    #: For a LoRA adapter: the base model it runs over.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_ChatTemplateFields):
    """``POST /tokenize``: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(CheckedRequest):
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
