"""Tool calling and reasoning over HTTP, through the official ``openai`` client (and
LangChain and the OpenAI Agents SDK) against a real server on loopback.

Two servers on one tiny random-weight model whose tokenizer knows ``<tool_call>`` and
``<think>``: ``free`` samples the random model (a required or named ``tool_choice``
constrains it, so the arguments validate by construction); ``scripted`` runs with
``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`` and a
hook on the model's logits that makes it say a recorded answer, token by token, so the
server's parsers read real model output.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from tests.server_helpers import ThreadedServer, server_in_thread

from triollm import AsyncLLMEngine
from triollm.engine.args import AsyncEngineArgs

MODEL = "tiny-tools"
TEMPLATE = (
    "{% if tools %}<|system|>\ntools:{% for tool in tools %} {{ tool.function.name }}"
    "{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] or '' }}{{ eos_token }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"query": {"type": "string", "enum": ["tides", "moon"]},
                   "exact": {"type": "boolean"}},
    "required": ["query", "exact"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup", "description": "Look up",
                                      "parameters": LOOKUP}},
]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


class Script:
    """The answer the scripted model gives next: its token ids, one per step."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.step = 0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from triollm.testing import build_tiny_model, train_test_tokenizer

    tokenizer = train_test_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tools") / "m", tokenizer)


@pytest.fixture(scope="module")
def no_spaces(model_path: Path) -> dict[str, float]:
    """A logit bias that keeps a random model's constrained answer short: against
    whitespace-only tokens (a grammar allows any whitespace between JSON tokens) and
    for tokens with ``]`` (the grammar allows them only where the array of calls may
    end, so it ends after a call or two instead of growing to ``max_tokens``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    bias = {str(i): -100.0 for i, text in texts.items() if text and not text.strip()}
    bias.update({str(i): 8.0 for i, text in texts.items() if "]" in text})
    return bias


@pytest.fixture(scope="module")
def free(model_path: Path) -> Iterator[ThreadedServer]:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(model_path), dtype="float32", max_model_len=512,
        num_gpu_blocks_override=256, disable_log_requests=True))
    with server_in_thread(engine, served_model_names=(MODEL,)) as running:
        yield running
    assert not running.errors, running.errors


@pytest.fixture(scope="module")
def script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def scripted(model_path: Path, script: Script) -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(model=str(model_path), dtype="float32", max_model_len=512,
                           num_gpu_blocks_override=256, enable_prefix_caching=False,
                           reasoning_parser="qwen3", disable_log_requests=True)
    config = args.create_engine_config()
    eos = config.model.hf_config.eos_token_id

    def runner_factory() -> Any:
        from triollm.model.runners.torch_runner import TorchModelRunner

        runner = TorchModelRunner(config)

        def new_prompt(module: Any, args: Any, kwargs: Any) -> None:
            if kwargs["input_ids"].shape[-1] > 1:  # a prompt: the answer starts over
                script.step = 0

        def say(module: Any, inputs: Any, logits: Any) -> Any:
            ids = script.ids
            token = ids[script.step] if script.step < len(ids) else eos
            script.step += 1
            logits.fill_(-1e4)
            logits[..., token] = 1e4
            return logits

        runner.model.register_forward_pre_hook(new_prompt, with_kwargs=True)
        runner.model.get_output_embeddings().register_forward_hook(say)
        return runner

    engine = AsyncLLMEngine.from_engine_args(args, runner_factory=runner_factory)
    with server_in_thread(engine, served_model_names=(MODEL,), enable_auto_tool_choice=True,
                          tool_call_parser="hermes") as running:
        yield running
    assert not running.errors, running.errors


def client_of(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def streamed_calls(stream: Any) -> tuple[list[tuple[str, Any]], str | None, str, str]:
    """The tool calls a stream builds from its fragments (name, parsed arguments), its
    finish reason, its content and its reasoning."""
    calls: dict[int, dict[str, str]] = {}
    finish, content, reasoning = None, "", ""
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            extra = delta.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            assert extra.get("reasoning") == extra.get("reasoning_content")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": ""})
                if call.id:
                    assert not entry["id"], "a call's id comes once, in its first fragment"
                    entry["id"] = call.id
                    assert call.function and call.function.name and call.type == "function"
                if call.function and call.function.name:
                    entry["name"] = call.function.name
                if call.function and call.function.arguments:
                    entry["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    assert all(entry["id"] for entry in calls.values())
    return ([(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            finish, content, reasoning)


def whole_calls(message: Any) -> list[tuple[str, Any]]:
    return [(call.function.name, json.loads(call.function.arguments))
            for call in message.tool_calls or []]


# -- required and named: constrained, valid by construction -----------------------------

@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "lookup"}}])
def test_constrained_tool_calls_validate_streamed_or_not(
        free: ThreadedServer, no_spaces: dict[str, float], tool_choice: Any) -> None:
    client = client_of(free)
    kwargs: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                       max_tokens=200, temperature=1.0, seed=11, logit_bias=no_spaces)
    whole = client.chat.completions.create(**kwargs)
    [choice] = whole.choices
    calls = whole_calls(choice.message)
    assert calls, choice.message.content
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(call.id and call.type == "function" for call in choice.message.tool_calls or [])
    if tool_choice == "required":
        assert choice.finish_reason == "tool_calls"
    else:  # a named tool choice keeps "stop", as in vLLM and OpenAI
        assert [name for name, _ in calls] == ["lookup"] and choice.finish_reason == "stop"
    streamed, finish, content, _ = streamed_calls(
        client.chat.completions.create(**kwargs, stream=True))
    assert streamed == calls
    assert finish == choice.finish_reason and content == ""


def test_n_choices_each_have_their_calls(free: ThreadedServer,
                                         no_spaces: dict[str, float]) -> None:
    client = client_of(free)
    kwargs: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                       max_tokens=200, temperature=1.0, seed=5, logit_bias=no_spaces)
    whole = client.chat.completions.create(**kwargs)
    assert len(whole.choices) == 3
    for choice in whole.choices:
        for name, arguments in whole_calls(choice.message):
            jsonschema.validate(arguments, SCHEMAS[name])
    per_choice: dict[int, list[Any]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            per_choice.setdefault(choice.index, []).append(chunk.model_copy(
                update={"choices": [choice]}))
    assert sorted(per_choice) == [0, 1, 2]
    for index, chunks in per_choice.items():
        calls, _, _, _ = streamed_calls(chunks)
        assert calls == whole_calls(whole.choices[index].message)


def test_tool_choice_errors_name_the_field(free: ThreadedServer) -> None:
    client = client_of(free)
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),
        ({"tools": TOOLS, "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}}, "tool_choice",
         "nope"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}],
          "tool_choice": "none"}, "tools[0].function.name", "non-empty"),
        # a bad parameters schema: the grammar's compilation refuses it, naming tools
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": "zero"}}}}}],
          "tool_choice": "required"}, "tools", "minimum"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **kwargs)
        body = caught.value.body or {}
        assert body.get("param") == param and words in body.get("message", ""), body
    served = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                            tools=TOOLS, tool_choice="none")
    assert served.choices[0].message.tool_calls in (None, [])
    # reasoning_effort reaches the chat template, as in vLLM; its values are vLLM's
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    effort = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                            reasoning_effort="high")
    assert plain.usage and effort.usage
    assert effort.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                       extra_body={"reasoning_effort": "extreme"})
    assert (caught.value.body or {}).get("param") == "reasoning_effort"
    # the Responses API does not call tools here: refused by name, not ignored
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                tools=[{"type": "function", "name": "get_weather",
                                        "parameters": WEATHER, "strict": False}])
    assert (caught.value.body or {}).get("param") == "tools"


# -- auto and reasoning: parsers on the model's own output -----------------------------

@pytest.fixture(scope="module")
def speak(scripted: ThreadedServer, script: Script, model_path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))

    def set_answer(text: str) -> None:
        script.ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(script.ids) == text

    return set_answer


ANSWER = ('<think>The user wants weather.</think>Let me check.<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')


def test_auto_reads_hermes_calls_and_reasoning(scripted: ThreadedServer, speak: Any) -> None:
    speak(ANSWER)
    client = client_of(scripted)
    kwargs: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    [choice] = whole.choices
    message = choice.message
    assert whole_calls(message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert choice.finish_reason == "tool_calls"
    extra = message.model_extra or {}
    assert extra["reasoning"] == extra["reasoning_content"] == "The user wants weather."
    assert (message.content or "").strip() == "Let me check."
    calls, finish, content, reasoning = streamed_calls(
        client.chat.completions.create(**kwargs, stream=True))
    assert calls == whole_calls(message) and finish == "tool_calls"
    assert reasoning == "The user wants weather." and content.strip() == "Let me check."


def test_parallel_tool_calls_false_keeps_the_first_call(scripted: ThreadedServer,
                                                        speak: Any) -> None:
    second = ('<tool_call>\n{"name": "lookup", "arguments": {"query": "moon", "exact": '
              'true}}\n</tool_call>')
    speak(ANSWER + second)
    client = client_of(scripted)
    kwargs: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300)
    both = whole_calls(client.chat.completions.create(**kwargs).choices[0].message)
    assert [name for name, _ in both] == ["get_weather", "lookup"]
    first = client.chat.completions.create(**kwargs, parallel_tool_calls=False)
    assert whole_calls(first.choices[0].message) == both[:1]
    calls, _, _, _ = streamed_calls(client.chat.completions.create(
        **kwargs, parallel_tool_calls=False, stream=True))
    assert calls == both[:1]


def test_auto_without_a_call_is_text(scripted: ThreadedServer, speak: Any) -> None:
    speak("<think>Easy.</think>It is sunny.")
    reply = client_of(scripted).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=40)
    message = reply.choices[0].message
    assert message.content == "It is sunny." and not message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_include_reasoning_false_and_thinking_off(scripted: ThreadedServer,
                                                  speak: Any) -> None:
    client = client_of(scripted)
    speak("<think>Hidden.</think>Shown.")
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                           extra_body={"include_reasoning": False})
    message = reply.choices[0].message
    assert message.content == "Shown." and (message.model_extra or {}).get("reasoning") is None
    _, _, content, reasoning = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, stream=True,
        extra_body={"include_reasoning": False}))
    assert content == "Shown." and reasoning == ""
    # the template closes the reasoning in the prompt: the whole answer is content
    speak("Straight to it.")
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content == "Straight to it."
    assert (message.model_extra or {}).get("reasoning") is None


def test_constraint_and_tool_calls_start_after_the_reasoning(
        scripted: ThreadedServer, speak: Any, no_spaces: dict[str, float]) -> None:
    """The model reasons freely (the script), then the engine's grammar takes over from
    the token after </think>: the calls come from the answer after the reasoning."""
    speak("<think>Plan: call it.</think>")
    client = client_of(scripted)
    kwargs: Any = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                       max_tokens=200, temperature=1.0, seed=4, logit_bias=no_spaces)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert (message.model_extra or {})["reasoning"] == "Plan: call it."
    calls = whole_calls(message)
    assert calls and whole.choices[0].finish_reason == "tool_calls"
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    streamed, _, _, reasoning = streamed_calls(
        client.chat.completions.create(**kwargs, stream=True))
    assert (streamed, reasoning) == (calls, "Plan: call it.")


# -- clients: LangChain and the OpenAI Agents SDK ------------------------------------------

def test_langchain_bind_tools_round_trip(free: ThreadedServer,
                                         no_spaces: dict[str, float]) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def lookup(query: Literal["tides", "moon"], exact: bool) -> str:
        """Look something up."""
        return f"{query}: found" if exact else "maybe"

    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=free.url + "/v1",
                                       api_key="none", max_tokens=200, temperature=1.0,
                                       seed=2, max_retries=0, logit_bias=no_spaces)
    schema = lookup.args_schema.model_json_schema()  # type: ignore[union-attr]
    for choice in ("required", "lookup"):
        message = chat.bind_tools([lookup], tool_choice=choice).invoke("Look up the tides")
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert call["name"] == "lookup"
            jsonschema.validate(call["args"], schema)
            assert lookup.invoke(call["args"]) in ("maybe", f"{call['args']['query']}: found")


def test_openai_agents_sdk_runs_one_tool_call(free: ThreadedServer,
                                              no_spaces: dict[str, float]) -> None:
    agents = pytest.importorskip("agents")
    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return f"sunny in {city}"

    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=free.url + "/v1",
                                                      api_key="none", max_retries=0))
    agent = agents.Agent(
        name="weather", instructions="Answer with the tool.", tools=[get_weather],
        model=model, tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200,
                                            temperature=1.0,
                                            extra_body={"logit_bias": no_spaces}))
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=2)
    assert len(calls) == 1
    assert result.final_output == f"sunny in {calls[0][0]}"
