"""One client's answers from the server alone are paced to its share of a core
(``--client-cpu-share``): the arithmetic as a property over any costs and timings, and
over HTTP against a real server, a flood of /health and of errors slowed to the share
while the same client's generation requests and other clients go at their own pace."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.cli import build_parser, server_options_from_namespace
from triollm.server.client_budget import (
    ALLOWANCE_SECONDS,
    ONE_ANSWER_SECONDS,
    REQUEST_SECONDS,
    ClientBudget,
    estimated_cost,
)
from triollm.testing import FakeModelRunner, train_test_tokenizer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=300, deadline=None)
@given(share=st.floats(0.01, 2.0),
       answers=st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 3.0)), max_size=60))
def test_a_client_in_series_gets_its_share_and_no_more(
        share: float, answers: list[tuple[float, float]]) -> None:
    """A client that sends each request when the previous answer is released (after
    ``pause`` seconds of its own): by the time each answer is released, the CPU charged
    for all of them (each capped at what one answer may owe) fits in its share of the
    time since it began plus the allowance."""
    clock = Clock()
    budget = ClientBudget(share, clock=clock)
    began = clock.now
    charged = 0.0
    for pause, cost in answers:
        clock.now += pause
        assert budget.start_wait("10.0.0.1") == 0.0  # one client in series never waits
        hold = budget.charge("10.0.0.1", cost)
        assert hold >= 0.0
        clock.now += hold
        charged += min(cost, share * ONE_ANSWER_SECONDS)
        assert charged <= share * (clock.now - began + ALLOWANCE_SECONDS) * (1 + 1e-9) + 1e-9


@settings(max_examples=200, deadline=None)
@given(share=st.floats(0.01, 2.0),
       pauses=st.lists(st.floats(0.001, 5.0), max_size=60),
       fraction=st.floats(0.0, 1.0))
def test_a_client_within_its_share_is_never_held(share: float, pauses: list[float],
                                                 fraction: float) -> None:
    """Whatever its timing, a client whose every answer costs no more than its share of
    the time since the previous one (up to the allowance: idle time is not saved up
    beyond it) is never held."""
    clock = Clock()
    budget = ClientBudget(share, clock=clock)
    for pause in pauses:
        clock.now += pause
        cost = fraction * share * min(pause, ALLOWANCE_SECONDS)
        assert budget.charge("10.0.0.1", cost) == 0.0


def test_addresses_are_paced_apart_and_settled_ones_are_forgotten() -> None:
    clock = Clock()
    budget = ClientBudget(0.05, clock=clock)
    assert budget.charge("a", 2.0) == pytest.approx(ONE_ANSWER_SECONDS - ALLOWANCE_SECONDS)
    assert budget.charge("b", REQUEST_SECONDS) == 0.0
    for index in range(2000):  # many one-off clients, all settled a second later
        budget.charge(f"c{index}", REQUEST_SECONDS)
        clock.now += 0.001
    budget.charge("d", REQUEST_SECONDS)
    assert budget.statistics().clients < 1100  # "a" still owes; the settled went
    assert budget.charge("a", 0.0) > 0.0


def test_many_answers_at_once_make_the_address_wait_before_its_next_request() -> None:
    clock = Clock()
    budget = ClientBudget(0.05, clock=clock)
    for _ in range(3):  # three connections' answers charged before any was released
        budget.charge("a", 10.0)
    assert budget.start_wait("a") == pytest.approx(
        3 * ONE_ANSWER_SECONDS - ALLOWANCE_SECONDS - ONE_ANSWER_SECONDS)
    assert budget.start_wait("b") == 0.0


def test_the_engine_pays_for_what_it_serves() -> None:
    assert estimated_cost(served_by_engine=True, failed=False, body_bytes=10**6,
                          worker_seconds=0.0) == 0.0
    assert estimated_cost(served_by_engine=True, failed=False, body_bytes=10**6,
                          worker_seconds=0.5) == 0.5
    assert estimated_cost(served_by_engine=True, failed=True, body_bytes=0,
                          worker_seconds=0.0) == REQUEST_SECONDS
    assert estimated_cost(served_by_engine=False, failed=False, body_bytes=0,
                          worker_seconds=0.0) == REQUEST_SECONDS
    assert estimated_cost(served_by_engine=False, failed=True, body_bytes=10**6,
                          worker_seconds=1.0) > 1.0


def test_the_flag() -> None:
    def share(*flags: str) -> float | None:
        namespace = build_parser().parse_args(["serve", *flags])
        return server_options_from_namespace(namespace).client_cpu_share

    assert share() == 0.02
    assert share("--client-cpu-share", "0.2") == 0.2
    assert share("--client-cpu-share", "0") is None
    with pytest.raises(SystemExit):
        share("--client-cpu-share", "-1")
    with pytest.raises(ValueError, match="share"):
        ClientBudget(0.0)


#: Each answer the server gives alone costs at least REQUEST_SECONDS: at this share,
#: 0.1 s of holding apiece once the allowance is spent.
SHARE = REQUEST_SECONDS / 0.1


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[ThreadedServer]:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(disable_log_requests=True),
                                             runner_factory=FakeModelRunner)
    with server_in_thread(engine, served_model_names=("demo",), trust_request_chat_template=True,
                          client_cpu_share=request.param) as running:
        yield running
    assert not running.errors, running.errors


def _timed(send: object, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        send()  # type: ignore[operator]
    return time.perf_counter() - started


@pytest.mark.parametrize("server", [SHARE], indirect=True)
def test_a_flood_is_slowed_to_the_share_while_generation_goes_on(
        server: ThreadedServer) -> None:
    allowance = int(ALLOWANCE_SECONDS / 0.1)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        def health() -> None:
            assert client.get("/health").status_code == 200

        def refused() -> None:
            response = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
            assert response.status_code == 404
            assert response.json()["error"]["code"] == 404

        assert _timed(health, allowance - 2) < 1.0  # within the allowance: not held
        assert _timed(health, 12) > 0.7  # past it: about 0.1 s apiece
        assert _timed(refused, 5) > 0.4  # errors too
        # The same client's generation request is served at the engine's pace.
        started = time.perf_counter()
        response = client.post("/v1/completions", json={
            "model": "demo", "prompt": "hello", "max_tokens": 4})
        assert response.status_code == 200
        assert time.perf_counter() - started < 0.08
        metrics = client.get("/metrics").text
    assert server.handle.client_budget is not None
    held = server.handle.client_budget.statistics().answers_held
    assert held >= 15
    scraped = next(line for line in metrics.splitlines()
                   if line.startswith("triollm:client_answers_held_total "))
    assert held - 1 <= float(scraped.split()[1]) <= held  # the scrape's own may follow


@pytest.mark.parametrize("server", [0.1], indirect=True)
def test_a_long_texts_tokenization_past_the_allowance_is_paced_to_the_share(
        server: ThreadedServer) -> None:
    """A long text is encoded in a worker process: at full speed for what is left of
    its client's allowance (0.2 s of CPU at this share), then at a tenth of a core. The
    paced time is paid as it runs: the address is not held for it afterwards."""
    text = "hello world " * 50_000
    started = time.process_time()
    train_test_tokenizer().encode(text)
    encoding = time.process_time() - started
    started = time.perf_counter()
    reply = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=120)
    assert reply.status_code == 200
    assert time.perf_counter() - started > 2 * encoding
    budget = server.handle.client_budget
    assert budget is not None
    assert budget.behind("127.0.0.1") < ALLOWANCE_SECONDS + 1.0


@pytest.mark.parametrize("server", [None], indirect=True)
def test_without_a_share_nothing_is_held(server: ThreadedServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert _timed(lambda: client.get("/health"), 60) < 3.0


@pytest.mark.parametrize("server", [0.1], indirect=True)
def test_a_trusted_request_templates_render_is_paced_and_the_next_completion_is_not(
        server: ThreadedServer) -> None:
    """A request's own chat template renders in a worker process: the engine serves the
    answer, but the render's time is the client's, so once the address is past its
    allowance the render runs at its share of a core. Paced, the address never falls so
    far behind that the same client's next plain completion waits."""
    template = ("{% for i in range(2000) %}{% for j in range(1500) %}{% endfor %}{% endfor %}"
                "{{ messages[0]['content'] }}")
    took = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for index in range(5):  # the first starts the worker process
            started = time.perf_counter()
            reply = client.post("/v1/chat/completions", json={
                "model": "demo", "max_tokens": 2,
                "chat_template": template if index else "{{ messages[0]['content'] }}",
                "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200, reply.text
            took.append(time.perf_counter() - started)
        # each paced render runs for what the allowance has left, then at the share
        assert sum(took[2:]) > 5 * took[1]
        budget = server.handle.client_budget
        assert budget is not None
        assert budget.behind("127.0.0.1") <= ALLOWANCE_SECONDS + 1.0
        started = time.perf_counter()
        reply = client.post("/v1/completions", json={"model": "demo", "prompt": "hello",
                                                      "max_tokens": 4})
        assert reply.status_code == 200
        assert time.perf_counter() - started < 0.5
