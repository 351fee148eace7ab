"""A failure that belongs to one request fails that request alone, with a clear error;
the engine and every other request carry on. Only a failed batch forward is fatal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from triollm import (
    LLM,
    AsyncEngineArgs,
    AsyncLLMEngine,
    RequestFailedError,
    RequestOutputKind,
    SamplingParams,
)
from triollm.engine.stats import IterationStats
from triollm.model.loader import build_demo_tokenizer
from triollm.model.runners import torch_runner
from triollm.testing import FakeModelRunner, fake_completion

VOCAB = 900


def params(max_tokens: int = 12, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                          output_kind=RequestOutputKind.DELTA, **kwargs)


async def run_two(engine: AsyncLLMEngine, bad: dict[str, Any], good: dict[str, Any],
                  bad_params: SamplingParams, good_params: SamplingParams
                  ) -> tuple[BaseException | None, list[int]]:
    """A request expected to fail and one expected to finish, side by side."""
    failure: BaseException | None = None
    tokens: list[int] = []

    async def failing() -> None:
        nonlocal failure
        try:
            async for _ in engine.generate(bad, bad_params, "bad"):
                pass
        except RequestFailedError as error:
            failure = error

    async def finishing() -> None:
        async for output in engine.generate(good, good_params, "good"):
            tokens.extend(output.outputs[0].token_ids)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(failing)
        tasks.start_soon(finishing)
    return failure, tokens


def assert_idle_and_alive(engine: AsyncLLMEngine) -> None:
    stats = engine.statistics()
    assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.is_running and not engine.errored


@pytest.mark.anyio
async def test_a_runner_failure_of_one_request_fails_it_alone() -> None:
    runner = FakeModelRunner(256, VOCAB, fail_request_when=lambda item: (
        item.request_id.startswith("bad-") and item.start_position >= 6))
    args = AsyncEngineArgs(max_model_len=64, num_gpu_blocks_override=256,
                           disable_log_requests=True)
    reasons: list[str] = []

    class FinishReasons:
        def record(self, stats: IterationStats) -> None:
            reasons.extend(finished.finish_reason for finished in stats.finished)

    async with AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner,
                                               stat_loggers=[FinishReasons()]) as engine:
        failure, tokens = await run_two(
            engine, {"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]},
            params(detokenize=False), params(detokenize=False))
        assert isinstance(failure, RequestFailedError) and "'bad' failed" in str(failure)
        assert tokens == fake_completion([8, 9], 12, VOCAB)
        assert_idle_and_alive(engine)
        # Counted as vLLM counts them: the failed request under "error", not "abort".
        assert sorted(reasons) == ["error", "length"]
        again = [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]},
                                                  params(3, detokenize=False), "later")]
        assert again[-1].finished


class BreaksOnOneToken:
    """The demo tokenizer, except that decoding ``token`` raises."""

    def __init__(self, token: int) -> None:
        self.inner = build_demo_tokenizer()
        self.token = token

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        if self.token in token_ids:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "a broken token")
        return str(self.inner.decode(token_ids, **kwargs))


@pytest.mark.anyio
async def test_a_detokenization_failure_fails_its_request_alone() -> None:
    bad_prompt, good_prompt = [5, 6, 7], [8, 9]
    poison = fake_completion(bad_prompt, 12, VOCAB)[4]
    assert poison not in fake_completion(good_prompt, 12, VOCAB) + good_prompt
    args = AsyncEngineArgs(max_model_len=64, num_gpu_blocks_override=256,
                           disable_log_requests=True)
    config = args.create_engine_config()
    engine = AsyncLLMEngine(config, BreaksOnOneToken(poison),  # type: ignore[arg-type]
                            lambda: FakeModelRunner(256, VOCAB), log_requests=False)
    async with engine:
        failure, tokens = await run_two(
            engine, {"prompt_token_ids": bad_prompt}, {"prompt_token_ids": good_prompt},
            params(), params())
        assert isinstance(failure, RequestFailedError) and "a broken token" in str(failure)
        assert tokens == fake_completion(good_prompt, 12, VOCAB)
        assert_idle_and_alive(engine)


@pytest.fixture
def sampling_breaks_on_seed_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch runner's sampler raises for any batch holding a row with seed 13 that
    has sampled two tokens already (so a stream of it has started)."""
    real_sample = torch_runner.sample

    def sample(logits: Any, rows: list[Any], generator: Any, grammar_mask: Any = None) -> Any:
        if any(row.params.seed == 13 and len(row.output_token_ids) >= 2 for row in rows):
            raise RuntimeError("sampling broke on seed 13")
        return real_sample(logits, rows, generator, grammar_mask)

    monkeypatch.setattr(torch_runner, "sample", sample)


@pytest.mark.usefixtures("sampling_breaks_on_seed_13")
def test_a_sampling_failure_fails_its_request_alone_in_the_torch_runner(
        llama_llm: LLM) -> None:
    """Batched sampling that raises is retried row by row; only the row that breaks
    fails. ``LLM.generate`` raises for it; the engine carries on."""
    core = llama_llm.engine
    core.add_request("bad", "one two three", SamplingParams(max_tokens=5, seed=13))
    core.add_request("good", "four five six", SamplingParams(max_tokens=5, temperature=0))
    finals = {}
    failures = []
    while core.has_unfinished_requests():
        finals.update({o.request_id: o for o in core.step() if o.finished})
        failures += core.take_failures()
    assert [f.request_id for f in failures] == ["bad"]
    assert "sampling broke on seed 13" in failures[0].error
    assert list(finals) == ["good"] and len(finals["good"].outputs[0].token_ids) == 5
    with pytest.raises(RequestFailedError, match="sampling broke on seed 13"):
        llama_llm.generate(["fine", "broken"], [SamplingParams(max_tokens=3),
                                                SamplingParams(max_tokens=3, seed=13)],
                           use_tqdm=False)
    assert not core.has_unfinished_requests()
    assert llama_llm.generate("fine", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


@pytest.mark.usefixtures("sampling_breaks_on_seed_13")
def test_a_failed_request_is_an_openai_500_and_other_clients_are_served(
        llama_path: Path) -> None:
    from server_helpers import server_in_thread

    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=128,
                           num_gpu_blocks_override=64, disable_log_requests=True)
    with server_in_thread(AsyncLLMEngine.from_engine_args(args)) as server:
        url = server.url + "/v1/completions"
        body = {"prompt": "hello", "max_tokens": 4}
        plain = httpx.post(url, json={**body, "seed": 13})
        assert plain.status_code == 500
        assert plain.json()["error"]["type"] == "RequestFailedError"
        with httpx.stream("POST", url, json={**body, "seed": 13, "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert '"RequestFailedError"' in events[-2] and events[-1] == "data: [DONE]"
        assert httpx.post(url, json=body).status_code == 200
        assert server.handle.engine.is_running
