"""Request identity under hostile ids: no client id reaches another client's request.

Generated scenarios against the async engine over the fake runner, on trio and asyncio:
ids from a small alphabet chosen to look like the engine's own (``a-0``, ``0_a``), the
same id reused while a request with it is in flight (refused) and after it ended or its
consumer left (served), ``n`` up to 3, sample and prompt logprobs, and a KV cache so
small that requests are preempted and recomputed. Every answer must be exactly its own
request's, prompt logprobs must cover each prompt position once, and nothing may be
left behind. The server's engine ids (``triollm.request_ids``) stay distinct whatever ids
clients choose.
"""

from __future__ import annotations

from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
import pytest
from hypothesis import example, given, settings, target
from hypothesis import strategies as st

from triollm import AsyncEngineArgs, AsyncLLMEngine, RequestOutput, SamplingParams
from triollm.request_ids import engine_request_id
from triollm.testing import FakeModelRunner, fake_completion, fake_logprob

VOCAB = 900
IDS = ["a", "a-0", "a-1", "0_a", "1_a", "b"]
RUNS = Counter[str]()


@dataclass(frozen=True)
class Call:
    request_id: str
    prompt: list[int]
    n: int
    max_tokens: int
    prompt_logprobs: bool
    logprobs: bool
    leave_after: int | None  # outputs read before the consumer leaves (None: to the end)
    start_delay: int  # checkpoints before the request is made


@dataclass
class Result:
    outputs: list[RequestOutput] = field(default_factory=list)
    refused: bool = False
    left: bool = False


calls = st.builds(
    Call,
    request_id=st.sampled_from(IDS),
    prompt=st.lists(st.integers(5, VOCAB - 1), min_size=2, max_size=12),
    n=st.integers(1, 3),
    max_tokens=st.integers(1, 8),
    prompt_logprobs=st.booleans(),
    logprobs=st.booleans(),
    leave_after=st.one_of(st.none(), st.none(), st.integers(0, 3)),
    start_delay=st.integers(0, 30),
)


async def consume(engine: AsyncLLMEngine, call: Call, result: Result) -> None:
    for _ in range(call.start_delay):
        await anyio.lowlevel.checkpoint()
    params = SamplingParams(n=call.n, max_tokens=call.max_tokens, ignore_eos=True,
                            detokenize=False, prompt_logprobs=0 if call.prompt_logprobs
                            else None, logprobs=0 if call.logprobs else None)
    stream = engine.generate({"prompt_token_ids": call.prompt}, params, call.request_id)
    try:
        async with aclosing(stream):
            async for output in stream:
                result.outputs.append(output)
                if call.leave_after is not None and len(result.outputs) > call.leave_after:
                    result.left = not output.finished
                    break
    except ValueError as error:
        assert "already in flight" in str(error)
        result.refused = True


def check(call: Call, result: Result) -> None:
    if result.refused:
        assert not result.outputs
        return
    assert all(o.request_id == call.request_id for o in result.outputs)
    if not result.outputs:
        return
    final = result.outputs[-1]
    # CUMULATIVE: each output carries the samples that changed, each one all of it so far.
    latest = {c.index: c for output in result.outputs for c in output.outputs}
    right = fake_completion(call.prompt, call.max_tokens, VOCAB)
    if not result.left:
        assert sorted(latest) == list(range(call.n))
    for completion in latest.values():
        tokens = completion.token_ids
        assert tokens == right[: len(tokens)]
        if not result.left:
            assert final.finished and tokens == right
        if call.logprobs:
            assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
            for k, (token, position) in enumerate(zip(tokens, completion.logprobs,
                                                      strict=True)):
                assert position[token].logprob == fake_logprob(len(call.prompt) + k)
    if call.prompt_logprobs and final.finished:
        # Each prompt position exactly once, however often the request was preempted.
        prompt_lps = final.prompt_logprobs
        assert prompt_lps is not None and len(prompt_lps) == len(call.prompt)
        assert prompt_lps[0] is None
        for position in range(1, len(call.prompt)):
            entry = prompt_lps[position]
            assert entry is not None
            assert entry[call.prompt[position]].logprob == fake_logprob(position)


async def run_calls(scenario: list[Call]) -> None:
    runner = FakeModelRunner(num_kv_blocks=12, vocab_size=VOCAB)
    args = AsyncEngineArgs(max_model_len=32, max_num_batched_tokens=16, block_size=4,
                           max_num_seqs=4, num_gpu_blocks_override=12,
                           disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner,
                                             stream_buffer_size=1)
    results = [Result() for _ in scenario]
    async with engine, anyio.create_task_group() as consumers:
        for call, result in zip(scenario, results, strict=True):
            consumers.start_soon(consume, engine, call, result)
    assert not engine.errored
    for call, result in zip(scenario, results, strict=True):
        check(call, result)
    stats = engine.statistics()
    assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    RUNS["preemptions"] += stats.num_preemptions
    # Steer generation toward scenarios that preempt: whether one does depends on how
    # many requests overlap, which random scenarios reach only now and then.
    target(float(stats.num_preemptions), label="preemptions")
    RUNS["refused"] += sum(r.refused for r in results)
    RUNS["served after a reuse"] += sum(
        1 for i, (call, result) in enumerate(zip(scenario, results, strict=True))
        if not result.refused and any(c.request_id == call.request_id for c in scenario[:i]))


# Four long requests of two sequences each, all made at once: far more KV than the cache
# holds, so some are preempted and recomputed in every run, however the draws fall.
OVERLAPPING = [
    Call(request_id=request_id, prompt=list(range(10 + 12 * k, 22 + 12 * k)), n=2,
         max_tokens=8, prompt_logprobs=k % 2 == 0, logprobs=k < 2, leave_after=None,
         start_delay=0)
    for k, request_id in enumerate(["a", "a-0", "0_a", "b"])
]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_no_client_id_reaches_another_request(backend: str) -> None:
    before = RUNS.copy()

    @settings(max_examples=100, deadline=None)
    @given(scenario=st.lists(calls, min_size=1, max_size=8))
    @example(scenario=OVERLAPPING)
    def run(scenario: list[Call]) -> None:
        RUNS["examples"] += 1
        anyio.run(run_calls, scenario, backend=backend)

    run()
    ran = RUNS - before
    print(f"{backend}: {dict(ran)}")
    # The examples did exercise what they are about.
    assert ran["examples"] >= 100
    assert ran["preemptions"] > 0 and ran["refused"] > 0 and ran["served after a reuse"] > 0


@given(st.lists(st.sampled_from([*IDS, "a-0-1", "", "-", "a-"]), min_size=2, max_size=40))
def test_engine_ids_never_repeat_whatever_ids_clients_choose(client_ids: list[str]) -> None:
    """Clients may send ids that look like the engine's own (``a`` and ``a-0``); the
    engine ids made of them are still all distinct."""
    engine_ids = [engine_request_id(request_id) for request_id in client_ids]
    assert len(set(engine_ids)) == len(engine_ids)
    assert all(e.startswith(f"{c}-") for c, e in zip(client_ids, engine_ids, strict=True))
