"""The tool-call parsers on recorded model texts, whole and streamed: the same calls and
content either way, however the text is cut, and never an exception on any text."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triollm.tool_parsers import DeltaMessage, ToolParser, ToolParserManager

SPECIAL = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
           "<think>", "</think>"]

WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "threshold": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "options": {"type": "object"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}}}}},
]


class Request:
    """The fields of a chat request a parser reads."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = WEATHER_TOOLS if tools is None else tools
        self.tool_choice = "auto"
        self.skip_special_tokens = True


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer: Any) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(SPECIAL)
    return tok


def make(name: str, tok: Any) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)(tok)


def whole(name: str, tok: Any, text: str) -> tuple[list[tuple[str, Any]], str | None]:
    info = make(name, tok).extract_tool_calls(text, Request())
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    assert info.tools_called == bool(calls)
    return calls, info.content


def stream_chunks(name: str, tok: Any, chunks: list[str]) -> tuple[list[tuple[str, str]], str]:
    """Feed ``chunks`` as the serving layer would, then the end of the output; check
    the shape of every delta (name first with id and type, then argument text)."""
    p = make(name, tok)
    request = Request()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content = ""
    previous = ""

    def take(delta: DeltaMessage | None) -> None:
        nonlocal content
        if delta is None:
            return
        content += delta.content or ""
        for call in delta.tool_calls:
            function = call.function
            assert function is not None
            if call.index not in names:
                assert call.index == len(names), "calls open in order"
                assert call.id and call.type == "function" and function.name
                assert not function.arguments
                names[call.index] = function.name
                arguments[call.index] = ""
            else:
                assert call.id is None and function.name is None
                arguments[call.index] += function.arguments or ""

    for chunk in chunks:
        current = previous + chunk
        ids = tok.encode(current, add_special_tokens=False)
        take(p.extract_tool_calls_streaming(previous, current, chunk, [], ids, [], request))
        previous = current
    take(p.finish_streaming(previous, request))
    return [(names[i], arguments[i]) for i in sorted(names)], content


def parsed(streamed: tuple[list[tuple[str, str]], str]) -> tuple[list[tuple[str, Any]], str]:
    return [(name, json.loads(arguments)) for name, arguments in streamed[0]], streamed[1]


def by_tokens(tok: Any, text: str) -> list[str]:
    """``text`` cut at its token boundaries (whole characters only, as detokenized)."""
    chunks, previous, pending = [], "", []
    for token in tok.encode(text, add_special_tokens=False):
        pending.append(token)
        piece = tok.decode(pending)
        if "\ufffd" in piece:
            continue
        chunks.append(piece)
        previous += piece
        pending = []
    assert previous == text
    return chunks


def check(name: str, tok: Any, text: str, calls: list[tuple[str, Any]],
          content: str | None, *, malformed: bool = False) -> None:
    """Whole, ``text`` gives ``calls`` and ``content``; streamed by tokens or by
    characters, the same (a malformed call may have streamed before it broke: then
    streaming need only not raise)."""
    assert whole(name, tok, text) == (calls, content)
    expected = (calls, content or "") if calls else ([], text)
    for chunks in (by_tokens(tok, text), list(text)):
        streamed = stream_chunks(name, tok, chunks)
        if not malformed:
            assert parsed(streamed) == expected


WEATHER = ("get_weather", {"city": "San Francisco", "days": 3})
HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 3}}'
     '\n</tool_call>', [WEATHER], None),
    ("I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"東京\", \"options\": {\"units\": [\"c\", {\"deep\": null}]}}}\n</tool_call>\n"
     "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"a \\\"quoted\\\" }\"}}"
     "\n</tool_call>",
     [("get_weather", {"city": "東京", "options": {"units": ["c", {"deep": None}]}}),
      ("search", {"query": 'a "quoted" }'})], "I'll check both.\n"),
    # Arguments as a JSON string, and no end tag before the end of the output.
    ('<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}',
     [("search", {"query": "x"})], None),
    ("The weather is sunny.", [], "The weather is sunny."),
    ("Use <tool_call> tags", [], "Use <tool_call> tags"),
]
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {"query": "cut by max_tok',
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
]


LLAMA = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", "days": 3}}',
     [WEATHER], None),
    ('{"name": "get_weather", "parameters": {"city": "San Francisco", "days": 3}}; '
     '{"type": "function", "name": "search", "parameters": {"query": "café ☕"}}',
     [WEATHER, ("search", {"query": "café ☕"})], None),
    ('{"name": "search", "arguments": {"query": "x"}}\n\nI searched for x.',
     [("search", {"query": "x"})], "\n\nI searched for x."),
    ("The capital of France is Paris.", [], "The capital of France is Paris."),
]
LLAMA_MALFORMED = ['{"answer": 42}', '{"name": "search", "parameters": {"query": "x"']

MISTRAL = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "San Francisco", '
     '"days": 3}}, {"name": "search", "arguments": {"query": "naïve \\u00e9"}}]',
     [WEATHER, ("search", {"query": "naïve é"})], None),
    ('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "San Francisco", "days": 3}'
     '[TOOL_CALLS]search[ARGS]{"query": "[ARGS] inside"}',
     [WEATHER, ("search", {"query": "[ARGS] inside"})], "Let me look."),
    ("Bonjour ! Comment puis-je aider ?", [], "Bonjour ! Comment puis-je aider ?"),
]
MISTRAL_MALFORMED = ["[TOOL_CALLS] [{'name': 'f'}]", '[TOOL_CALLS]search[ARGS]{"query": ',
                     "[TOOL_CALLS]"]

PYTHONIC = [
    ('[get_weather(city="San Francisco", days=3)]', [WEATHER], None),
    ("[get_weather(city='東京', metric=True, options={'units': ['c', None], 'x': -1.5}), "
     "search(query=\"a, b) and [c]\")]\nDone.",
     [("get_weather", {"city": "東京", "metric": True,
                       "options": {"units": ["c", None], "x": -1.5}}),
      ("search", {"query": "a, b) and [c]"})], "\nDone."),
    ("<|python_start|>[search(query=\"x\")]<|python_end|>", [("search", {"query": "x"})], None),
    ("[1, 2, 3] are numbers.", [], "[1, 2, 3] are numbers."),
    ("I cannot call tools for that.", [], "I cannot call tools for that."),
]
PYTHONIC_MALFORMED = ["[get_weather('Paris')]", "[os.system(cmd=__import__('os'))]",
                      "[search(query=\"x\"", "[search(**kwargs)]"]

QWEN3_CODER = [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", [WEATHER], None),
    ("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n</parameter>\n"
     "<parameter=metric>\nTrue\n</parameter>\n<parameter=threshold>\n2.5\n</parameter>\n"
     "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=options>\n{'deep': {'x': 1}}"
     "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
     "<parameter=query>\nline one\n</parameter> is literal\nline two\n</parameter>\n"
     "</function>\n</tool_call>",
     [("get_weather", {"city": "北京", "metric": True, "threshold": 2.5, "tags": ["a", "b"],
                       "options": {"deep": {"x": 1}}}),
      ("search", {"query": "line one\n</parameter> is literal\nline two"})], "Checking.\n\n"),
    # A parameter the tool does not declare stays text; one without its end tag ends
    # at the function's end.
    ("<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n<parameter=extra>"
     "\n7\n</function>\n</tool_call>", [("search", {"query": "42", "extra": "7"})], None),
    ("No tools needed: 2 + 2 = 4.", [], "No tools needed: 2 + 2 = 4."),
]
QWEN3_CODER_MALFORMED = ["<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>",
                         "<tool_call>\n<parameter=city>\nx\n</parameter>\n</tool_call>"]

RECORDED = [(name, *case) for name, cases in [
    ("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL),
    ("pythonic", PYTHONIC), ("qwen3_coder", QWEN3_CODER)] for case in cases]
MALFORMED = [(name, text) for name, texts in [
    ("hermes", HERMES_MALFORMED), ("llama3_json", LLAMA_MALFORMED),
    ("mistral", MISTRAL_MALFORMED), ("pythonic", PYTHONIC_MALFORMED),
    ("qwen3_coder", QWEN3_CODER_MALFORMED)] for text in texts]


@pytest.mark.parametrize(("name", "text", "calls", "content"), RECORDED)
def test_recorded_outputs_whole_and_streamed(tool_tokenizer: Any, name: str, text: str,
                                             calls: list[Any], content: str | None) -> None:
    check(name, tool_tokenizer, text, calls, content)


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_stay_content(tool_tokenizer: Any, name: str, text: str) -> None:
    check(name, tool_tokenizer, text, [], text, malformed=True)


def test_text_that_could_open_a_call_waits_for_the_next_delta(tool_tokenizer: Any) -> None:
    p = make("hermes", tool_tokenizer)
    delta = p.extract_tool_calls_streaming("", "x < 5 <tool_", "x < 5 <tool_", [], [], [],
                                           Request())
    assert delta is not None and delta.content == "x < 5 "
    assert p.extract_tool_calls_streaming("x < 5 <tool_", "x < 5 <tool_c", "c", [], [], [],
                                          Request()) is None
    end = p.finish_streaming("x < 5 <tool_c", Request())
    assert end is not None and end.content == "<tool_c" and end.tool_calls == []


def test_mistral_ids_are_nine_letters_and_digits(tool_tokenizer: Any) -> None:
    info = make("mistral", tool_tokenizer).extract_tool_calls(MISTRAL[0][0], Request())
    streamed = make("mistral", tool_tokenizer).extract_tool_calls_streaming(
        "", MISTRAL[0][0], MISTRAL[0][0], [], [], [], Request())
    assert streamed is not None
    ids = [call.id for call in info.tool_calls] + [streamed.tool_calls[0].id]
    assert all(i is not None and len(i) == 9 and i.isalnum() for i in ids)
    assert len(set(ids)) == 3




def test_hermes_keeps_special_tokens_in_the_text(tool_tokenizer: Any) -> None:
    request = make("hermes", tool_tokenizer).adjust_request(Request())
    assert request.skip_special_tokens is False


PARSERS = sorted(ToolParserManager.tool_parsers)


PIECES = [*'{}[]":,;()=<>/ \nab1', *SPECIAL, "<function=", "<parameter=", "</parameter>",
          "</function>", '"name"', '"arguments"', '{"name": "search", "arguments": ']


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PARSERS), st.lists(st.sampled_from(PIECES), max_size=40).map("".join)
       | st.text(max_size=80), st.lists(st.integers(1, 8), max_size=30))
def test_no_text_makes_a_parser_raise(name: str, text: str, sizes: list[int]) -> None:
    tok = _TOKENIZER[0]
    make(name, tok).extract_tool_calls(text, Request())
    p, previous, pos = make(name, tok), "", 0
    for size in [*sizes, len(text)]:
        current = text[:pos + size]
        p.extract_tool_calls_streaming(previous, current, current[len(previous):], [], [], [],
                                       Request())
        previous, pos = current, pos + size
    p.finish_streaming(text, Request())


_TOKENIZER: list[Any] = []


@pytest.fixture(autouse=True, scope="module")
def _share_tokenizer(tool_tokenizer: Any) -> None:
    _TOKENIZER[:] = [tool_tokenizer]


# Well-formed outputs of every format, from generated calls and content.
TEXT = st.text(alphabet="ab é日<>.,!\n\t", max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(
    allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=8)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=5), inner, max_size=3), max_leaves=6)
JSON_ARGS = st.dictionaries(st.text(min_size=1, max_size=6), JSON_VALUES, max_size=4)
PY_ARGS = st.dictionaries(st.sampled_from(["city", "days", "q", "x_1"]), JSON_VALUES, max_size=3)
TYPED_ARGS = st.fixed_dictionaries({}, optional={
    "city": st.text(alphabet="ab é日<>/\n", max_size=10).filter(lambda t: t.strip() == t),
    "days": st.integers(-99, 10**6), "metric": st.booleans(),
    "threshold": st.floats(-1e6, 1e6, allow_nan=False).filter(lambda f: not f.is_integer()),
    "tags": st.lists(st.text(max_size=4), max_size=3), "options": st.dictionaries(
        st.text(max_size=4), JSON_VALUES, max_size=2)})
NAMES = st.sampled_from(["get_weather", "search", "fn_2"])


def _py(value: Any) -> str:
    return repr(value)


def render(name: str, calls: list[tuple[str, dict[str, Any]]], before: str, after: str,
           variant: bool) -> tuple[str, str | None]:
    """A model's text calling ``calls`` with content around them, and the content a
    parser gives for it."""
    ascii_only = variant
    if name == "hermes":
        body = "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a},
                         ensure_ascii=ascii_only) + "\n</tool_call>" for n, a in calls)
        return before + body + after, (before if before.strip() else "") + (
            after if after.strip() else "") or None
    if name in ("llama3_json", "llama4_json"):
        body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
        return ("<|python_tag|>" if variant else "") + body + after, after if after.strip() \
            else None
    if name == "mistral":
        if variant:
            body = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
        else:
            body = "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
        return before + body + after, (before if before.strip() else "") + (
            after if after.strip() else "") or None
    if name == "pythonic":
        body = "[" + ", ".join(n + "(" + ", ".join(f"{k}={_py(v)}" for k, v in a.items())
                               + ")" for n, a in calls) + "]"
        return body + after, after if after.strip() else None
    body = "\n".join("<tool_call>\n<function=" + n + ">\n" + "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in a.items()) + "</function>\n</tool_call>" for n, a in calls)
    return before + body + after, (before if before.strip() else "") + (
        after if after.strip() else "") or None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PARSERS), st.data())
def test_streaming_in_any_cuts_gives_the_whole_outputs_calls(name: str, data: st.DataObject
                                                             ) -> None:
    tok = _TOKENIZER[0]
    args = {"pythonic": PY_ARGS, "qwen3_coder": TYPED_ARGS, "qwen3_xml": TYPED_ARGS}.get(
        name, JSON_ARGS)
    names = NAMES if name not in ("qwen3_coder", "qwen3_xml") else st.just("get_weather")
    calls = data.draw(st.lists(st.tuples(names, args), min_size=1, max_size=3))
    text, content = render(name, calls, data.draw(TEXT), data.draw(TEXT), data.draw(st.booleans()))
    expected = [(n, json.loads(json.dumps(a))) for n, a in calls]
    assert whole(name, tok, text) == (expected, content)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=20)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True) if i < j]
    assert parsed(stream_chunks(name, tok, chunks)) == (expected, content or "")
    assert parsed(stream_chunks(name, tok, by_tokens(tok, text))) == (expected, content or "")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_coder",
                                  "required"])
def test_a_stream_of_many_calls_reads_each_finished_call_once(
        tool_tokenizer: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # every delta re-reading every finished call cost time in the square of the answer
    from triollm.tool_parsers import hermes, json_calls, llama3_json, qwen3_coder
    from triollm.tool_parsers.constrained import RequiredToolCallParser

    reads = [0]

    def counted(module: Any, attribute: str) -> None:
        original = getattr(module, attribute, None)
        if original is None:
            return

        def count(*args: Any) -> Any:
            reads[0] += 1
            return original(*args)

        monkeypatch.setattr(module, attribute, count)

    counted(json_calls, "scan_call_object")
    counted(hermes, "scan_call_object")
    counted(llama3_json, "scan_call_object")
    counted(qwen3_coder, "_function")
    calls = [("get_weather", {"city": f"c{i}", "days": i}) for i in range(40)]
    if name == "required":
        text = json.dumps([{"name": n, "parameters": a} for n, a in calls])
        parser: ToolParser = RequiredToolCallParser(tool_tokenizer)
    else:
        text = render(name, calls, "", "", False)[0]
        parser = make(name, tool_tokenizer)
    request, sent, previous = Request(), 0, ""
    chunks = [text[i:i + 7] for i in range(0, len(text), 7)]
    for chunk in chunks:
        delta = parser.extract_tool_calls_streaming(previous, previous + chunk, chunk, [],
                                                    [], [], request)
        previous += chunk
        sent += len(delta.tool_calls) if delta is not None else 0
    parser.finish_streaming(text, request)
    assert len(parser.prev_tool_call_arr) == len(calls)
    assert [json.loads(call["arguments"]) for call in parser.prev_tool_call_arr] == [
        a for _, a in calls]
    assert reads[0] <= 2 * len(chunks) + len(calls)  # reading all of them: ~20 times that
    # a text that does not extend the last one is read afresh
    first = make(name, tool_tokenizer) if name != "required" else RequiredToolCallParser(
        tool_tokenizer)
    short = (json.dumps([{"name": n, "parameters": a} for n, a in calls[:2]])
             if name == "required" else render(name, calls[:2], "", "", False)[0])
    first.extract_tool_calls(text, request)
    again = first.extract_tool_calls(short, request)
    assert [json.loads(c.function.arguments) for c in again.tool_calls] == [
        a for _, a in calls[:2]]
