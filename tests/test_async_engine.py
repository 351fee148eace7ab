"""The async engine's contract (docs/concurrency.md), on trio and asyncio."""

from __future__ import annotations

import itertools
import threading
from contextlib import aclosing
from typing import Any

import anyio
import pytest

from triollm import (
    AsyncEngineArgs,
    AsyncLLMEngine,
    EngineClosedError,
    EngineDeadError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from triollm.engine import worker as worker_module
from triollm.engine.worker import open_model_worker
from triollm.model.loader import build_demo_tokenizer
from triollm.testing import FakeModelRunner, fake_completion

pytestmark = pytest.mark.anyio

VOCAB = 1000


def make_engine(runner: FakeModelRunner | None = None, **kwargs: Any) -> tuple[
        AsyncLLMEngine, FakeModelRunner]:
    runner = runner or FakeModelRunner(num_kv_blocks=256, vocab_size=VOCAB)
    args = AsyncEngineArgs(max_model_len=128, max_num_batched_tokens=64, block_size=4,
                           disable_log_requests=True, **kwargs)
    return AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner), runner


def params(max_tokens: int = 8, kind: RequestOutputKind = RequestOutputKind.DELTA,
           **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=kind, **kwargs)


def expected(prompt: list[int], n: int) -> list[int]:
    return fake_completion(prompt, n, VOCAB)


def assert_idle(engine: AsyncLLMEngine) -> None:
    stats = engine.statistics()
    assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


async def collect(engine: AsyncLLMEngine, prompt: list[int], request_id: str,
                  sampling: SamplingParams) -> list[RequestOutput]:
    return [o async for o in engine.generate({"prompt_token_ids": prompt}, sampling, request_id)]


async def test_delta_outputs_arrive_in_order_and_concatenate() -> None:
    engine, _ = make_engine()
    async with engine:
        outputs = await collect(engine, [5, 6, 7], "a", params(10))
    tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    assert tokens == expected([5, 6, 7], 10)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].outputs[0].finish_reason == "length"


async def test_cumulative_outputs_extend_each_other() -> None:
    engine, _ = make_engine()
    async with engine:
        outputs = await collect(engine, [9, 9], "a", params(6, RequestOutputKind.CUMULATIVE))
    for before, after in itertools.pairwise(outputs):
        old, new = before.outputs[0].token_ids, after.outputs[0].token_ids
        assert new[: len(old)] == old and len(new) > len(old)
    assert outputs[-1].outputs[0].token_ids == expected([9, 9], 6)


async def test_model_runs_in_one_dedicated_thread() -> None:
    engine, runner = make_engine()
    async with engine:
        model_thread = engine.worker_thread_id
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(collect, engine, [i + 3] * 4, str(i), params(6))
    assert runner.thread_ids == {model_thread}
    assert threading.get_ident() not in runner.thread_ids
    assert runner.shut_down


async def test_abort_ends_the_stream_with_an_abort_output_and_frees_blocks() -> None:
    engine, _ = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.002))
    async with engine:
        seen: list[RequestOutput] = []
        async for output in engine.generate({"prompt_token_ids": [4] * 9}, params(100), "x"):
            seen.append(output)
            if len(seen) == 3:
                await engine.abort("x")
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        await engine.abort("x")  # finished: a no-op
        await engine.abort("never-existed")
        assert_idle(engine)


async def test_breaking_out_of_the_loop_aborts_the_request() -> None:
    engine, runner = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.002))
    async with engine:
        async with aclosing(engine.generate({"prompt_token_ids": [3] * 5}, params(100),
                                            "b")) as stream:
            async for _ in stream:
                break
        assert_idle(engine)
        computed_at_abort = len(runner.computed)
        await collect(engine, [7] * 3, "other", params(5))
        # At most the step already in flight when it was aborted still held it.
        later = runner.computed[computed_at_abort + 1:]
        assert later and all(item.request_id != "b" for out in later
                             for item in out.scheduled)


async def test_cancelling_the_consumer_aborts_the_request() -> None:
    engine, _ = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.002))
    async with engine:
        with anyio.move_on_after(0.02):
            await collect(engine, [3] * 5, "c", params(10_000))
        assert_idle(engine)


async def test_duplicate_request_id_is_refused_and_the_first_is_undisturbed() -> None:
    engine, _ = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.001))
    async with engine:
        first = engine.generate({"prompt_token_ids": [5, 5]}, params(6), "dup")
        got = [await first.__anext__()]
        with pytest.raises(ValueError, match="request_id"):
            await collect(engine, [7], "dup", params(2))
        got += [o async for o in first]
        assert [t for o in got for t in o.outputs[0].token_ids] == expected([5, 5], 6)


async def test_bad_input_raises_value_error_and_the_engine_keeps_serving() -> None:
    engine, _ = make_engine()
    async with engine:
        with pytest.raises(ValueError, match="prompt"):
            await collect(engine, [], "empty", params(2))
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await collect(engine, [10**9], "huge", params(2))
        assert (await collect(engine, [5], "ok", params(2)))[-1].finished
        assert_idle(engine)


async def test_step_failure_fails_every_stream_then_leaves_the_task_group() -> None:
    runner = FakeModelRunner(256, VOCAB, fail_at_step=4, step_delay=0.001)
    engine, _ = make_engine(runner=runner)
    errors: dict[str, BaseException] = {}

    async def consume(request_id: str) -> None:
        try:
            await collect(engine, [11, 12], request_id, params(50))
        except EngineDeadError as error:
            errors[request_id] = error

    with pytest.raises(BaseExceptionGroup) as raised:
        async with anyio.create_task_group() as outer:
            await outer.start(engine.run)
            async with anyio.create_task_group() as consumers:
                for i in range(4):
                    consumers.start_soon(consume, str(i))
    # The caller's task group holds exactly the step's own exception, not a wrapper.
    (original,) = raised.value.exceptions
    assert type(original) is RuntimeError and "fake model failure" in str(original)
    assert sorted(errors) == ["0", "1", "2", "3"]
    assert all(isinstance(e.__cause__, RuntimeError) for e in errors.values())
    assert engine.errored and isinstance(engine.dead_error, EngineDeadError)
    with pytest.raises(EngineDeadError):
        await collect(engine, [1], "late", params(2))
    with pytest.raises(EngineDeadError):
        await engine.check_health()


async def test_async_with_surfaces_the_original_exception() -> None:
    engine, _ = make_engine(runner=FakeModelRunner(256, VOCAB, fail_at_step=0))
    with pytest.raises(RuntimeError, match="fake model failure"):
        async with engine:
            with pytest.raises(EngineDeadError):
                await collect(engine, [1, 2], "a", params(3))
            await anyio.sleep_forever()


async def test_shutdown_ends_open_streams_with_engine_closed_error() -> None:
    engine, runner = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.002))
    results: list[BaseException] = []
    streaming = anyio.Event()

    async def consume() -> None:
        try:
            async for _ in engine.generate({"prompt_token_ids": [2, 3]}, params(100), "s"):
                streaming.set()
        except EngineClosedError as error:
            results.append(error)

    async with anyio.create_task_group() as consumers:
        async with engine:
            consumers.start_soon(consume)
            await streaming.wait()
    assert len(results) == 1
    assert runner.shut_down and not engine.is_running
    with pytest.raises(EngineClosedError):
        await collect(engine, [1], "after", params(2))


async def test_a_slow_consumer_slows_nobody_and_its_deltas_are_merged() -> None:
    engine, _runner = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.001))
    fast_done = anyio.Event()
    slow_outputs: list[RequestOutput] = []

    async def fast() -> None:
        await collect(engine, [8, 8], "fast", params(60))
        fast_done.set()

    async def slow() -> None:
        async for output in engine.generate({"prompt_token_ids": [9, 9]}, params(60), "slow"):
            slow_outputs.append(output)
            if not fast_done.is_set():
                await fast_done.wait()

    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(slow)
        tg.start_soon(fast)
    tokens = [t for o in slow_outputs for t in o.outputs[0].token_ids]
    assert tokens == expected([9, 9], 60)
    assert len(slow_outputs) < 60, "lagging deltas are merged, not queued one per step"


async def test_idle_engine_waits_without_stepping() -> None:
    engine, runner = make_engine()
    async with engine:
        await anyio.wait_all_tasks_blocked()
        assert runner.num_steps == 0 and engine.statistics().num_steps == 0
        await collect(engine, [4], "wake", params(2))
        assert runner.num_steps >= 2


async def test_run_in_a_task_group_the_caller_owns() -> None:
    engine, runner = make_engine()
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        assert engine.is_running
        await engine.check_health()
        assert (await collect(engine, [5, 6], "own", params(3)))[-1].finished
        tg.cancel_scope.cancel()
    assert not engine.is_running and runner.shut_down
    with pytest.raises(RuntimeError, match="already been started"):
        await engine.run()


async def test_cancelling_the_engine_stops_it_between_back_to_back_steps() -> None:
    # Busy, the step loop only waits on the model thread (shielded), so this checks it
    # still notices the cancellation between steps. The consumer lives outside the
    # cancelled scope, so its request keeps the engine busy until then.
    engine, runner = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.001))
    first_output = anyio.Event()

    async def consume() -> None:
        with pytest.raises(EngineClosedError):
            async for _ in engine.generate({"prompt_token_ids": [3, 4]}, params(120), "r"):
                first_output.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as outer:
            async with anyio.create_task_group() as engine_group:
                await engine_group.start(engine.run)
                outer.start_soon(consume)
                await first_output.wait()
                engine_group.cancel_scope.cancel()
    assert runner.shut_down and not engine.is_running
    assert runner.num_steps < 100


async def test_an_idle_model_thread_takes_a_job_before_the_loop_runs_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The hand-off releases the GIL to the model thread; with a long bound the
    # submitting task resumes the loop only once the thread has the job.
    monkeypatch.setattr(worker_module, "HANDOFF_SECONDS", 10.0)
    started = threading.Event()
    release = threading.Event()
    released_in_time: list[bool] = []

    def job() -> None:
        started.set()
        # Half the hand-off bound: a loop that blocked for the bound on the second job
        # below would leave this wait to give up before it released the thread.
        released_in_time.append(release.wait(worker_module.HANDOFF_SECONDS / 2))

    async with open_model_worker() as worker, anyio.create_task_group() as tg:
        tg.start_soon(worker.run_sync, job)
        await anyio.wait_all_tasks_blocked()  # the task has submitted and is waiting
        assert started.is_set()
        # The thread is busy now: a second job is queued without blocking the loop.
        tg.start_soon(worker.run_sync, lambda: None)
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert released_in_time == [True]


async def test_event_loop_stays_responsive_while_the_model_computes() -> None:
    # Each step waits in the model thread until the event loop has ticked several times
    # since it began: a step that blocked the loop would wait in vain, and give up.
    ticks = 0
    ticked = threading.Condition()
    waited: list[bool] = []

    class TickWaitingRunner(FakeModelRunner):
        def execute_model(self, scheduler_output: Any) -> Any:
            if scheduler_output.is_empty:  # only drops finished requests' state
                return super().execute_model(scheduler_output)
            with ticked:
                target = ticks + 5
                waited.append(ticked.wait_for(lambda: ticks >= target, timeout=10))
            return super().execute_model(scheduler_output)

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.001)
            with ticked:
                ticks += 1
                ticked.notify_all()

    engine, _ = make_engine(runner=TickWaitingRunner(256, VOCAB))
    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await collect(engine, [3], "long", params(2))
        tg.cancel_scope.cancel()
    assert len(waited) >= 2 and all(waited)


async def test_statistics_report_running_waiting_and_blocks() -> None:
    engine, _ = make_engine(runner=FakeModelRunner(256, VOCAB, step_delay=0.001),
                            max_num_seqs=2)
    first_output = anyio.Event()

    async def consume(i: int) -> None:
        async for _ in engine.generate({"prompt_token_ids": [i + 2] * 8}, params(20), str(i)):
            first_output.set()

    async with engine, anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(consume, i)
        # All four were added before the first step ended; two run (max_num_seqs=2) for
        # 20 steps while the other two wait behind them.
        await first_output.wait()
        stats = engine.statistics()
        assert stats.num_running == 2 and stats.num_waiting == 2
        assert stats.num_free_blocks < stats.num_total_blocks
        await engine.do_log_stats()
    assert_idle(engine)


async def test_real_tiny_model_streams_through_the_async_engine(llama_path: Any,
                                                                 llama_llm: Any) -> None:
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=128,
                           num_gpu_blocks_override=64, disable_log_requests=True)
    async with AsyncLLMEngine.from_engine_args(args) as engine:
        texts: dict[str, str] = {}

        async def run(i: int) -> None:
            sampling = SamplingParams(temperature=0, max_tokens=12,
                                      output_kind=RequestOutputKind.DELTA)
            text = ""
            async for output in engine.generate(f"Rain fell on day {i}", sampling, str(i)):
                text += output.outputs[0].text
            texts[str(i)] = text

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i)
        assert_idle(engine)
    offline = llama_llm.generate([f"Rain fell on day {i}" for i in range(4)],
                           SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [texts[str(i)] for i in range(4)] == [o.outputs[0].text for o in offline]


def test_demo_tokenizer_is_shared() -> None:
    assert build_demo_tokenizer() is build_demo_tokenizer()


class CountingLogger:
    def __init__(self) -> None:
        self.steps = 0

    def record(self, stats: Any) -> None:
        self.steps += 1


class BrokenLogger:
    def record(self, stats: Any) -> None:
        raise RuntimeError("a logger bug")


async def test_stat_loggers_in_vllms_forms_and_a_broken_one_costs_only_itself() -> None:
    by_name = CountingLogger()
    made: list[CountingLogger] = []

    def factory(config: Any, engine_index: int) -> CountingLogger:
        assert engine_index == 0 and config.model.max_model_len == 128
        made.append(CountingLogger())
        return made[-1]

    runner = FakeModelRunner(num_kv_blocks=256, vocab_size=VOCAB)
    args = AsyncEngineArgs(max_model_len=128, max_num_batched_tokens=64, block_size=4)
    engine = AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner,
                                             stat_loggers={"mine": by_name})
    engine.add_stat_logger(BrokenLogger())
    engine.add_stat_logger(factory)  # type: ignore[arg-type]
    async with engine:
        outputs = await collect(engine, [5, 6, 7], "a", params(4))
        assert outputs[-1].finished
    assert by_name.steps > 0 and made and made[0].steps == by_name.steps
    with pytest.raises(ValueError, match=r"stat_loggers: .* has no record"):
        AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner,
                                        stat_loggers=[object()])


async def test_vllms_introspection_and_default_params() -> None:
    engine, _ = make_engine()
    async with engine:
        assert await engine.get_lora_config() is None
        assert await engine.is_tracing_enabled() is False
        assert (await engine.get_parallel_config()).world_size == 1
        assert await engine.get_decoding_config() is engine.config.structured_outputs
        assert engine.get_default_sampling_params() == SamplingParams()
        outputs = [o async for o in engine.generate({"prompt_token_ids": [1, 2, 3]}, None,
                                                    "defaults")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) <= 16


async def test_abort_takes_an_iterable_of_ids() -> None:
    engine, _ = make_engine()
    async with engine:
        streams = [engine.generate({"prompt_token_ids": [1, 2]}, params(100), f"r{i}")
                   for i in range(3)]
        firsts = [await anext(stream) for stream in streams]
        assert not any(first.finished for first in firsts)
        await engine.abort(f"r{i}" for i in range(3))
        for stream in streams:
            async with aclosing(stream):
                last = [o async for o in stream][-1]
            assert last.outputs[0].finish_reason == "abort"
        assert_idle(engine)


async def test_trace_headers_without_tracing_are_reported_once(
        caplog: pytest.LogCaptureFixture) -> None:
    engine, _ = make_engine()
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    async with engine:
        for request_id in ("t1", "t2"):
            outputs = [o async for o in engine.generate(
                {"prompt_token_ids": [1, 2]}, params(2), request_id, trace_headers=headers)]
            assert outputs[-1].finished
        assert not await engine.is_tracing_enabled()
    assert caplog.text.count("trace context but tracing is disabled") == 1
