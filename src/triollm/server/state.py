"""What every route shares: the engine, the settings, and the server's lifecycle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import anyio
from fastapi import Request

from triollm.engine.inputs import render_chat
from triollm.server.errors import OpenAIError, bad_request
from triollm.server.limits import DEFAULT_MAX_LOGPROB_ENTRIES, DEFAULT_MAX_REQUEST_BODY_BYTES
from triollm.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

if TYPE_CHECKING:
    from triollm.engine.async_engine import AsyncLLMEngine
    from triollm.server.metrics import PrometheusStatLogger

__all__ = ["CorsSettings", "ServerSettings", "ServerState", "server_state"]


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
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    chat_template: str | None = None
    cors: CorsSettings = CorsSettings()


@dataclass
class ServerState:
    """What the routes share: the engine, the settings and the server's lifecycle.

    ``open_requests`` counts HTTP requests from their arrival to the last byte of their
    response (kept by ``RequestLifetime``): a graceful shutdown waits for it to reach 0.
    """

    engine: AsyncLLMEngine
    settings: ServerSettings
    metrics: PrometheusStatLogger
    shutting_down: bool = False
    open_requests: int = 0
    idle: anyio.Event = field(default_factory=anyio.Event)

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
        """The served model's name for a request that names it (or none): 404 otherwise."""
        names = self.settings.served_model_names
        if name is None or name in names:
            return names[0]
        raise OpenAIError(404, f"The model `{name}` does not exist.", type="NotFoundError",
                          param="model")

    def check_request(self, body: CompletionRequest | ChatCompletionRequest) -> str:
        """The served model's name, once the model and the features asked for are ours."""
        model = self.check_model(body.model)
        try:
            body.check_supported()
        except ValueError as error:
            raise bad_request(error) from error
        return model

    def render_chat_or_400(self, messages: list[ChatMessage], chat_template: str | None,
                           add_generation_prompt: bool, tools: list[dict[str, Any]] | None
                           ) -> list[int]:
        """Chat messages through the chat template (the request's, the server's or the
        tokenizer's), as token ids. Whatever fails there (a template that rejects the
        messages, text no tokenizer can encode) is the request's fault: a 400."""
        try:
            return render_chat(self.engine.tokenizer,
                               [m.model_dump(exclude_none=True) for m in messages],
                               chat_template=chat_template or self.settings.chat_template,
                               add_generation_prompt=add_generation_prompt, tools=tools)
        except Exception as error:
            raise OpenAIError(400, f"messages: cannot apply the chat template: {error}",
                              param="messages") from error


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request`` (set by ``build_app``)."""
    return cast(ServerState, request.app.state.triollm)
