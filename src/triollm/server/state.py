"""What every route shares: the engine, the settings, and the server's lifecycle."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import anyio
from fastapi import Request

from triollm.entrypoints.chat_utils import ContentFormat, chat_template_call
from triollm.errors import EngineClosedError
from triollm.log_text import clipped_names
from triollm.lora.request import LoRARequest
from triollm.sampling_params import check_text
from triollm.server.errors import OpenAIError, bad_request, engine_unavailable
from triollm.server.limits import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    LONG_TEXT_CHARS,
)
from triollm.server.offload import Offload, prefix_chars
from triollm.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from triollm.server.tokenizer_process import CallFailed

if TYPE_CHECKING:
    from triollm.config import PoolerConfig
    from triollm.pooling_params import PoolingTask
    from triollm.server.engine_kind import ServedEngine
    from triollm.server.metrics import PrometheusStatLogger

logger = logging.getLogger(__name__)

__all__ = ["ChatRendering", "CorsSettings", "ServerSettings", "ServerState", "server_state"]


@dataclass(frozen=True)
class CorsSettings:
    """Cross-origin access for browser clients; vLLM's flags and defaults (any origin,
    method and header; no credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    #: Any of these keys is accepted as ``Authorization: Bearer KEY``; empty: no key.
    api_keys: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    chat_template: str | None = None
    chat_template_content_format: ContentFormat = "auto"
    #: vLLM's --trust-request-chat-template: a request may bring its own chat template.
    trust_request_chat_template: bool = False
    #: vLLM's --return-tokens-as-token-ids: logprob tokens as ``token_id:N``.
    return_tokens_as_token_ids: bool = False
    cors: CorsSettings = CorsSettings()
    #: vLLM's --enable-auto-tool-choice and --tool-call-parser: tool_choice "auto".
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class ChatRendering:
    """How one request's messages go through the chat template (its fields, or the
    ``/tokenize`` request's)."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None


@dataclass
class ServerState:
    """What the routes share: the engine, the settings and the server's lifecycle.

    ``open_requests`` counts HTTP requests from their arrival to the last byte of their
    response (kept by ``RequestLifetime``): a graceful shutdown waits for it to reach 0.
    """

    engine: ServedEngine
    settings: ServerSettings
    #: None when the engine does not log stats (``--disable-log-stats``).
    metrics: PrometheusStatLogger | None
    shutting_down: bool = False
    open_requests: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)
    #: Warnings given once per server (a field that has no effect under this policy).
    warned: set[str] = field(default_factory=set)
    #: LoRA adapters served under their own model names (``--lora-modules`` and
    #: ``/v1/load_lora_adapter``), and the source of their engine ids.
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    lora_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    #: The worker threads (and processes) that tokenize, render chat templates and
    #: detokenize.
    offload: Offload = field(init=False)

    def __post_init__(self) -> None:
        self.offload = Offload(self.engine.tokenizer)

    def request_started(self) -> None:
        if self.open_requests == 0:
            self.idle = anyio.Event()
        self.open_requests += 1

    def request_ended(self) -> None:
        self.open_requests -= 1
        if self.open_requests == 0:
            self.idle.set()

    async def wait_idle(self) -> None:
        """Return once no generation request is open."""
        while self.open_requests:
            await self.idle.wait()

    # -- request checks shared by the routes --------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The model name a request is answered under: the served model's (for no name
        or one of its names) or a LoRA adapter's; 404 for any other name."""
        names = self.settings.served_model_names
        if name is None or name in names:
            return names[0]
        if name in self.loras:
            return name
        raise OpenAIError(404, f"The model `{name}` does not exist.", type="NotFoundError",
                          param="model")

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return None if name is None else self.loras.get(name)

    def require_accepting(self) -> None:
        """503 while the server shuts down: no new request enters the engine."""
        if self.shutting_down:
            raise engine_unavailable(EngineClosedError("shutting down"))

    def require_generation(self) -> None:
        """400 unless the engine runs a generation model."""
        pooler = self.engine.config.model.pooler
        if pooler is not None:
            routes = ("/v1/embeddings, /pooling" if pooler.task == "embed"
                      else "/classify, /pooling")
            raise OpenAIError(400, f"The model `{self.settings.served_model_names[0]}` is "
                                   f"loaded with --runner pooling ({pooler.task}): it serves "
                                   f"{routes}, /score and /rerank, not text generation.",
                              param="model")

    def require_pooling(self, route: str, task: PoolingTask | None = None) -> PoolerConfig:
        """The pooling model's pipeline; 400 unless the engine runs a pooling model (of
        ``task``, when given)."""
        pooler = self.engine.config.model.pooler
        name = self.settings.served_model_names[0]
        if pooler is None:
            raise OpenAIError(400, f"{route} needs a pooling model; the model `{name}` is "
                                   f"loaded with --runner generate (start the server with "
                                   f"--runner pooling for an embedding or scoring model).",
                              param="model")
        if task is not None and pooler.task != task:
            raise OpenAIError(400, f"{route} needs a{'n' if task == 'embed' else ''} {task} "
                                   f"model; the model `{name}` is loaded with --runner "
                                   f"pooling as a {pooler.task} model.", param="model")
        return pooler

    def check_request(self, body: CompletionRequest | ChatCompletionRequest) -> str:
        """The served model's name, once the model and the features asked for are ours."""
        model = self.check_model(body.model)
        self.require_generation()
        try:
            body.check_supported()
        except ValueError as error:
            raise bad_request(error) from error
        self.check_fields(body)
        policy = self.engine.config.scheduler.policy
        if policy != "slo" and (body.latency_sensitive or body.slo is not None
                                or body.ttft_slo is not None):
            self.warn_once("slo", "is_latency_sensitive, slo and ttft_slo have no effect "
                                  "under --scheduling-policy %s (only under slo)", policy)
        return model

    def check_fields(self, body: Any) -> None:
        """Refuse vLLM's fields this server does not implement (400) and log the ones
        nobody defines, as vLLM does."""
        try:
            ignored = body.refused_or_ignored()
        except ValueError as error:
            raise bad_request(error) from error
        if ignored:
            logger.warning("The following fields were present in the request but "
                           "ignored: %s", clipped_names(ignored))

    def tokens_as_ids(self, body: CompletionRequest | ChatCompletionRequest) -> bool:
        """Whether logprob tokens are written ``token_id:N``: the request's field, else
        the server's flag."""
        if body.return_tokens_as_token_ids is not None:
            return body.return_tokens_as_token_ids
        return self.settings.return_tokens_as_token_ids

    def warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message, *args)

    def check_request_template(self, rendering: ChatRendering) -> None:
        """400 for a request's own chat template (``chat_template``, or one passed in
        ``chat_template_kwargs``) unless the server trusts them, as vLLM."""
        param = _request_template_field(rendering)
        if param is not None and not self.settings.trust_request_chat_template:
            raise OpenAIError(400, f"{param}: a chat template is passed with the request, "
                                   f"but the server was not started with "
                                   f"--trust-request-chat-template; refused request with "
                                   f"untrusted chat template.", param=param)

    async def render_chat_or_400(self, messages: list[ChatMessage], rendering: ChatRendering
                                 ) -> list[int]:
        """Chat messages through the chat template (the request's, the server's or the
        tokenizer's), as token ids, off the event loop; an overlong result is a 400
        here (``encode``)."""
        text = await self.render_chat_text(messages, rendering)
        return await self.encode(text, rendering.add_special_tokens, field="messages")

    async def render_chat_text(self, messages: list[ChatMessage], rendering: ChatRendering
                               ) -> str:
        """Chat messages through the chat template, as text, in a worker thread; a
        template from the request (which needs ``--trust-request-chat-template``) or a
        conversation of ``LONG_TEXT_CHARS`` or more renders in a worker process, since
        pure-Python rendering in a thread would take the GIL from the event loop and the
        model thread for as long as it runs. Whatever fails there (a template that
        rejects the messages, a content part a text model cannot take) is the request's
        fault: a 400."""
        self.check_request_template(rendering)
        if (_request_template_field(rendering) is None
                and _conversation_chars(messages) < LONG_TEXT_CHARS):
            return await self.offload.run(self._render_chat_text, messages, rendering)
        conversation, arguments = await self.offload.run(
            self._chat_template_call, messages, rendering)
        try:
            return await self.offload.render_in_process(conversation, arguments)
        except CallFailed as error:
            raise _cannot_apply_template(error) from error

    def _render_chat_text(self, messages: list[ChatMessage], rendering: ChatRendering
                          ) -> str:
        conversation, arguments = self._chat_template_call(messages, rendering)
        try:
            return cast(str, self.engine.tokenizer.apply_chat_template(
                conversation, **arguments))
        except Exception as error:
            raise _cannot_apply_template(error) from error

    def _chat_template_call(self, messages: list[ChatMessage], rendering: ChatRendering
                            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        try:
            return chat_template_call(
                self.engine.tokenizer, [m.model_dump(exclude_none=True) for m in messages],
                chat_template=rendering.chat_template or self.settings.chat_template,
                add_generation_prompt=rendering.add_generation_prompt,
                continue_final_message=rendering.continue_final_message,
                tools=rendering.tools, documents=rendering.documents,
                chat_template_kwargs=rendering.chat_template_kwargs,
                content_format=self.settings.chat_template_content_format)
        except ValueError as error:
            if str(error).startswith(("messages[", "chat_template_kwargs.",
                                      "continue_final_message:")):
                raise bad_request(error) from error
            raise _cannot_apply_template(error) from error
        except Exception as error:  # whatever the template or the content parts raise
            raise _cannot_apply_template(error) from error

    async def encode(self, text: str, add_special_tokens: bool = True, *,
                     field: str = "prompt", truncate_to: int | None = None,
                     generating: bool = True) -> list[int]:
        """``text`` as token ids, off the event loop. A long text that is more than
        the context can take (a prompt that leaves no room to generate, unless
        ``truncate_to`` keeps fewer of its tokens) is a 400 naming ``field`` here; a
        shorter one is left to the route's own limits. Text that is not valid Unicode
        (a lone surrogate) is a 400 too."""
        try:
            check_text(field, text)
        except ValueError as error:
            raise bad_request(error) from error
        max_model_len = self.engine.config.model.max_model_len
        if truncate_to is None:
            at_least = await self.offload.tokens_at_least(text, add_special_tokens,
                                                          max_model_len)
            _refuse_beyond_context(
                field, f"at least {at_least} tokens (counted in its first "
                       f"{prefix_chars(max_model_len)} characters)", at_least,
                generating=generating, max_model_len=max_model_len)
        count, ids = await self.offload.encode_tail(text, add_special_tokens, max_model_len)
        if count == len(ids):
            return ids
        kept = count if truncate_to is None or truncate_to < 0 else min(count, truncate_to)
        if generating or truncate_to != -1:
            _refuse_beyond_context(field, f"{kept if generating else count} tokens", kept,
                                   generating=generating, max_model_len=max_model_len)
        return ids


def _refuse_beyond_context(field: str, described: str, tokens: int, *, generating: bool,
                           max_model_len: int) -> None:
    """A 400 naming ``field`` when its ``tokens`` (``described`` in the message) are more
    than the context takes; for a prompt to generate from, when they leave no room."""
    if generating and tokens >= max_model_len:
        raise OpenAIError(400, f"{field}: {described} leave no room to generate within "
                               f"this model's maximum context length of {max_model_len} "
                               "tokens", param=field)
    if not generating and tokens > max_model_len:
        raise OpenAIError(400, f"{field}: {described} are more than this model takes "
                               f"(max_model_len={max_model_len}); shorten it or set "
                               "truncate_prompt_tokens", param=field)


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request`` (set by ``build_app``)."""
    return cast(ServerState, request.app.state.triollm)


def _conversation_chars(messages: list[ChatMessage]) -> int:
    """About how much rendering the messages ask for, in characters: their text, and
    64 for each message (a template's work per message, whatever its length)."""
    total = 64 * len(messages)
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif content is not None:
            total += sum(len(part["text"]) for part in content
                         if isinstance(part.get("text"), str))
    return total


def _request_template_field(rendering: ChatRendering) -> str | None:
    """Where the request passes a chat template of its own (``chat_template``, or
    ``chat_template_kwargs.chat_template``); None when it passes none."""
    if rendering.chat_template is not None:
        return "chat_template"
    if (rendering.chat_template_kwargs or {}).get("chat_template") is not None:
        return "chat_template_kwargs.chat_template"
    return None


def _cannot_apply_template(error: Exception) -> OpenAIError:
    return OpenAIError(400, f"messages: cannot apply the chat template: {error}",
                       param="messages")
