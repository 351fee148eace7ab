"""Each choice of an ``n > 1`` request is reported as zero or more deltas, then exactly
one finish, then nothing: in the engine's ``RequestOutput`` stream (every output kind,
with stop strings, ``max_tokens``, aborts and preemption), and in the server's SSE
streams for completions and chat.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams
from triollm.engine.core import EngineCore
from triollm.model.loader import build_demo_tokenizer
from triollm.outputs import CompletionOutput, RequestOutput
from triollm.sampling_params import RequestOutputKind
from triollm.step import RunnerOutput, SchedulerOutput
from triollm.testing import FakeModelRunner

VOCAB = 900
RUNS = Counter[str]()


class DivergingRunner(FakeModelRunner):
    """The fake model, with each sample of a request on its own path (its engine id
    ends in ``-<index>``), so the samples of one request stop at different steps."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        output = super().execute_model(scheduler_output)
        for request_id, token in output.sampled_token_ids.items():
            index = int(request_id.rsplit("-", 1)[1])
            output.sampled_token_ids[request_id] = (token + 37 * index) % self.vocab_size
        return output


@dataclass(frozen=True)
class Call:
    prompt: list[int]
    n: int
    max_tokens: int
    stop: list[str]
    kind: RequestOutputKind
    abort_at_step: int | None


calls = st.builds(
    Call,
    prompt=st.lists(st.integers(5, VOCAB - 1), min_size=1, max_size=16),
    n=st.integers(1, 4),
    max_tokens=st.integers(1, 16),
    # Half without stop strings, so that requests run long enough to be preempted.
    stop=st.one_of(st.just([]), st.lists(
        st.sampled_from(["e", "a", " ", "th", "in", "o", "zz"]), min_size=1, max_size=3)),
    kind=st.sampled_from(list(RequestOutputKind)),
    abort_at_step=st.one_of(st.none(), st.integers(0, 12)),
)


def check_choice_events(kind: RequestOutputKind, n: int, outputs: list[RequestOutput]
                        ) -> dict[int, list[CompletionOutput]]:
    """The event sequence of every choice; returns each choice's events."""
    assert outputs, "a request that ran to its end delivers at least its final output"
    finals = [i for i, output in enumerate(outputs) if output.finished]
    assert finals == [len(outputs) - 1], "one final output, and it is the last"
    events: dict[int, list[CompletionOutput]] = defaultdict(list)
    for output in outputs:
        indexes = [completion.index for completion in output.outputs]
        assert len(indexes) == len(set(indexes)), "a choice twice in one output"
        assert output.outputs, "an output with no choice in it"
        for completion in output.outputs:
            events[completion.index].append(completion)
    assert sorted(events) == list(range(n)), "every choice is reported"
    for index, sequence in events.items():
        reasons = [completion.finish_reason for completion in sequence]
        assert reasons[-1] is not None and all(r is None for r in reasons[:-1]), (
            index, reasons)
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(sequence) == 1
        if kind is RequestOutputKind.CUMULATIVE:
            for before, after in itertools.pairwise(sequence):
                assert after.token_ids[:len(before.token_ids)] == before.token_ids
                assert after.text.startswith(before.text)
    return events


def run_calls(calls: list[Call], num_blocks: int
              ) -> tuple[EngineCore, dict[str, list[RequestOutput]]]:
    args = EngineArgs(max_model_len=48, max_num_batched_tokens=16, block_size=4,
                      max_num_seqs=8)
    core = EngineCore(args.create_engine_config(),
                      DivergingRunner(num_kv_blocks=num_blocks, vocab_size=VOCAB),
                      build_demo_tokenizer())
    delivered: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(calls))}
    for i, call in enumerate(calls):
        core.add_request(str(i), {"prompt_token_ids": call.prompt}, SamplingParams(
            n=call.n, max_tokens=call.max_tokens, ignore_eos=True, stop=call.stop,
            output_kind=call.kind, seed=i))
    for step in range(5000):  # preemption under few blocks recomputes a lot
        for i, call in enumerate(calls):
            if call.abort_at_step == step:
                for output in core.abort_requests([str(i)]):
                    delivered[output.request_id].append(output)
        if not core.has_unfinished_requests():
            break
        for output in core.step():
            assert isinstance(output, RequestOutput)
            delivered[output.request_id].append(output)
    assert not core.has_unfinished_requests()
    return core, delivered


def test_each_choice_finishes_exactly_once_in_the_engines_outputs() -> None:
    @settings(max_examples=300, deadline=None)
    @given(requests=st.lists(calls, min_size=1, max_size=4),
           num_blocks=st.integers(12, 40))
    def run(requests: list[Call], num_blocks: int) -> None:
        RUNS["examples"] += 1
        core, delivered = run_calls(requests, num_blocks)
        preempted = core.statistics().num_preemptions > 0
        RUNS["preempted"] += preempted
        event("preempted" if preempted else "not preempted")
        for i, call in enumerate(requests):
            outputs = delivered[str(i)]
            note(f"{i}: {call} -> {outputs}")
            events = check_choice_events(call.kind, call.n, outputs)
            reasons = {sequence[-1].finish_reason for sequence in events.values()}
            event(f"finish reasons: {sorted(r or '' for r in reasons)}")
            RUNS["aborted"] += "abort" in reasons
            RUNS["stopped"] += "stop" in reasons
            if "abort" in reasons:
                assert call.abort_at_step is not None
            if call.kind is RequestOutputKind.DELTA:
                for sequence in events.values():
                    tokens = [t for completion in sequence for t in completion.token_ids]
                    assert len(tokens) <= call.max_tokens
                    if sequence[-1].finish_reason == "length":
                        assert len(tokens) == call.max_tokens

    run()
    # The scenarios the property is about were generated, not only the easy ones.
    assert RUNS["examples"] >= 300
    assert min(RUNS["preempted"], RUNS["aborted"], RUNS["stopped"]) > 0, RUNS


# -- over HTTP -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(max_model_len=128, max_num_seqs=16, num_gpu_blocks_override=256,
                           disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(
        args, runner_factory=lambda: DivergingRunner(num_kv_blocks=256, vocab_size=VOCAB))
    with server_in_thread(engine, served_model_names=("m",)) as running:
        yield running
    assert not running.errors, running.errors


def sse_choices(response: httpx.Response) -> dict[int, list[str | None]]:
    """Each choice's finish_reason per event, in order."""
    events: dict[int, list[str | None]] = defaultdict(list)
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):]).get("choices", []):
            events[choice["index"]].append(choice.get("finish_reason"))
    return events


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stop", [None, ["e", "a"]])
def test_a_streamed_choice_sends_its_finish_reason_once(server: ThreadedServer, route: str,
                                                        stop: list[str] | None) -> None:
    body: dict[str, Any] = {"model": "m", "n": 3, "stream": True,
                            "max_tokens": 8, "stop": stop}
    if route == "/v1/completions":
        body["prompt"] = "hello there"
    else:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(3):
            with client.stream("POST", route, json=body) as response:
                assert response.status_code == 200
                events = sse_choices(response)
            assert sorted(events) == [0, 1, 2]
            for reasons in events.values():
                # Deltas, then one finish, then nothing for that choice.
                assert reasons[-1] in ("stop", "length")
                assert all(reason is None for reason in reasons[:-1]), reasons


@pytest.mark.parametrize("stream", [False, True])
def test_generate_reports_every_choice_in_every_reply(server: ThreadedServer,
                                                      stream: bool) -> None:
    # /generate's texts are cumulative; its choices finish at different steps here.
    body = {"prompt": "hello there", "n": 3, "max_tokens": 8, "stop": ["e", "a"],
            "stream": stream}
    response = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200
    chunks = ([json.loads(c) for c in response.content.split(b"\0") if c] if stream
              else [response.json()])
    assert chunks and all(len(chunk["text"]) == 3 for chunk in chunks[1:])
    assert len(chunks[-1]["text"]) == 3
    assert all(text.startswith("hello there") for text in chunks[-1]["text"])
