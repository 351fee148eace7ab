"""Every route in /openapi.json, fuzzed: no input gets a 5xx, every 4xx has OpenAI's
error shape, and every response is what the document says (its status code, content
type, headers and schema: SSE events included).

schemathesis generates requests from the server's own schema, both valid ones
(positive) and ones that break it (negative: wrong types, missing fields, out-of-range
values). The server runs in this process, on loopback, over the fake runner, so each
case costs the HTTP and engine layers and no model time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.testing import FakeModelRunner

#: What each response is checked for: not a 5xx, and what the document says.
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_headers_conformance,
          checks.response_schema_conformance]
API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(max_model_len=128, max_num_seqs=64, num_gpu_blocks_override=1024,
                           disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(
        args, runner_factory=lambda: FakeModelRunner(num_kv_blocks=1024, vocab_size=256))
    with server_in_thread(engine, api_key=API_KEY, served_model_names=("fuzz",)) as running:
        yield running
    assert not running.errors, running.errors


def references(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str):
                yield item
            else:
                yield from references(item)
    elif isinstance(value, list):
        for item in value:
            yield from references(item)


def test_every_reference_in_the_document_resolves(server: ThreadedServer) -> None:
    document = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    schemas = document["components"]["schemas"]
    refs = set(references(document))
    assert "#/components/schemas/ErrorResponse" in refs
    assert {ref.rsplit("/", 1)[1] for ref in refs} <= set(schemas)
    assert "HTTPValidationError" not in schemas  # a bad body is a 400 here, never a 422


def test_no_input_gets_a_5xx_and_every_response_matches_the_document(
        server: ThreadedServer) -> None:
    raw = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    cases = st.sampled_from(operations).flatmap(lambda operation: st.sampled_from(
        list(schemathesis.GenerationMode)).flatmap(operation.as_strategy))
    statuses: Counter[tuple[str, int]] = Counter()
    violations: Counter[tuple[str, int, str]] = Counter()
    examples: dict[tuple[str, int, str], str] = {}

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def fuzz(case: Any) -> None:
        response = case.call(base_url=server.url, headers=AUTH, timeout=30)
        statuses[(case.operation.label, response.status_code)] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=AUTH)
        except BaseException as failure:  # schemathesis raises a group of Failures
            if not isinstance(failure, AssertionError | BaseExceptionGroup):
                raise
            for one in getattr(failure, "exceptions", [failure]):
                key = (case.operation.label, response.status_code, type(one).__name__)
                violations[key] += 1
                examples.setdefault(key, f"{one}\n  body: {case.body!r:.300}\n"
                                         f"  reply: {response.text[:300]}")
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text
            assert error["code"] == response.status_code and error["message"]

    fuzz()
    total = sum(statuses.values())
    print(f"fuzz: {total} cases over {len(operations)} operations: "
          f"{dict(sorted(statuses.items()))}; 5xx and document violations: "
          f"{sum(violations.values())}")
    assert not violations, "\n".join(f"{n} x {key}: {examples[key]}"
                                      for key, n in violations.items())
    assert total >= 400
    # The engine is left with nothing running and nothing held.
    stats = server.handle.engine.statistics()
    assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert server.handle.engine.is_running
