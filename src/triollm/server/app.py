"""The OpenAI-compatible ASGI app: routes, server-sent events, errors, disconnects.

``build_app(engine, settings)`` returns the app. Outside FastAPI sits one pure ASGI
layer, ``RequestLifetime``: it reads each request body (413 over the limit), hands it
to the app, and meanwhile watches for ``http.disconnect``; a client that goes away
cancels the request's scope, so ``engine.generate`` aborts the request within one
engine step, streaming or not. (Hypercorn drops sends after a close silently and does
not cancel handlers, so nothing else would notice.)
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    MutableMapping,
    Sequence,
)
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

import triollm
from triollm.engine.async_engine import AsyncLLMEngine
from triollm.errors import EngineClosedError, EngineDeadError
from triollm.outputs import CompletionOutput, RequestOutput
from triollm.sampling_params import SamplingParams
from triollm.server.metrics import CONTENT_TYPE, PrometheusStatLogger
from triollm.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    PromptLogprobs,
    PromptTokenLogprob,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    random_id,
)

__all__ = ["RequestLifetime", "ServerSettings", "ServerState", "build_app"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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
    max_request_body_bytes: int = 8 * 1024 * 1024
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


class OpenAIError(Exception):
    """An error the client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(error: ValueError) -> OpenAIError:
    """A 400 naming the field when the message starts with ``field: ...``."""
    message = str(error)
    head, sep, _ = message.partition(":")
    param = head if sep and head.replace("_", "").isalnum() else None
    return OpenAIError(400, message, param=param)


def engine_unavailable(error: BaseException) -> OpenAIError:
    if isinstance(error, EngineDeadError):
        return OpenAIError(503, f"The engine is dead: {error}", type="EngineDeadError")
    return OpenAIError(503, "The server is shutting down.", type="ServiceUnavailableError")


def _error_json(status: int, message: str, type: str) -> bytes:
    return json.dumps(OpenAIError(status, message, type=type).body()).encode()


# -- the ASGI layer: body limit, disconnect-as-cancel, API key ---------------------------

class RequestLifetime:
    """Owns each HTTP request's lifetime: its body, its scope, its client's presence."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_json(send, 401, _error_json(401, "Unauthorized: a valid API key is "
                                                    "required", "AuthenticationError"))
            return
        body = await self._read_body(scope, receive)
        if body is None:
            await _send_json(send, 413, _error_json(
                413, f"Request body larger than {self.state.settings.max_request_body_bytes}"
                " bytes", "RequestTooLargeError"))
            return
        self.state.request_started()
        try:
            await self._serve(scope, receive, send, body)
        finally:
            self.state.request_ended()

    async def _serve(self, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        disconnected = anyio.Event()
        body_sent = False

        async def replay() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async with anyio.create_task_group() as request_scope:
            async def watch_for_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        disconnected.set()
                        request_scope.cancel_scope.cancel()
                        return

            request_scope.start_soon(watch_for_disconnect)
            await self.app(scope, replay, send)
            request_scope.cancel_scope.cancel()

    def _authorized(self, scope: Scope) -> bool:
        key = self.state.settings.api_key
        if key is None or not str(scope.get("path", "")).startswith("/v1"):
            return True  # as vLLM: /health, /metrics and the rest stay open
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, f"Bearer {key}".encode())

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.state.settings.max_request_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise anyio.get_cancelled_exc_class()()  # nobody left to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class EventStream(Response):
    """A server-sent-events response written by ``writer(emit)``; ``emit(data)`` sends one
    ``data:`` event (a dict as JSON, or a string as is)."""

    media_type = "text/event-stream"

    def __init__(self, writer: Callable[[Callable[[Any], Awaitable[None]]], Awaitable[None]],
                 ) -> None:
        super().__init__(status_code=200, media_type=self.media_type)
        self.writer = writer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        lock = anyio.Lock()

        async def emit(data: Any) -> None:
            text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            async with lock:
                await send({"type": "http.response.body",
                            "body": f"data: {text}\n\n".encode(), "more_body": True})

        await self.writer(emit)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- generation helpers -------------------------------------------------------------------

@dataclass
class _Submitted:
    """One engine request (one prompt of an API request) and its first output."""

    index: int
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput


async def _submit(state: ServerState, prompts: Sequence[Any], params: SamplingParams,
                  request_id: str, body: Any, opened: list[AsyncIterator[RequestOutput]],
                  ) -> list[_Submitted]:
    """Add every prompt to the engine and wait for each one's first output, so that bad
    input is a 400 before any response starts. Streams are appended to ``opened`` (the
    caller closes them, which aborts whatever is unfinished)."""
    if state.shutting_down:
        raise engine_unavailable(EngineClosedError("shutting down"))
    submitted = []
    for index, prompt in enumerate(prompts):
        sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
        stream = state.engine.generate(
            prompt, params, sub_id, priority=body.priority,
            is_latency_sensitive=body.latency_sensitive, slo=body.slo,
            ttft_slo=body.ttft_slo)
        opened.append(stream)
        submitted.append(_Submitted(index, stream, await _first_output(stream)))
    return submitted


async def _first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A new request's first output: adding it raises bad input as a 400, a dead or
    closed engine as a 503."""
    try:
        return await anext(stream)
    except ValueError as error:
        raise bad_request(error) from error
    except (EngineDeadError, EngineClosedError) as error:
        raise engine_unavailable(error) from error
    except StopAsyncIteration:
        raise engine_unavailable(EngineClosedError("ended early")) from None


async def _outputs(item: _Submitted) -> AsyncIterator[RequestOutput]:
    yield item.first
    if not item.first.finished:
        async for output in item.stream:
            yield output


async def _close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    """Close engine streams (aborting what is unfinished), even inside a cancelled scope."""
    with anyio.CancelScope(shield=True):
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def _final_outputs(submitted: list[_Submitted]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(submitted)

    async def drain(item: _Submitted) -> None:
        async for output in _outputs(item):
            finals[item.index] = output

    async with anyio.create_task_group() as tasks:
        for item in submitted:
            tasks.start_soon(drain, item)
    return [f for f in finals if f is not None]


def _usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return _usage_info(prompt, completion)


def _completion_logprobs(completion: CompletionOutput, start_offset: int,
                         prompt: tuple[list[int], list[Any]] | None = None,
                         tokenizer: Any = None) -> CompletionLogprobs:
    result = CompletionLogprobs()
    offset = start_offset
    pairs: list[tuple[int, Any]] = []
    if prompt is not None:
        pairs.extend(zip(*prompt, strict=True))
    pairs.extend(zip(completion.token_ids, completion.logprobs or [], strict=False))
    for token_id, position in pairs:
        chosen = position.get(token_id) if position else None
        text = (chosen.decoded_token if chosen and chosen.decoded_token is not None
                else tokenizer.decode([token_id]) if tokenizer is not None else "")
        result.tokens.append(text)
        result.token_logprobs.append(_json_logprob(chosen.logprob) if chosen else None)
        result.top_logprobs.append(
            {(lp.decoded_token or ""): _json_logprob(lp.logprob) for lp in position.values()}
            if position else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _json_logprob(logprob: float) -> float:
    """JSON has no -inf: an impossible token is reported as -9999.0."""
    return max(logprob, -9999.0)


def _prompt_logprobs(body: CompletionRequest | ChatCompletionRequest,
                     output: RequestOutput) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` field, when the request asked for it."""
    if body.prompt_logprobs is None:
        return None
    return [None if position is None else {
        token: PromptTokenLogprob(logprob=_json_logprob(lp.logprob), rank=lp.rank,
                                  decoded_token=lp.decoded_token)
        for token, lp in position.items()} for position in output.prompt_logprobs or []]


def _chat_logprobs(completion: CompletionOutput, top: int) -> ChatLogprobs:
    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or [],
                                  strict=False):
        chosen = position.get(token_id)
        if chosen is None:
            continue
        text = chosen.decoded_token or ""
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top]
        content.append(ChatTokenLogprob(
            token=text, logprob=_json_logprob(chosen.logprob), bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "",
                                     logprob=_json_logprob(lp.logprob),
                                     bytes=list((lp.decoded_token or "").encode()))
                          for _, lp in ranked]))
    return ChatLogprobs(content=content)


# -- the app ------------------------------------------------------------------------------

def build_app(state: ServerState) -> ASGIApp:
    """The OpenAI-compatible app around a running engine."""
    engine = state.engine
    settings = state.settings
    tokenizer = engine.tokenizer
    max_model_len = engine.config.model.max_model_len
    app = FastAPI(title="triollm", version=triollm.__version__,
                  description="OpenAI-compatible LLM server",
                  responses={400: {"model": ErrorResponse}})

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError
                               ) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(location) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
            f"{e.get('msg', 'invalid')}" for e in problems)
        if first.get("type") == "json_invalid":
            message, param = f"Invalid JSON body: {first.get('msg', '')}", None
        return OpenAIError(400, message, param=param).response()

    def check_model(name: str | None) -> str:
        if name is None or name in settings.served_model_names:
            return settings.served_model_names[0]
        raise OpenAIError(404, f"The model `{name}` does not exist.", type="NotFoundError",
                          param="model")

    def check_request(body: CompletionRequest | ChatCompletionRequest) -> str:
        """The served model's name, once the model and the features asked for are ours."""
        model = check_model(body.model)
        try:
            body.check_supported()
        except ValueError as error:
            raise bad_request(error) from error
        return model

    def render_chat(messages: list[ChatMessage], chat_template: str | None,
                    add_generation_prompt: bool, tools: list[dict[str, Any]] | None
                    ) -> list[int]:
        """Chat messages through the chat template, as token ids."""
        return list(tokenizer.apply_chat_template(
            [m.model_dump(exclude_none=True) for m in messages], chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, tools=tools, tokenize=True,
            return_dict=False))

    def request_id_for(request: Request, body: Any, prefix: str) -> str:
        return body.request_id or request.headers.get("x-request-id") or random_id(prefix)

    # -- health and introspection ---------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine runs; 503 once it is dead."""
        if engine.errored or not engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": triollm.__version__}

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        root = engine.config.model.model
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=max_model_len)
                               for name in settings.served_model_names])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        if body.messages is not None:
            tokens = render_chat(body.messages, settings.chat_template,
                                 body.add_generation_prompt, body.tools)
        elif body.prompt is not None:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise OpenAIError(400, "prompt: give a prompt or messages", param="prompt")
        return TokenizeResponse(tokens=list(tokens), count=len(tokens),
                                max_model_len=max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        vocab = int(engine.config.model.hf_config.vocab_size)
        if any(not 0 <= t < max(vocab, len(tokenizer)) for t in body.tokens):
            raise OpenAIError(400, "tokens: contains ids outside the vocabulary",
                              param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    # -- completions -------------------------------------------------------------------

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = check_request(body)
        prompts = _prompts_of(body.prompt)
        try:
            params = body.sampling_params(
                max_tokens=body.max_tokens, logprobs=body.logprobs,
                prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None
                else None)
        except ValueError as error:
            raise bad_request(error) from error
        request_id = request_id_for(request, body, "cmpl")
        created = int(time.time())
        opened: list[AsyncIterator[RequestOutput]] = []
        try:
            submitted = await _submit(state, prompts, params, request_id, body, opened)
            if body.stream:
                return EventStream(_completion_stream_writer(
                    state, body, submitted, opened, request_id, created, model))
            finals = await _final_outputs(submitted)
        except BaseException:
            await _close_all(opened)
            raise
        await _close_all(opened)
        choices = []
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                text = completion.text
                prompt_text = output.prompt or tokenizer.decode(output.prompt_token_ids)
                logprobs = None
                if body.logprobs is not None:
                    echoed = None
                    if body.echo:
                        echoed = (output.prompt_token_ids,
                                  list(output.prompt_logprobs or []))
                    logprobs = _completion_logprobs(completion, 0, echoed, tokenizer)
                if body.echo:
                    text = prompt_text + text
                choices.append(CompletionChoice(
                    index=prompt_index * body.n + completion.index, text=text,
                    logprobs=logprobs, finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=_prompt_logprobs(body, output)))
        return JSONResponse(CompletionResponse(
            id=request_id, created=created, model=model, choices=choices,
            usage=_usage(finals)).model_dump())

    # -- chat ----------------------------------------------------------------------------

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = check_request(body)
        try:
            token_ids = render_chat(body.messages, body.chat_template or settings.chat_template,
                                    body.add_generation_prompt, body.tools)
        except Exception as error:  # template errors are the request's fault
            raise OpenAIError(400, f"messages: cannot apply the chat template: {error}",
                              param="messages") from error
        top = body.top_logprobs or 0
        try:
            params = body.sampling_params(
                max_tokens=body.max_completion_tokens or body.max_tokens,
                logprobs=top if body.logprobs else None)
        except ValueError as error:
            raise bad_request(error) from error
        request_id = request_id_for(request, body, "chatcmpl")
        created = int(time.time())
        opened: list[AsyncIterator[RequestOutput]] = []
        try:
            submitted = await _submit(state, [{"prompt_token_ids": list(token_ids)}], params,
                                      request_id, body, opened)
            if body.stream:
                return EventStream(_chat_stream_writer(
                    body, submitted[0], opened, request_id, created, model, top))
            [final] = await _final_outputs(submitted)
        except BaseException:
            await _close_all(opened)
            raise
        await _close_all(opened)
        choices = [ChatChoice(
            index=c.index, message=ChatMessageOut(content=c.text),
            logprobs=_chat_logprobs(c, top) if body.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in final.outputs]
        return JSONResponse(ChatCompletionResponse(
            id=request_id, created=created, model=model, choices=choices,
            usage=_usage([final]), prompt_logprobs=_prompt_logprobs(body, final)).model_dump())

    # -- vLLM's minimal /generate (the seed's api_server) ---------------------------------

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if state.shutting_down:
            raise engine_unavailable(EngineClosedError("shutting down"))
        extra = dict(body.model_extra or {})
        try:
            params = SamplingParams(**extra)
        except TypeError as error:
            raise OpenAIError(400, f"unknown sampling parameter: {error}") from error
        except ValueError as error:
            raise bad_request(error) from error
        request_id = random_id("generate")
        stream = engine.generate(body.prompt, params, request_id)
        try:
            first = await _first_output(stream)
            if body.stream:
                return _NullDelimitedStream(stream, first)
            final = first
            async for output in stream:
                final = output
        except BaseException:
            await _close_all([stream])
            raise
        await _close_all([stream])
        return JSONResponse({"text": [body.prompt + c.text for c in final.outputs]})

    # CORS is outermost: it answers preflight requests itself (they carry no API key)
    # and adds its headers to every response, the 401s and 413s included.
    cors = settings.cors
    return cast(ASGIApp, CORSMiddleware(
        cast(Any, RequestLifetime(app, state)), allow_origins=cors.allowed_origins,
        allow_credentials=cors.allow_credentials, allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers))


class _NullDelimitedStream(Response):
    """The seed's streaming /generate: cumulative texts as JSON, each followed by NUL."""

    def __init__(self, stream: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
        super().__init__(status_code=200, media_type="application/json")
        self.stream, self.first = stream, first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        async with aclosing(self.stream):  # type: ignore[type-var]
            output: RequestOutput | None = self.first
            while output is not None:
                prompt = output.prompt or ""
                chunk = json.dumps({"text": [prompt + c.text for c in output.outputs]})
                await send({"type": "http.response.body",
                            "body": chunk.encode() + b"\0", "more_body": True})
                output = None if output.finished else await anext(self.stream, None)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(cast(list[int], p))}
            for p in prompt]


def _stream_error_event(error: BaseException) -> dict[str, Any]:
    if isinstance(error, EngineDeadError):
        return OpenAIError(500, f"The engine died while generating: {error}",
                           type="EngineDeadError").body()
    return OpenAIError(503, "The server shut down while generating.",
                       type="ServiceUnavailableError").body()


def _completion_stream_writer(
        state: ServerState, body: CompletionRequest, submitted: list[_Submitted],
        opened: list[AsyncIterator[RequestOutput]], request_id: str, created: int,
        model: str) -> Callable[[Callable[[Any], Awaitable[None]]], Awaitable[None]]:
    include_usage, continuous_usage = _usage_options(body)
    tokenizer = state.engine.tokenizer

    async def write(emit: Callable[[Any], Awaitable[None]]) -> None:
        prompt_tokens = 0
        completion_tokens = 0
        offsets: dict[int, int] = {}

        async def one_prompt(item: _Submitted) -> None:
            nonlocal prompt_tokens, completion_tokens
            first = True
            async for output in _outputs(item):
                if first:
                    prompt_tokens += len(output.prompt_token_ids)
                for completion in output.outputs:
                    index = item.index * body.n + completion.index
                    text = completion.text
                    # Each choice's first event carries the prompt, and with logprobs
                    # the prompt tokens' log-probabilities, as in the non-streaming reply.
                    echo = body.echo and index not in offsets
                    if echo:
                        text = (output.prompt or tokenizer.decode(output.prompt_token_ids)
                                ) + text
                    completion_tokens += len(completion.token_ids)
                    logprobs = None
                    if body.logprobs is not None:
                        echoed = ((output.prompt_token_ids, list(output.prompt_logprobs or []))
                                  if echo else None)
                        logprobs = _completion_logprobs(completion, offsets.get(index, 0),
                                                        echoed, tokenizer)
                    offsets[index] = offsets.get(index, 0) + len(text)
                    event = {
                        "id": request_id, "object": "text_completion", "created": created,
                        "model": model,
                        "choices": [CompletionChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason).model_dump()]}
                    if continuous_usage:
                        event["usage"] = _usage_info(prompt_tokens, completion_tokens
                                                     ).model_dump()
                    await emit(event)
                first = False

        await _run_stream(opened, emit,
                          [functools.partial(one_prompt, item) for item in submitted])
        if include_usage:
            await emit({"id": request_id, "object": "text_completion", "created": created,
                        "model": model, "choices": [],
                        "usage": _usage_info(prompt_tokens, completion_tokens).model_dump()})
        await emit("[DONE]")

    return write


def _chat_stream_writer(
        body: ChatCompletionRequest, item: _Submitted,
        opened: list[AsyncIterator[RequestOutput]], request_id: str, created: int,
        model: str, top: int) -> Callable[[Callable[[Any], Awaitable[None]]], Awaitable[None]]:
    include_usage, continuous_usage = _usage_options(body)
    counts = {"prompt": len(item.first.prompt_token_ids), "completion": 0}

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None
              ) -> dict[str, Any]:
        if usage is None and continuous_usage:
            usage = _usage_info(counts["prompt"], counts["completion"])
        return ChatCompletionChunk(id=request_id, created=created, model=model,
                                   choices=choices, usage=usage).model_dump(exclude_none=True)

    async def write(emit: Callable[[Any], Awaitable[None]]) -> None:

        async def stream_choices() -> None:
            await emit(chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                            content=""))
                              for i in range(body.n)]))
            async for output in _outputs(item):
                for completion in output.outputs:
                    counts["completion"] += len(completion.token_ids)
                    await emit(chunk([ChatStreamChoice(
                        index=completion.index, delta=DeltaMessage(content=completion.text),
                        logprobs=_chat_logprobs(completion, top) if body.logprobs else None,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason)]))

        await _run_stream(opened, emit, [stream_choices])
        if include_usage:
            await emit(chunk([], _usage_info(counts["prompt"], counts["completion"])))
        await emit("[DONE]")

    return write


def _usage_options(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage)``: as in vLLM, per-chunk usage
    (``continuous_usage_stats``) counts only together with ``include_usage``."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def _usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


async def _run_stream(opened: list[AsyncIterator[RequestOutput]],
                      emit: Callable[[Any], Awaitable[None]],
                      producers: list[Callable[[], Coroutine[Any, Any, None]]]) -> None:
    """Run the producers; an engine failure becomes a final error event. Always closes
    the engine streams (aborting what is unfinished)."""
    try:
        try:
            async with anyio.create_task_group() as tasks:
                for producer in producers:
                    tasks.start_soon(producer)
        except BaseExceptionGroup as group:
            failures = [e for e in group.exceptions
                        if isinstance(e, EngineDeadError | EngineClosedError)]
            if not failures or len(failures) != len(group.exceptions):
                raise
            await emit(_stream_error_event(failures[0]))
        except (EngineDeadError, EngineClosedError) as error:
            await emit(_stream_error_event(error))
    finally:
        await _close_all(opened)


