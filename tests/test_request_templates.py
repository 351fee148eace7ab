"""A request's own chat template is code from the client: it runs only under
``--trust-request-chat-template`` (vLLM's flag and rule); without it the request gets a
400 naming the field, on every route that renders messages."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.cli import build_parser, server_options_from_namespace
from triollm.server.app import build_app
from triollm.server.state import ServerSettings, ServerState
from triollm.testing import FakeModelRunner

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hello"}]
ROUTES = [("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
          ("/tokenize", {"messages": MESSAGES})]


async def post_all(http: httpx.AsyncClient, extra: dict[str, Any]) -> list[httpx.Response]:
    return [await http.post(path, json={**body, **extra}) for path, body in ROUTES]


@pytest.mark.anyio
async def test_request_templates_render_only_when_the_server_trusts_them() -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(disable_log_requests=True),
                                             runner_factory=FakeModelRunner)

    def client(trusted: bool) -> httpx.AsyncClient:
        settings = ServerSettings(served_model_names=("demo",),
                                  trust_request_chat_template=trusted)
        app = build_app(ServerState(engine, settings, None))
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

    async with engine, client(False) as untrusted, client(True) as trusted:
        for extra, param in (({"chat_template": TEMPLATE}, "chat_template"),
                             ({"chat_template_kwargs": {"chat_template": TEMPLATE}},
                              "chat_template_kwargs.chat_template")):
            for reply in await post_all(untrusted, extra):
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["param"] == param and error["type"] == "BadRequestError"
                assert "--trust-request-chat-template" in error["message"]
        # as in vLLM, template variables alone are the server's template's business
        for reply in await post_all(untrusted, {"chat_template_kwargs": {"x": False}}):
            assert reply.status_code == 200, reply.text
        chat, tokenize = await post_all(trusted, {"chat_template": TEMPLATE})
        assert chat.status_code == 200, chat.text
        plain = (await post_all(trusted, {}))[1]
        assert tokenize.json()["count"] < plain.json()["count"]  # no role markers


def test_the_flag_reaches_the_server_options() -> None:
    parser = build_parser()
    for argv, trusted in ((["serve", "m"], False),
                          (["serve", "m", "--trust-request-chat-template"], True),
                          (["serve", "m", "--no-trust-request-chat-template"], False)):
        options = server_options_from_namespace(parser.parse_args(argv))
        assert options.trust_request_chat_template is trusted
