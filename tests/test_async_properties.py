"""Generated scenarios against the async engine's contract (docs/concurrency.md).

Each example starts an engine over the fake runner, runs a generated set of requests
whose consumers finish normally, call ``abort()``, break out, have their scope
cancelled, or read slowly, at generated points, with an optional step failure; then
checks how every stream ended, the order and content of what it delivered, that
nothing was computed for a request after the step in flight when it left, and that
nothing is left over. Runs on trio and asyncio.
"""

from __future__ import annotations

from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from triollm import (
    AsyncEngineArgs,
    AsyncLLMEngine,
    EngineDeadError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from triollm.testing import FakeModelRunner, fake_next_token

VOCAB = 900  # below the demo config vocabulary (prompts are validated against it)
EXAMPLES = Counter[str]()


@dataclass(frozen=True)
class Scenario:
    prompt: list[int]
    max_tokens: int
    kind: RequestOutputKind
    action: str  # "finish", "abort", "break", "cancel", "slow"
    at: int  # after how many outputs the action happens (or checkpoints per read)
    start_delay: int  # checkpoints before the request is made


@dataclass
class Outcome:
    outputs: list[RequestOutput] = field(default_factory=list)
    error: BaseException | None = None
    left_at_step: int | None = None  # len(runner.computed) when the consumer left


scenarios = st.builds(
    Scenario,
    prompt=st.lists(st.integers(5, VOCAB - 1), min_size=1, max_size=12),
    max_tokens=st.integers(1, 12),
    kind=st.sampled_from([RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE]),
    action=st.sampled_from(["finish", "abort", "break", "cancel", "slow"]),
    at=st.integers(0, 6),
    start_delay=st.integers(0, 5),
)


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_next_token(tokens[-1], len(tokens) - 1, VOCAB))
    return tokens[len(prompt):]


def delivered_tokens(outcome: Outcome, kind: RequestOutputKind) -> list[int]:
    if not outcome.outputs:
        return []
    if kind is RequestOutputKind.DELTA:
        return [t for o in outcome.outputs for t in o.outputs[0].token_ids]
    return outcome.outputs[-1].outputs[0].token_ids


async def consume(engine: AsyncLLMEngine, runner: FakeModelRunner, request_id: str,
                  scenario: Scenario, outcome: Outcome) -> None:
    for _ in range(scenario.start_delay):
        await anyio.lowlevel.checkpoint()
    params = SamplingParams(max_tokens=scenario.max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=scenario.kind)
    stream = engine.generate({"prompt_token_ids": scenario.prompt}, params, request_id)
    try:
        with anyio.CancelScope() as scope:
            async with aclosing(stream):
                async for output in stream:
                    outcome.outputs.append(output)
                    count = len(outcome.outputs)
                    if scenario.action == "slow":
                        for _ in range(scenario.at):
                            await anyio.lowlevel.checkpoint()
                    elif (scenario.action != "finish" and count == scenario.at + 1
                          and not output.finished):
                        outcome.left_at_step = len(runner.computed)
                        if scenario.action == "abort":
                            await engine.abort(request_id)
                        elif scenario.action == "break":
                            break
                        elif scenario.action == "cancel":
                            scope.cancel()
                            await anyio.lowlevel.checkpoint()
    except EngineDeadError as error:
        outcome.error = error


async def run_scenarios(requests: list[Scenario], fail_at_step: int | None) -> None:
    runner = FakeModelRunner(num_kv_blocks=128, vocab_size=VOCAB, fail_at_step=fail_at_step)
    args = AsyncEngineArgs(max_model_len=64, max_num_batched_tokens=16, block_size=4,
                           max_num_seqs=4, disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner,
                                             stream_buffer_size=2)
    outcomes = [Outcome() for _ in requests]
    engine_error: BaseException | None = None
    try:
        async with engine, anyio.create_task_group() as consumers:
            for i, (scenario, outcome) in enumerate(zip(requests, outcomes, strict=True)):
                consumers.start_soon(consume, engine, runner, str(i), scenario, outcome)
    except RuntimeError as error:
        engine_error = error

    died = engine_error is not None
    assert died == engine.errored
    if died:
        assert fail_at_step is not None and "fake model failure" in str(engine_error)
    for i, (scenario, outcome) in enumerate(zip(requests, outcomes, strict=True)):
        note(f"{i}: {scenario} -> {len(outcome.outputs)} outputs, error={outcome.error!r}")
        tokens = delivered_tokens(outcome, scenario.kind)
        full = expected(scenario.prompt, scenario.max_tokens)
        # Order and content: whatever arrived is a prefix of the right answer, in order.
        assert tokens == full[: len(tokens)]
        if scenario.kind is RequestOutputKind.CUMULATIVE:
            lengths = [len(o.outputs[0].token_ids) for o in outcome.outputs]
            assert lengths == sorted(lengths)
        finals = [o for o in outcome.outputs if o.finished]
        assert len(finals) <= 1 and (not finals or finals[0] is outcome.outputs[-1])
        # Exactly one ending.
        if outcome.error is not None:
            assert died and not finals
            assert isinstance(outcome.error.__cause__, RuntimeError)
        elif finals:
            reason = finals[0].outputs[0].finish_reason
            if reason == "abort":
                assert scenario.action == "abort"
            else:
                assert reason == "length" and tokens == full
        else:
            assert scenario.action in ("break", "cancel") or died
        # Nothing computed for a request after the step in flight when it left.
        if outcome.left_at_step is not None and scenario.action != "slow":
            later = runner.computed[outcome.left_at_step + 1:]
            assert all(item.request_id != str(i) for out in later for item in out.scheduled)
    if not died:
        stats = engine.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks
    assert runner.shut_down


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@settings(max_examples=150, deadline=None)
@given(requests=st.lists(scenarios, min_size=1, max_size=8),
       fail_at_step=st.one_of(st.none(), st.none(), st.integers(0, 25)))
def test_every_stream_ends_exactly_one_way(backend: str, requests: list[Scenario],
                                           fail_at_step: int | None) -> None:
    EXAMPLES[backend] += 1
    anyio.run(run_scenarios, requests, fail_at_step, backend=backend)


def test_report_example_counts() -> None:
    print(f"async engine property examples run: {dict(EXAMPLES)}")
