"""What the OpenAI request and response models share: unknown fields kept to be refused
or reported, the error shape, usage, chat messages and how they are rendered, and
vLLM's prompt logprobs.

Every field is honoured or refused: vLLM's fields this server does not implement are
400s unless they carry their neutral value (``REFUSED_FIELDS``), and fields nobody
defines (a typo such as ``max_tokns``) are logged as ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["REFUSED_FIELDS", "ChatMessage", "ChatTemplateFields", "CheckedRequest",
           "ErrorInfo", "ErrorResponse", "PromptLogprobs", "PromptTokenLogprob",
           "StreamOptions", "UsageInfo"]


#: vLLM request fields this server does not implement, with the values that ask for
#: nothing (a client that sends one of those loses nothing); any other value is a 400.
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False, None), "beam search is not supported"),
    "length_penalty": ((1.0, 1, None), "applies only to beam search, which is not "
                                       "supported"),
    "watermarking": ((None,), "watermarking is not supported"),
    "logprob_token_ids": ((None, []), "not supported; use logprobs / top_logprobs"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported"),
    # chat completions declare the first two (honoured there); elsewhere they ask for
    # what only chat does
    "reasoning_effort": ((None,), "only /v1/chat/completions passes it to a chat template"),
    "include_reasoning": ((True, None), "only /v1/chat/completions splits reasoning "
                                        "(--reasoning-parser)"),
    "thinking_token_budget": ((None,), "a thinking budget is not supported"),
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

class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

class ChatTemplateFields(CheckedRequest):
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

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

class PromptTokenLogprob(BaseModel):
    """vLLM's ``Logprob``: one token's log-probability, 1-based rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per prompt position (``None`` for the first): token id -> its log-probability.
PromptLogprobs = list[dict[int, PromptTokenLogprob] | None]
