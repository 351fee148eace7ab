"""Every route in /openapi.json, fuzzed: no input gets a 5xx, and every 4xx has
OpenAI's error shape.

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

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.testing import FakeModelRunner

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


def test_no_input_gets_a_5xx_and_every_4xx_has_the_openai_shape(
        server: ThreadedServer) -> None:
    raw = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    cases = st.sampled_from(operations).flatmap(lambda operation: st.sampled_from(
        list(schemathesis.GenerationMode)).flatmap(operation.as_strategy))
    statuses: Counter[tuple[str, int]] = Counter()

    @settings(max_examples=1000, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def fuzz(case: Any) -> None:
        response = case.call(base_url=server.url, headers=AUTH, timeout=30)
        statuses[(case.operation.label, response.status_code)] += 1
        assert response.status_code < 500, (case.operation.label, case.body,
                                            response.text[:500])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text
            assert error["code"] == response.status_code and error["message"]

    fuzz()
    total = sum(statuses.values())
    print(f"fuzz: {total} cases over {len(operations)} operations: "
          f"{dict(sorted(statuses.items()))}")
    assert total >= 1000
    # The engine is left with nothing running and nothing held.
    stats = server.handle.engine.statistics()
    assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert server.handle.engine.is_running
