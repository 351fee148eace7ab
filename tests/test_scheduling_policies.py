"""Scheduling policies: priority preemption and SLO-aware co-serving.

The co-serving tests run the engine core over a fake model runner whose step time is a
known formula of what the step computes, on a simulated clock, so the SLO outcome is
deterministic and the test takes no wall time to speak of.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given
from hypothesis import strategies as st

from triollm import AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams
from triollm.engine.core import EngineCore
from triollm.engine.step_time import StepShape, StepTimeModel, attention_pairs
from triollm.outputs import RequestOutput
from triollm.step import RunnerOutput, SchedulerOutput
from triollm.testing import FakeModelRunner, fake_completion

VOCAB = 900  # within the demo model's vocabulary
MAX_MODEL_LEN = 1024


# -- the step-time model --------------------------------------------------------------


@given(
    constant=st.floats(0.0, 0.02),
    per_token=st.floats(0.0, 1e-3),
    per_sequence=st.floats(0.0, 1e-3),
    per_pair=st.floats(0.0, 1e-7),
    seed=st.integers(0, 2**16),
)
def test_step_time_model_recovers_a_linear_cost(constant: float, per_token: float,
                                                per_sequence: float, per_pair: float,
                                                seed: int) -> None:
    rng = random.Random(seed)
    model = StepTimeModel(forgetting=1.0)
    assert model.predict(StepShape(1, 1, 1)) is None
    for _ in range(40):
        sequences = rng.randint(1, 32)
        tokens = sequences + rng.choice([0, rng.randint(1, 2048)])
        attention = rng.randint(tokens, tokens * 1024)
        model.observe(StepShape(tokens, sequences, attention),
                      constant + per_token * tokens + per_sequence * sequences
                      + per_pair * attention)
    for shape in (StepShape(1, 1, 100), StepShape(64, 8, 20_000), StepShape(2048, 30, 10**6)):
        truth = (constant + per_token * shape.num_tokens + per_sequence * shape.num_sequences
                 + per_pair * shape.attention)
        predicted = model.predict(shape)
        assert predicted is not None
        assert predicted == pytest.approx(truth, rel=1e-3, abs=1e-6)


def test_step_time_model_never_predicts_less_for_more_work() -> None:
    model = StepTimeModel()
    # Noisy data that an unconstrained fit would explain with a negative coefficient.
    rng = random.Random(1)
    for _ in range(50):
        tokens = rng.randint(1, 512)
        model.observe(StepShape(tokens, 1, rng.randint(0, 10**6)),
                      0.01 + 1e-5 * tokens + rng.uniform(-0.005, 0.005))
    coefficients = model.coefficients()
    assert coefficients is not None and min(coefficients) >= 0.0


def test_attention_pairs_counts_causal_query_key_pairs() -> None:
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 3) == 1 + 2 + 3
    assert attention_pairs(10, 2) == 11 + 12


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)


# -- a simulated engine ---------------------------------------------------------------


class SimulatedClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def step_seconds(output: SchedulerOutput) -> float:
    """The fake model's cost: a fixed launch cost, per token, per sequence and per
    query-key pair (the shape of a real transformer step)."""
    attention = sum(attention_pairs(item.start_position, item.num_tokens)
                    for item in output.scheduled)
    return (0.004 + 2e-4 * output.num_batched_tokens + 4e-4 * len(output.scheduled)
            + 2e-8 * attention)


class TimedRunner(FakeModelRunner):
    """Advances the simulated clock by ``step_seconds`` of each step it computes."""

    def __init__(self, clock: SimulatedClock, **kwargs: Any) -> None:
        super().__init__(vocab_size=VOCAB, **kwargs)
        self.clock = clock

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.clock.now += step_seconds(scheduler_output)
        return super().execute_model(scheduler_output)


def make_core(policy: str, *, max_num_seqs: int = 64, num_blocks: int = 4096,
              budget: int = 2048) -> tuple[EngineCore, SimulatedClock]:
    args = EngineArgs(model="triollm/tiny-demo", max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                      block_size=16, scheduling_policy=policy)
    config = args.create_engine_config()
    clock = SimulatedClock()
    return EngineCore(config, TimedRunner(clock, num_kv_blocks=num_blocks), None,
                      clock=clock), clock


@dataclass
class Arrival:
    at: float  # seconds after the start
    request_id: str
    prompt: list[int]
    max_tokens: int
    sensitive: bool


def coserving_workload(seed: int = 0) -> list[Arrival]:
    """Long throughput requests at the start; short latency-sensitive ones arriving
    while their prefills run."""
    rng = random.Random(seed)
    arrivals = [Arrival(0.0, f"batch-{i}", [rng.randrange(10, VOCAB) for _ in range(700)],
                        64, False) for i in range(16)]
    arrivals += [Arrival(0.05 + 0.25 * i, f"chat-{i}",
                         [rng.randrange(10, VOCAB) for _ in range(rng.randint(20, 60))], 24,
                         True) for i in range(10)]
    return sorted(arrivals, key=lambda a: a.at)


SLO = 0.025  # seconds per output token: about 3x a step of a few decodes
TTFT_SLO = 0.25


def run_simulation(policy: str, arrivals: list[Arrival]) -> tuple[dict[str, RequestOutput],
                                                                  float]:
    core, clock = make_core(policy)
    start = clock.now
    pending = list(arrivals)
    finals: dict[str, RequestOutput] = {}
    while pending or core.has_unfinished_requests():
        if not core.has_unfinished_requests() and pending:
            clock.now = max(clock.now, start + pending[0].at)
        while pending and start + pending[0].at <= clock.now:
            arrival = pending.pop(0)
            sensitive = arrival.sensitive and policy != "fcfs"
            core.add_request(
                arrival.request_id, {"prompt_token_ids": arrival.prompt},
                _params(arrival.max_tokens),
                priority=-1 if sensitive and policy == "priority" else 0,
                is_latency_sensitive=arrival.sensitive, slo=SLO if arrival.sensitive else None,
                ttft_slo=TTFT_SLO if arrival.sensitive else None)
        for output in core.step():
            if output.finished:
                finals[output.request_id] = output
    return finals, clock.now - start


def check_tokens(finals: dict[str, RequestOutput], arrivals: list[Arrival]) -> None:
    for arrival in arrivals:
        output = finals[arrival.request_id].outputs[0]
        assert output.finish_reason == "length"
        assert output.token_ids == fake_completion(arrival.prompt, arrival.max_tokens, VOCAB,
                                                   MAX_MODEL_LEN)


def test_slo_policy_keeps_latency_sensitive_requests_within_their_slo() -> None:
    arrivals = coserving_workload()
    outcomes = {}
    for policy in ("fcfs", "priority", "slo"):
        finals, elapsed = run_simulation(policy, arrivals)
        check_tokens(finals, arrivals)  # throughput requests finish under every policy
        sensitive = [finals[a.request_id].metrics for a in arrivals if a.sensitive]
        assert all(m is not None and m.slo_attained is not None for m in sensitive)
        outcomes[policy] = (sum(bool(m and m.slo_attained) for m in sensitive), elapsed)
        for arrival in arrivals:
            if not arrival.sensitive:
                metrics = finals[arrival.request_id].metrics
                assert metrics is not None and metrics.slo_attained is None

    attained_slo, elapsed_slo = outcomes["slo"]
    attained_fcfs, elapsed_fcfs = outcomes["fcfs"]
    assert attained_slo == 10, outcomes
    assert attained_fcfs <= 5, outcomes  # the workload does stress the SLO
    assert outcomes["priority"][0] < 10, outcomes  # ordering alone is not enough
    # Throughput work still gets the time the sensitive requests leave: the whole
    # workload takes at most 1.25x as long (at least 80% of fcfs's throughput).
    assert elapsed_slo < 1.25 * elapsed_fcfs, outcomes


def test_slo_policy_without_sensitive_requests_schedules_like_fcfs() -> None:
    arrivals = [a for a in coserving_workload(1) if not a.sensitive]
    steps = {}
    for policy in ("fcfs", "slo"):
        core, _clock = make_core(policy)
        for arrival in arrivals:
            core.add_request(arrival.request_id, {"prompt_token_ids": arrival.prompt},
                             _params(arrival.max_tokens))
        trace = []
        while core.has_unfinished_requests():
            output = core.schedule()
            trace.append([(i.request_id, i.num_tokens) for i in output.scheduled])
            core.process(output, core.runner.execute_model(output))
        steps[policy] = trace
    assert steps["slo"] == steps["fcfs"]


# -- priority -------------------------------------------------------------------------


@pytest.mark.parametrize("short_of", ["slots", "blocks"])
def test_waiting_high_priority_request_preempts_lower_priority_ones(short_of: str) -> None:
    slots = 2 if short_of == "slots" else 8
    blocks = 4096 if short_of == "slots" else 10  # 16-token blocks: two requests' worth
    core, _clock = make_core("priority", max_num_seqs=slots, num_blocks=blocks)
    engine_ids = {}  # the core keys requests by ids of its own
    for name, priority in (("low-a", 5), ("low-b", 3)):
        engine_ids[name] = core.add_request(name, {"prompt_token_ids": [10] * 60},
                                            _params(20), priority=priority)
    core.step()
    core.step()
    assert {r.request_id for r in core.scheduler.running} == {engine_ids["low-a"],
                                                              engine_ids["low-b"]}
    engine_ids["urgent"] = core.add_request("urgent", {"prompt_token_ids": [11] * 60},
                                            _params(20), priority=0)
    output = core.schedule()
    assert engine_ids["urgent"] in [item.request_id for item in output.scheduled]
    # The lowest priority goes first.
    assert output.preempted_request_ids == [engine_ids["low-a"]]
    core.process(output, core.runner.execute_model(output))
    finals = {}
    while core.has_unfinished_requests():
        for result in core.step():
            if result.finished:
                finals[result.request_id] = result
    order = list(finals)
    assert order.index("urgent") < order.index("low-a")
    for name, token in (("urgent", 11), ("low-a", 10), ("low-b", 10)):
        assert finals[name].outputs[0].token_ids == fake_completion([token] * 60, 20, VOCAB,
                                                                    MAX_MODEL_LEN)


def test_equal_priority_never_preempts_for_admission() -> None:
    core, _clock = make_core("priority", max_num_seqs=1)
    first = core.add_request("first", {"prompt_token_ids": [10] * 20}, _params(5), priority=1)
    core.step()
    core.add_request("second", {"prompt_token_ids": [10] * 20}, _params(5), priority=1)
    output = core.schedule()
    assert [item.request_id for item in output.scheduled] == [first]
    assert output.preempted_request_ids == []


def test_priority_needs_the_priority_policy_and_slo_must_be_positive() -> None:
    core, _clock = make_core("fcfs")
    with pytest.raises(ValueError, match="priority"):
        core.add_request("a", {"prompt_token_ids": [10]}, _params(1), priority=1)
    core, _clock = make_core("slo")
    for field in ("slo", "ttft_slo"):
        for bad in (0, -1.0, "fast"):
            with pytest.raises(ValueError, match=field):
                core.add_request("a", {"prompt_token_ids": [10]}, _params(1),
                                 **{field: bad})  # type: ignore[arg-type]
    assert not core.has_unfinished_requests()


# -- through the async engine ---------------------------------------------------------


@pytest.mark.anyio
async def test_async_engine_serves_higher_priority_first_and_reports_slo_attainment() -> None:
    runner = FakeModelRunner(256, VOCAB, step_delay=0.002)
    args = AsyncEngineArgs(max_model_len=256, block_size=4, max_num_seqs=1,
                           scheduling_policy="priority", disable_log_requests=True)
    finished: list[str] = []
    started = anyio.Event()
    async with AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner) as engine:

        async def one(name: str, priority: int, max_tokens: int) -> None:
            async for output in engine.generate({"prompt_token_ids": [10] * 8},
                                                _params(max_tokens), name, priority=priority,
                                                slo=60.0):
                started.set()
                if output.finished:
                    assert output.metrics is not None
                    assert output.metrics.slo_attained is True
                    finished.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "running", 9, 150)
            await started.wait()  # it holds the only slot now
            for name, priority in (("low", 5), ("high", 0), ("mid", 2)):
                tg.start_soon(one, name, priority, 6)
    # Each newcomer that outranks the holder of the slot preempts it.
    assert finished == ["high", "mid", "low", "running"]
