"""Generated scenarios against the async engine's contract (docs/concurrency.md).

Each example starts an engine, runs a generated set of requests whose consumers finish
normally, call ``abort()``, break out, have their scope cancelled, or read slowly, with
an optional step failure; then checks how every stream ended, the order and content of
what it delivered, that nothing was computed for a request after the step in flight
when it left, and that nothing is left over.

* Interleavings by checkpoints, over the fake runner, on trio and asyncio.
* Timed scenarios (arrival times, aborts and cancellations at generated times, slow
  readers) over the fake runner: the bulk on trio with ``MockClock(autojump_threshold=0)``
  (virtual time, so hundreds of examples take seconds), a smaller run on asyncio in
  real time.
* A smaller timed run against a real tiny transformers model, on both backends.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from triollm import (
    AsyncEngineArgs,
    AsyncLLMEngine,
    EngineDeadError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from triollm.step import RunnerOutput, SchedulerOutput
from triollm.testing import FakeModelRunner, fake_completion

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
    started: bool = False


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
    return fake_completion(prompt, n, VOCAB)


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
                        if scenario.action == "abort":
                            outcome.left_at_step = len(runner.computed)
                            await engine.abort(request_id)
                        elif scenario.action == "break":
                            outcome.left_at_step = len(runner.computed)
                            break
                        elif scenario.action == "cancel":
                            scope.cancel()
                            await anyio.lowlevel.checkpoint()
        if scope.cancelled_caught:
            # The request is aborted when the cancellation closes the stream, which the
            # checkpoint above may let the step loop run ahead of.
            outcome.left_at_step = len(runner.computed)
    except EngineDeadError as error:
        outcome.error = error


def check_outcomes(requests: Sequence[Scenario | TimedScenario], outcomes: list[Outcome],
                   computed: list[SchedulerOutput], engine: AsyncLLMEngine,
                   engine_error: BaseException | None, fail_at_step: int | None,
                   right_answer: Callable[[Any], list[int]]) -> None:
    """The contract, checked for every request of one example."""
    died = engine_error is not None
    assert died == engine.errored
    if died:
        assert fail_at_step is not None and "fake model failure" in str(engine_error)
    for i, (scenario, outcome) in enumerate(zip(requests, outcomes, strict=True)):
        note(f"{i}: {scenario} -> {len(outcome.outputs)} outputs, error={outcome.error!r}")
        tokens = delivered_tokens(outcome, scenario.kind)
        full = right_answer(scenario)
        # Order and content: whatever arrived is a prefix of the right answer, in order.
        assert tokens == full[: len(tokens)]
        if scenario.kind is RequestOutputKind.CUMULATIVE:
            lengths = [len(o.outputs[0].token_ids) for o in outcome.outputs]
            assert lengths == sorted(lengths)
        finals = [o for o in outcome.outputs if o.finished]
        assert len(finals) <= 1 and (not finals or finals[0] is outcome.outputs[-1])
        # Exactly one ending.
        event("ending: " + ("engine died" if outcome.error is not None else
                            finals[0].outputs[0].finish_reason or "" if finals else
                            "consumer left" + (" before any output" if not outcome.outputs
                                               else "")))
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
        # Nothing computed for a request after the steps in flight when it left: the
        # one computing, and with asynchronous scheduling the one queued behind it.
        if outcome.left_at_step is not None:
            in_flight = 2 if engine.config.scheduler.async_scheduling else 1
            later = computed[outcome.left_at_step + in_flight:]
            # Engine ids are "<caller's id>-<n>".
            assert all(item.request_id.rsplit("-", 1)[0] != str(i)
                       for out in later for item in out.scheduled)
    if not died:
        stats = engine.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks


async def run_scenarios(requests: list[Scenario], fail_at_step: int | None,
                        async_scheduling: bool) -> None:
    runner = FakeModelRunner(num_kv_blocks=128, vocab_size=VOCAB, fail_at_step=fail_at_step)
    args = AsyncEngineArgs(max_model_len=64, max_num_batched_tokens=16, block_size=4,
                           max_num_seqs=4, disable_log_requests=True,
                           async_scheduling=async_scheduling)
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

    check_outcomes(requests, outcomes, runner.computed, engine, engine_error, fail_at_step,
                   lambda scenario: expected(scenario.prompt, scenario.max_tokens))
    assert runner.shut_down


def run_counting_examples(name: str, minimum: int, property_test: Callable[[], None]
                          ) -> None:
    """Run a hypothesis test (whose body counts itself in ``EXAMPLES[name]``) and check
    that it really ran ``minimum`` generated examples: a strategy that filters out
    everything, or settings that run none, would otherwise pass without testing."""
    before = EXAMPLES[name]
    property_test()
    ran = EXAMPLES[name] - before
    print(f"{name}: {ran} examples")
    assert ran >= minimum, f"{name}: only {ran} of {minimum} examples ran"


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_every_stream_ends_exactly_one_way(backend: str) -> None:
    @settings(max_examples=150, deadline=None)
    @given(requests=st.lists(scenarios, min_size=1, max_size=8),
           fail_at_step=st.one_of(st.none(), st.none(), st.integers(0, 25)),
           async_scheduling=st.booleans())
    def run(requests: list[Scenario], fail_at_step: int | None,
            async_scheduling: bool) -> None:
        EXAMPLES[f"checkpoints/{backend}"] += 1
        anyio.run(run_scenarios, requests, fail_at_step, async_scheduling, backend=backend)

    run_counting_examples(f"checkpoints/{backend}", 150, run)


# -- timed scenarios -------------------------------------------------------------------

@dataclass(frozen=True)
class TimedScenario:
    prompt: list[int]
    max_tokens: int
    kind: RequestOutputKind
    arrival: float  # seconds after the start when the request is made
    read_delay: float  # seconds the consumer takes over each output
    action: str  # "finish", "abort", "cancel" (at a time) or "break" (after outputs)
    action_at: float  # abort/cancel: seconds after the start; break: outputs read first


def timed_scenarios(prompts: st.SearchStrategy[list[int]]) -> st.SearchStrategy[TimedScenario]:
    return st.builds(
        TimedScenario,
        prompt=prompts,
        max_tokens=st.integers(1, 12),
        kind=st.sampled_from([RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE]),
        arrival=st.sampled_from([0.0, 0.001, 0.002, 0.005, 0.01, 0.02]),
        read_delay=st.sampled_from([0.0, 0.0, 0.001, 0.004]),
        action=st.sampled_from(["finish", "abort", "cancel", "break"]),
        # From before the request exists to after it has finished.
        action_at=st.sampled_from([0.0, 0.001, 0.003, 0.006, 0.01, 0.02, 0.05, 1.0]),
    )


async def consume_timed(engine: AsyncLLMEngine, computed: list[SchedulerOutput],
                        request_id: str, scenario: TimedScenario, outcome: Outcome,
                        scope: anyio.CancelScope) -> None:
    await anyio.sleep(scenario.arrival)
    params = SamplingParams(max_tokens=scenario.max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=scenario.kind, temperature=0)
    stream = engine.generate({"prompt_token_ids": scenario.prompt}, params, request_id)
    try:
        with scope:
            async with aclosing(stream):
                outcome.started = True  # the first __anext__ adds the request, unbroken
                async for output in stream:
                    outcome.outputs.append(output)
                    if (scenario.action == "break" and not output.finished
                            and len(outcome.outputs) >= scenario.action_at):
                        outcome.left_at_step = len(computed)
                        break
                    await anyio.sleep(scenario.read_delay)
        if scope.cancelled_caught:
            outcome.left_at_step = len(computed)
    except EngineDeadError as error:
        outcome.error = error


async def act_at(engine: AsyncLLMEngine, computed: list[SchedulerOutput], request_id: str,
                 scenario: TimedScenario, outcome: Outcome, scope: anyio.CancelScope) -> None:
    await anyio.sleep(scenario.action_at)
    in_flight = outcome.started and not any(o.finished for o in outcome.outputs)
    if scenario.action == "cancel":
        scope.cancel()
    elif scenario.action == "abort" and not engine.errored:
        if in_flight:
            outcome.left_at_step = len(computed)
        await engine.abort(request_id)


async def run_timed_scenarios(requests: list[TimedScenario], fail_at_step: int | None,
                              make_runner: Callable[[], RecordingRunner],
                              engine_args: AsyncEngineArgs,
                              right_answer: Callable[[Any], list[int]]) -> None:
    runner: RecordingRunner | None = None

    def factory() -> RecordingRunner:
        nonlocal runner
        runner = make_runner()
        return runner

    engine = AsyncLLMEngine.from_engine_args(engine_args, runner_factory=factory,
                                             stream_buffer_size=2)
    outcomes = [Outcome() for _ in requests]
    engine_error: BaseException | None = None
    try:
        async with engine, anyio.create_task_group() as tasks:
            assert runner is not None
            for i, (scenario, outcome) in enumerate(zip(requests, outcomes, strict=True)):
                scope = anyio.CancelScope()
                tasks.start_soon(consume_timed, engine, runner.computed, str(i), scenario,
                                 outcome, scope)
                if scenario.action in ("abort", "cancel"):
                    tasks.start_soon(act_at, engine, runner.computed, str(i), scenario,
                                     outcome, scope)
    except RuntimeError as error:
        engine_error = error
    assert runner is not None and runner.shut_down
    check_outcomes(requests, outcomes, runner.computed, engine, engine_error, fail_at_step,
                   right_answer)


class RecordingRunner:
    """Wraps a runner: records every step it computed, can fail at a given step."""

    def __init__(self, inner: Any, fail_at_step: int | None = None) -> None:
        self.inner = inner
        self.num_kv_blocks: int = inner.num_kv_blocks
        self.fail_at_step = fail_at_step
        self.computed: list[SchedulerOutput] = []
        self.shut_down = False

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if len(self.computed) == self.fail_at_step:
            raise RuntimeError(f"fake model failure at step {self.fail_at_step}")
        result = self.inner.execute_model(scheduler_output)
        self.computed.append(scheduler_output)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()
        self.shut_down = True


FAKE_ARGS = AsyncEngineArgs(max_model_len=64, max_num_batched_tokens=16, block_size=4,
                            max_num_seqs=4, disable_log_requests=True)


def run_fake_timed(backend: str, requests: list[TimedScenario],
                   fail_at_step: int | None, async_scheduling: bool) -> None:
    def make_runner() -> RecordingRunner:
        return RecordingRunner(FakeModelRunner(num_kv_blocks=128, vocab_size=VOCAB),
                               fail_at_step)

    options = {"clock": MockClock(autojump_threshold=0)} if backend == "trio" else {}
    args = dataclasses.replace(FAKE_ARGS, async_scheduling=async_scheduling)
    anyio.run(run_timed_scenarios, requests, fail_at_step, make_runner, args,
              lambda scenario: expected(scenario.prompt, scenario.max_tokens),
              backend=backend, backend_options=options)


FAKE_PROMPTS = st.lists(st.integers(5, VOCAB - 1), min_size=1, max_size=12)
TIMED = {"requests": st.lists(timed_scenarios(FAKE_PROMPTS), min_size=1, max_size=10),
         "fail_at_step": st.one_of(st.none(), st.none(), st.integers(0, 12)),
         "async_scheduling": st.booleans()}


@pytest.mark.parametrize(("backend", "examples"), [("trio", 300), ("asyncio", 40)])
def test_timed_scenarios(backend: str, examples: int) -> None:
    """On trio with ``MockClock(autojump_threshold=0)`` (virtual time, so hundreds of
    examples take seconds); on asyncio in real time, fewer."""
    @settings(max_examples=examples, deadline=None)
    @given(**TIMED)
    def run(requests: list[TimedScenario], fail_at_step: int | None,
            async_scheduling: bool) -> None:
        EXAMPLES[f"timed/{backend}"] += 1
        run_fake_timed(backend, requests, fail_at_step, async_scheduling)

    run_counting_examples(f"timed/{backend}", examples, run)


# -- the same against a real tiny model ------------------------------------------------

REAL_PROMPTS = [[5, 17, 29], [40, 41, 42, 43, 44, 45, 46], [300], [99, 7, 250, 11, 60],
                [123, 124], [400, 3, 88, 19, 201, 202, 203, 204, 205]]
REAL_MAX_TOKENS = 12


@pytest.fixture(scope="module")
def real_model(llama_path: Path, llama_llm: Any
               ) -> tuple[Path, dict[tuple[int, ...], list[int]]]:
    """The tiny Llama, and each prompt's greedy continuation computed alone."""
    llm = llama_llm
    params = SamplingParams(temperature=0, max_tokens=REAL_MAX_TOKENS, ignore_eos=True)
    answers = {}
    for prompt in REAL_PROMPTS:
        [output] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        answers[tuple(prompt)] = list(output.outputs[0].token_ids)
    return llama_path, answers


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_timed_scenarios_against_a_real_model(
        backend: str, real_model: tuple[Path, dict[tuple[int, ...], list[int]]]) -> None:
    from triollm.model.runners.torch_runner import TorchModelRunner

    path, answers = real_model
    sync_args = AsyncEngineArgs(model=str(path), dtype="float32", max_model_len=64,
                                max_num_batched_tokens=16, block_size=4, max_num_seqs=4,
                                num_gpu_blocks_override=64, disable_log_requests=True,
                                async_scheduling=False)
    config = sync_args.create_engine_config()

    @settings(max_examples=12, deadline=None)
    @given(requests=st.lists(timed_scenarios(st.sampled_from(REAL_PROMPTS)),
                             min_size=1, max_size=6),
           fail_at_step=st.one_of(st.none(), st.none(), st.integers(0, 20)),
           async_scheduling=st.booleans())
    def run(requests: list[TimedScenario], fail_at_step: int | None,
            async_scheduling: bool) -> None:
        EXAMPLES[f"real-model/{backend}"] += 1
        args = dataclasses.replace(sync_args, async_scheduling=async_scheduling)
        requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, REAL_MAX_TOKENS))
                    for r in requests]
        options = {"clock": MockClock(autojump_threshold=0)} if backend == "trio" else {}
        anyio.run(run_timed_scenarios, requests, fail_at_step,
                  lambda: RecordingRunner(TorchModelRunner(config), fail_at_step), args,
                  lambda scenario: answers[tuple(scenario.prompt)][: scenario.max_tokens],
                  backend=backend, backend_options=options)

    run_counting_examples(f"real-model/{backend}", 12, run)
