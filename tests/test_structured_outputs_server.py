"""Structured outputs over HTTP, through the official ``openai`` client against a real
server on 127.0.0.1 serving a random-weight model: every constrained output is valid by
construction, whatever the weights. One server (with a KV cache small enough that
concurrent requests are preempted) serves every test here."""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.cli import build_parser, engine_args_from_namespace, normalize_argv
from triollm.engine.resolve import guided_decoding_backend, structured_outputs_config

MODEL = "tiny"
#: Few enough blocks that four long constrained requests at once cannot all stay.
KV_BLOCKS = 24
MESSAGES: Any = [{"role": "user", "content": "Describe a person as JSON."}]

#: Nested objects, an array of $ref items, enums, anyOf; every string and array bounded
#: so that a random model's output ends well within max_tokens.
PERSON: dict[str, Any] = {
    "$defs": {"pet": {
        "type": "object", "additionalProperties": False, "required": ["kind", "age"],
        "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                       "age": {"type": "integer", "minimum": 0, "maximum": 20}}}},
    "type": "object", "additionalProperties": False,
    "required": ["name", "home", "pets", "contact"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "home": {"type": "object", "additionalProperties": False,
                 "required": ["city", "floor"],
                 "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                "floor": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 3},
        "contact": {"anyOf": [{"type": "boolean"}, {"type": "null"},
                              {"enum": ["email", "phone"]}]},
    },
}
#: A long output: many array items, so that requests grow while others wait.
LONG: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["words"],
    "properties": {"words": {"type": "array", "minItems": 24, "maxItems": 24,
                             "items": {"enum": ["alpha", "beta", "gamma", "delta"]}}}}


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=384,
                           num_gpu_blocks_override=KV_BLOCKS, max_num_seqs=8,
                           structured_outputs_config={"backend": "auto",
                                                      "disable_any_whitespace": True},
                           disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args)
    with server_in_thread(engine, served_model_names=(MODEL,)) as running:
        yield running
    assert not running.errors, running.errors


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def schema_format(schema: dict[str, Any], name: str = "person") -> Any:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def metric(server: ThreadedServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_json_schema_outputs_validate_with_n_and_a_seed(server: ThreadedServer,
                                                       client: openai.OpenAI) -> None:
    hits = metric(server, "triollm:structured_outputs_grammar_cache_hits_total")
    misses = metric(server, "triollm:structured_outputs_grammar_cache_misses_total")
    schema = {**PERSON, "title": "compiled once"}  # a text no other test compiles
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=schema_format(schema), n=3, seed=7,
        temperature=1.0, max_tokens=200)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    again = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=schema_format(schema), n=3, seed=7,
        temperature=1.0, max_tokens=200)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in reply.choices]
    # the schema is compiled once; the second request finds it in the cache
    assert metric(server, "triollm:structured_outputs_grammar_cache_misses_total") == \
        misses + 1
    assert metric(server, "triollm:structured_outputs_grammar_cache_hits_total") == hits + 1


def test_streaming_gives_the_same_text_as_not_streaming(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": MODEL, "messages": MESSAGES, "seed": 11, "temperature": 1.0,
                   "max_tokens": 200, "response_format": schema_format(PERSON)}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [chunk.choices[0].delta.content or "" for chunk in
             client.chat.completions.create(**kwargs, stream=True) if chunk.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole or ""), PERSON)


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, seed=3,
        max_tokens=300, temperature=0.5)
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # free JSON from random weights may run past max_tokens: a prefix of one
        assert (choice.message.content or "").startswith("{")


def test_regex_and_choice_outputs_match(client: openai.OpenAI) -> None:
    pattern = r"[a-e]{3}-\d{2}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=1,
                                               max_tokens=20, extra_body=extra)
        assert re.fullmatch(pattern, reply.choices[0].message.content or ""), extra
    options = ["positive", "negative", "neutral"]
    for extra in ({"guided_choice": options}, {"structured_outputs": {"choice": options}}):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=2, n=3,
                                               max_tokens=20, extra_body=extra)
        assert {c.message.content for c in reply.choices} <= set(options), extra


def test_completions_endpoint_takes_every_form(client: openai.OpenAI) -> None:
    forms: list[tuple[dict[str, Any], Any]] = [
        ({"response_format": schema_format(PERSON)},
         lambda text: jsonschema.validate(json.loads(text), PERSON)),
        ({"guided_json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
        ({"guided_regex": r"\d{4}"}, lambda text: re.fullmatch(r"\d{4}", text) or 1 / 0),
        ({"structured_outputs": {"choice": ["up", "down"]}},
         lambda text: text in ("up", "down") or 1 / 0),
    ]
    for extra, check in forms:
        reply = client.completions.create(model=MODEL, prompt="Output:", max_tokens=200,
                                          seed=5, extra_body=extra)
        assert reply.choices[0].finish_reason == "stop", (extra, reply)
        check(reply.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Output:", max_tokens=200, seed=5, stream=True,
        extra_body={"guided_json": PERSON}) if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)


def test_grammars_in_ebnf_and_lark(client: openai.OpenAI) -> None:
    grammars = {
        "ebnf": 'root ::= answer " " answer\nanswer ::= "yes" | "no" | "maybe"',
        "lark": 'start: answer " " answer\nanswer: "yes" | "no" | "maybe"',
    }
    for kind, grammar in grammars.items():
        for extra in ({"guided_grammar": grammar},
                      {"structured_outputs": {"grammar": grammar}}):
            reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=4,
                                                   max_tokens=20, extra_body=extra)
            text = reply.choices[0].message.content or ""
            assert re.fullmatch(r"(yes|no|maybe) (yes|no|maybe)", text), (kind, text)


def test_responses_text_format(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Describe a person.", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    loose = client.responses.create(model=MODEL, input="Anything.", max_output_tokens=300,
                                    text={"format": {"type": "json_object"}})
    assert loose.output_text.startswith("{")


def test_max_tokens_cuts_the_json_with_finish_reason_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=schema_format(LONG), max_tokens=5)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.content or "").startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content or "")


def test_preempted_requests_still_give_valid_json(server: ThreadedServer,
                                                  client: openai.OpenAI) -> None:
    """Eight long constrained requests at once on a cache that holds a few of them:
    some are preempted mid-JSON and recomputed, and every output still validates."""
    before = metric(server, "vllm:num_preemptions_total")

    def ask(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=schema_format(LONG, "long"),
            seed=seed, temperature=1.0, max_tokens=300)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, range(8)))
    assert metric(server, "vllm:num_preemptions_total") > before
    for text in texts:
        jsonschema.validate(json.loads(text), LONG)


def test_bad_constraints_are_400s_naming_the_field(server: ThreadedServer,
                                                   client: openai.OpenAI) -> None:
    missing_ref = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}},
                   "required": ["a"]}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": schema_format(missing_ref)},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_json": missing_ref}}, "guided_json"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"regex": "[z-a]"}}},
         "structured_outputs.regex"),
        ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}},
         "structured_outputs.grammar"),
        ({"extra_body": {"structured_outputs": {"json": "{not json"}}},
         "structured_outputs.json"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "bogus": 1}}},
         "structured_outputs.bogus"),
        ({"extra_body": {"structured_outputs": {"disable_any_whitespace": True}}},
         "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_regex"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_regex": "a", "guided_decoding_backend": "outlines"}},
         "guided_decoding_backend"),
        # hostile: nested past the bound (a RecursionError), a pattern deep enough to
        # overflow xgrammar's stack (auto falls back to it when llguidance refuses)
        ({"extra_body": {"guided_json": '{"items": ' * 150 + "{}" + "}" * 150}},
         "guided_json"),
        ({"extra_body": {"guided_json": '{"items": ' * 3000 + "{}" + "}" * 3000}},
         "guided_json"),
        ({"extra_body": {"guided_json": {"type": "string",
                                         "pattern": "(" * 50_000 + "a" + ")" * 50_000}}},
         "guided_json"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                           **kwargs)
        body = caught.value.body or {}
        assert body.get("param") == param, (kwargs, body)
        assert str(body.get("message", "")).startswith(param), body
    two = caught_message(client, {"extra_body": {"guided_regex": "a",
                                                 "guided_choice": ["a"]}})
    assert "guided_regex" in two and "guided_choice" in two
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "a(b"})
    assert (caught.value.body or {}).get("param") == "guided_regex"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", max_output_tokens=5, text={
            "format": {"type": "json_schema", "name": "x", "schema": missing_ref}})
    assert (caught.value.body or {}).get("param") == "text.format.schema"
    # the engine keeps serving, and the server's own backend may be named
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10,
        extra_body={"guided_regex": "ok", "guided_decoding_backend":
                    server.handle.engine.config.structured_outputs.backend})
    assert reply.choices[0].message.content == "ok"


def caught_message(client: openai.OpenAI, kwargs: dict[str, Any]) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **kwargs)
    return str((caught.value.body or {}).get("message"))


def test_generate_route_takes_structured_outputs(server: ThreadedServer) -> None:
    reply = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": "Pick:", "max_tokens": 10, "structured_outputs": {"choice": ["x", "y"]}})
    assert reply.status_code == 200, reply.text
    [text] = reply.json()["text"]
    assert text in ("Pick:x", "Pick:y")
    bad = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": "Pick:", "structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith(
        "structured_outputs.")


def test_langchain_with_structured_output(server: ThreadedServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: str = Field(json_schema_extra={"enum": ["cat", "dog"]})
        age: int = Field(ge=0, le=20)

    model = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="-",
                                        model=MODEL, max_tokens=100, seed=1)
    for method in ("json_schema", None):
        structured = (model.with_structured_output(Pet) if method is None
                      else model.with_structured_output(Pet, method=method))
        pet = structured.invoke("A pet, please.")
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog"), method


def test_config_flags_are_read_as_vllm_reads_them() -> None:
    def read(value: str | None, older: str | None = None) -> Any:
        return guided_decoding_backend(structured_outputs_config(value), older)

    config = read('{"backend": "guidance", "disable_fallback": true}')
    assert (config.backend, config.disable_fallback) == ("guidance", True)
    older = read(None, "xgrammar:no-fallback,disable-any-whitespace")
    assert (older.backend, older.disable_fallback, older.disable_any_whitespace) == (
        "xgrammar", True, True)
    assert read('{"backend": "guidance"}', "guidance").backend == "guidance"
    for value, backend, named in (('{"backends": "auto"}', None, "backends"),
                                  ('{"backend": "outlines"}', None, "outlines"),
                                  (None, "outlines", "outlines"),
                                  (None, "xgrammar:fast", "fast"),
                                  ('{"backend": "guidance"}', "xgrammar", "xgrammar"),
                                  ("[1]", None, "JSON object")):
        with pytest.raises(ValueError, match=named):
            read(value, backend)


def test_the_flags_reach_the_engine_arguments() -> None:
    namespace = build_parser().parse_args(normalize_argv([
        "serve", "m", "--structured-outputs-config", '{"disable_any_whitespace": true}',
        "--guided-decoding-backend", "guidance:no-fallback"]))
    args = engine_args_from_namespace(namespace, AsyncEngineArgs)
    config = guided_decoding_backend(structured_outputs_config(args.structured_outputs_config),
                                     args.guided_decoding_backend)
    assert (config.backend, config.disable_fallback, config.disable_any_whitespace) == (
        "guidance", True, True)
