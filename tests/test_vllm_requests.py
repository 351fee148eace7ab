"""What a vLLM user sends is read as vLLM reads it: content parts, the model's
generation config, chat fields (echo, continue_final_message, chat_template_kwargs,
return_tokens_as_token_ids), refusals by name, unknown fields reported, and vLLM's
routes; through the official openai client against a real server."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_helpers import ThreadedServer, server_in_thread
from triollm import LLM, AsyncEngineArgs, AsyncLLMEngine
from triollm.entrypoints.chat_utils import detect_content_format, render_chat

KEYS = ("key-one", "key-two")
#: A template that loops over content parts and reads a variable of
#: chat_template_kwargs, as Qwen3's does with enable_thinking.
PARTS_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}"
    "{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<|system|>\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GENERATION_CONFIG = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 6,
                     "repetition_penalty": 1.05, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def model_with_defaults(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a generation_config.json that sets sampling defaults."""
    path = tmp_path_factory.mktemp("with-defaults") / "model"
    shutil.copytree(llama_path, path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


@pytest.fixture(scope="module")
def server(model_with_defaults: Path) -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(model=str(model_with_defaults), dtype="float32", max_model_len=256,
                           num_gpu_blocks_override=256)
    engine = AsyncLLMEngine.from_engine_args(args)
    with server_in_thread(engine, api_key=KEYS, served_model_names=("tiny",)) as running:
        yield running
    assert not running.errors, running.errors


@pytest.fixture(scope="module")
def parts_server(llama_path: Path) -> Iterator[ThreadedServer]:
    """No generation config; a chat template that iterates over content parts; request
    templates trusted."""
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=256,
                           num_gpu_blocks_override=256)
    engine = AsyncLLMEngine.from_engine_args(args)
    with server_in_thread(engine, served_model_names=("tiny",), chat_template=PARTS_TEMPLATE,
                          trust_request_chat_template=True) as running:
        yield running
    assert not running.errors, running.errors


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0)


@pytest.fixture(scope="module")
def parts_client(parts_server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=parts_server.url + "/v1", api_key="unused", max_retries=0)


def post(server: ThreadedServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[0]}"})


def local_tokens(server: ThreadedServer, messages: list[dict[str, Any]], **kwargs: Any
                 ) -> list[int]:
    return render_chat(server.handle.engine.tokenizer, messages, **kwargs)


PARTS = [{"type": "text", "text": "Say hi"}, {"type": "text", "text": "twice"}]


# -- content parts -----------------------------------------------------------------


def test_text_parts_are_joined_for_a_string_template(server: ThreadedServer,
                                                     client: openai.OpenAI) -> None:
    assert detect_content_format(server.handle.engine.tokenizer.chat_template) == "string"
    joined = local_tokens(server, [{"role": "user", "content": "Say hi\ntwice"}])
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PARTS}], max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(joined)
    tokenized = post(server, "/tokenize", {"messages": [{"role": "user", "content": PARTS}]})
    assert tokenized.json()["tokens"] == joined


def test_a_template_that_loops_over_parts_gets_the_parts(parts_server: ThreadedServer,
                                                         parts_client: openai.OpenAI) -> None:
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    expected = local_tokens(parts_server, [{"role": "user", "content": PARTS}],
                            chat_template=PARTS_TEMPLATE)
    text = parts_server.handle.engine.tokenizer.decode(expected)
    assert "[Say hi][twice]" in text
    reply = parts_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PARTS}], max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    {"type": "hologram"},
])
def test_parts_a_text_model_cannot_take_are_refused_by_type(client: openai.OpenAI,
                                                           part: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", max_tokens=1,
            messages=[{"role": "user", "content": [PARTS[0], part]}])  # type: ignore[list-item]
    assert refused.value.body["param"] == "messages[0].content[1].type"  # type: ignore[index]
    assert repr(part["type"]) in refused.value.message


def test_llm_chat_takes_content_parts(llama_llm: LLM) -> None:
    joined = render_chat(llama_llm.get_tokenizer(), [{"role": "user",
                                                      "content": "Say hi\ntwice"}])
    [output] = llama_llm.chat([{"role": "user", "content": PARTS}], use_tqdm=False)
    assert output.prompt_token_ids == joined


# -- the model's generation config ---------------------------------------------------


def test_generation_config_supplies_the_defaults(server: ThreadedServer,
                                                 client: openai.OpenAI) -> None:
    defaults = server.handle.engine.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens,
            defaults.repetition_penalty) == (0.0, 5, 6, 1.05)
    messages: list[Any] = [{"role": "user", "content": "Once upon a time"}]
    first = client.chat.completions.create(model="tiny", messages=messages,
                                           extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model="tiny", messages=messages,
                                           extra_body={"ignore_eos": True})
    # max_new_tokens is the default max_tokens, temperature 0 makes it greedy
    assert first.usage is not None and first.usage.completion_tokens == 6
    assert first.choices[0].message.content == again.choices[0].message.content
    longer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9,
                                            extra_body={"ignore_eos": True})
    assert longer.usage is not None and longer.usage.completion_tokens == 9
    # a request's own field wins over the default
    sampled = {client.chat.completions.create(
        model="tiny", messages=messages, temperature=1.5, seed=seed,
        extra_body={"ignore_eos": True, "top_k": -1}).choices[0].message.content
        for seed in range(4)}
    assert len(sampled) > 1


def test_generation_config_vllm_ignores_the_file_and_overrides_apply(
        model_with_defaults: Path) -> None:
    auto = AsyncEngineArgs(model=str(model_with_defaults)).create_engine_config()
    assert dict(auto.model.generation_defaults) == {
        "temperature": 0.0, "top_k": 5, "max_tokens": 6, "repetition_penalty": 1.05}
    none = AsyncEngineArgs(model=str(model_with_defaults), generation_config="vllm",
                           override_generation_config='{"top_p": 0.5}').create_engine_config()
    assert dict(none.model.generation_defaults) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="override_generation_config: 'temprature'"):
        AsyncEngineArgs(model=str(model_with_defaults),
                        override_generation_config={"temprature": 0.5}).create_engine_config()
    with pytest.raises(ValueError, match=r"generation_config: .* holds no"):
        AsyncEngineArgs(model=str(model_with_defaults),
                        generation_config=str(model_with_defaults.parent)
                        ).create_engine_config()


def test_llm_uses_the_generation_config_when_no_params_are_given(
        model_with_defaults: Path) -> None:
    llm = LLM(str(model_with_defaults), dtype="float32", max_model_len=128,
              num_gpu_blocks_override=64)
    assert llm.get_default_sampling_params().max_tokens == 6
    [output] = llm.generate("Once upon a time", use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= 6


# -- chat fields ---------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(parts_server: ThreadedServer,
                                                 parts_client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    plain = parts_client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=1)
    off = parts_client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    expected = local_tokens(parts_server, messages, chat_template=PARTS_TEMPLATE,
                            chat_template_kwargs={"enable_thinking": False})
    assert off.usage is not None and plain.usage is not None
    assert off.usage.prompt_tokens == len(expected) > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match=r"chat_template_kwargs\.tokenize"):
        parts_client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1,
            extra_body={"chat_template_kwargs": {"tokenize": False}})


def test_continue_final_message_with_echo(server: ThreadedServer,
                                          client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Tell a story"},
                           {"role": "assistant", "content": "The cat"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True,
             "ignore_eos": True}
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                           extra_body=extra)
    expected = local_tokens(server, messages, add_generation_prompt=False,
                            continue_final_message=True)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    content = reply.choices[0].message.content or ""
    assert content.startswith("The cat") and len(content) > len("The cat")
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(model="tiny", messages=messages,
                                                      max_tokens=4, stream=True,
                                                      extra_body=extra) if chunk.choices)
    assert streamed == content  # greedy (the model's temperature 0)
    # continue_final_message alone turns the generation prompt off, as in vLLM
    alone = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                           extra_body={"continue_final_message": True})
    assert alone.usage is not None and alone.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1,
            extra_body={"continue_final_message": True, "add_generation_prompt": True})
    conflict = post(server, "/tokenize", {"messages": messages, "continue_final_message": True,
                                          "add_generation_prompt": True})
    assert conflict.status_code == 400
    assert conflict.json()["error"]["param"] == "continue_final_message"
    continued = post(server, "/tokenize", {"messages": messages, "continue_final_message": True})
    assert continued.json()["tokens"] == expected


def test_documents_reach_the_template(parts_server: ThreadedServer) -> None:
    template = ("{% for d in documents %}{{ d['text'] }}\n{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template,
            "documents": [{"title": "a", "text": "Once upon a time"}]}
    tokens = httpx.post(parts_server.url + "/tokenize", json=body).json()["tokens"]
    text = parts_server.handle.engine.tokenizer.decode(tokens)
    assert text == "Once upon a time\nhi"


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(entry.token.startswith("token_id:") for entry in content)
    assert all(top.token.startswith("token_id:") for e in content for top in e.top_logprobs)
    completion = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=3, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True})
    tokens = completion.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens and all(token.startswith("token_id:") for token in tokens)


@pytest.mark.parametrize(("extra", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"logprob_token_ids": [5]}, "logprob_token_ids"),
    ({"truncation_side": "right"}, "truncation_side"),
    ({"thinking_token_budget": 64}, "thinking_token_budget"),
])
def test_fields_that_would_be_dropped_are_refused_by_name(
        client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", max_tokens=1, extra_body=extra,
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_neutral_values_of_unimplemented_fields_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
        extra_body={"length_penalty": 1.0, "use_beam_search": False,
                    "truncation_side": "left", "include_reasoning": True})
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_unknown_fields_are_logged_by_name(client: openai.OpenAI,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="triollm.server.state"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=1,
                                  extra_body={"max_tokns": 5})
    assert "ignored: ['max_tokns']" in caplog.text


def test_slo_fields_under_fcfs_are_logged_once(client: openai.OpenAI,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="triollm.server.state"):
        for _ in range(2):
            client.completions.create(model="tiny", prompt="hi", max_tokens=1,
                                      extra_body={"is_latency_sensitive": True, "slo": 0.1})
    assert caplog.text.count("have no effect under --scheduling-policy fcfs") == 1


# -- routes ----------------------------------------------------------------------------


def test_models_retrieve_and_an_unknown_model(client: openai.OpenAI) -> None:
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_sagemaker_routes(server: ThreadedServer) -> None:
    assert httpx.get(server.url + "/ping").status_code == 200
    chat = post(server, "/invocations", {"messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = post(server, "/invocations", {"prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    neither = post(server, "/invocations", {"input": "hi"})
    assert neither.status_code == 400 and neither.json()["error"]["code"] == 400
    bad = post(server, "/invocations", {"prompt": "hi", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_responses_api_text_in_text_out(server: ThreadedServer, client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Once upon a time",
                                       instructions="Be brief.", max_output_tokens=5)
    expected = local_tokens(server, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Once upon a time"}])
    assert response.usage is not None and response.usage.input_tokens == len(expected)
    assert response.usage.output_tokens <= 5 and response.output_text
    chat = client.chat.completions.create(
        model="tiny", max_tokens=5, messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Once upon a time"}])
    assert response.output_text == chat.choices[0].message.content  # both greedy
    listed = client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    assert listed.status in ("completed", "incomplete")
    events = list(client.responses.create(model="tiny", input="Once upon a time",
                                          instructions="Be brief.", max_output_tokens=5,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert events[-1].response.status == "incomplete"  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(model="tiny", input="Once upon a time",
                                 instructions="Be brief.", max_output_tokens=5) as stream:
        final = stream.get_final_response()
    assert final.output_text == response.output_text
    for refused in ({"store": True}, {"previous_response_id": "resp_1"},
                    {"tools": [{"type": "web_search"}]}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="tiny", input="hi", **refused)  # type: ignore[arg-type]


def test_reset_prefix_cache_and_unknown_routes(server: ThreadedServer) -> None:
    assert post(server, "/reset_prefix_cache", {}).status_code == 200
    missing = post(server, "/v1/nowhere", {})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_any_of_several_api_keys(server: ThreadedServer) -> None:
    for key in KEYS:
        assert httpx.get(server.url + "/v1/models",
                         headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(server.url + "/v1/models",
                     headers={"Authorization": "Bearer nope"}).status_code == 401


def test_return_token_ids(server: ThreadedServer) -> None:
    messages = [{"role": "user", "content": "Once upon a time"}]
    chat = post(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True,
    }).json()
    assert chat["prompt_token_ids"] == local_tokens(server, messages)
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {KEYS[0]}"}, json={
            "messages": messages, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "return_token_ids": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in event for event in events[1:])
    streamed = [t for event in events for c in event["choices"] for t in c.get("token_ids", [])]
    assert streamed == chat["choices"][0]["token_ids"]  # greedy: the model's temperature 0

    body = {"prompt": ["Once upon", "a time"], "max_tokens": 4, "ignore_eos": True,
            "return_token_ids": True}
    whole = post(server, "/v1/completions", body).json()
    tokenizer = server.handle.engine.tokenizer
    for choice, prompt in zip(whole["choices"], body["prompt"], strict=True):
        assert choice["prompt_token_ids"] == tokenizer.encode(prompt)
        assert len(choice["token_ids"]) == 4
    plain = post(server, "/v1/completions", {**body, "return_token_ids": False}).json()
    assert plain["choices"][0].get("token_ids") is None


def test_unix_socket_root_path_access_log_and_no_docs(
        llama_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="triollm.server.access_log")
    socket_path = tmp_path / "triollm.sock"
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=128,
                           num_gpu_blocks_override=64)
    engine = AsyncLLMEngine.from_engine_args(args)
    with server_in_thread(engine, uds=str(socket_path), root_path="/api", access_log=True,
                          api_docs=False):
        transport = httpx.HTTPTransport(uds=str(socket_path))
        with httpx.Client(transport=transport, base_url="http://triollm") as http:
            reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert reply.status_code == 200 and reply.json()["object"] == "text_completion"
            # behind a proxy that keeps the prefix, the same routes answer under it
            assert http.get("/api/v1/models").status_code == 200
            assert http.get("/docs").status_code == 404
            assert http.get("/openapi.json").status_code == 404
    [line] = [r.getMessage() for r in caplog.records if '"POST /v1/completions' in r.getMessage()]
    assert re.fullmatch(r'- "POST /v1/completions HTTP/1.1" 200 \d+\.\d{3}s '
                        r'prompt_tokens=\d+ completion_tokens=2', line), line


def test_requests_are_logged_only_when_asked(llama_path: Path) -> None:
    common = {"model": str(llama_path), "max_model_len": 128}
    assert not AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**common)).log_requests
    assert AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(**common, enable_log_requests=True)).log_requests
    assert not AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        **common, enable_log_requests=True, disable_log_requests=True)).log_requests


def test_content_in_each_format_as_vllm_puts_it() -> None:
    from triollm.entrypoints.chat_utils import normalize_messages

    messages = [{"role": "user", "content": "plain"}, {"role": "user", "content": PARTS},
                {"role": "assistant", "content": None}, {"role": "tool", "content": PARTS}]
    assert [m["content"] for m in normalize_messages(messages, "string")] == [
        "plain", "Say hi\ntwice", "", "Say hi\ntwice"]
    assert [m["content"] for m in normalize_messages(messages, "openai")] == [
        [{"type": "text", "text": "plain"}], PARTS, [], "Say hi\ntwice"]
