"""Scheduler and block manager invariants over generated workloads (fake model runner).

The fake runner's next token depends only on the sequence itself, so every request's
output must be identical whatever the budget, batch size, block count, chunking, prefix
caching, preemptions and aborts of other requests. The checking runner also keeps a
pretend KV cache and checks that each step reads exactly its own sequence's KV from its
block table, which is what makes reusing another request's cached blocks correct. As in
a real model, the KV at a position stands for the whole sequence up to it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from triollm import EngineArgs, SamplingParams
from triollm.engine.core import EngineCore
from triollm.outputs import EngineOutput
from triollm.step import PENDING_TOKEN, RunnerOutput, SchedulerOutput, fill_pending_tokens
from triollm.testing import FakeModelRunner, fake_completion

VOCAB = 500
MAX_MODEL_LEN = 96


class CheckingRunner(FakeModelRunner):
    """Checks every step against the scheduler's limits before computing it."""

    def __init__(self, core_limits: dict[str, int], **kwargs: Any) -> None:
        super().__init__(vocab_size=VOCAB, **kwargs)
        self.limits = core_limits
        #: (block, offset) -> the sequence up to and including the token of that slot.
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        #: Every token of each live request the runner has seen (prompt, then samples).
        self.sequences: dict[str, list[int]] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        scheduled = scheduler_output.scheduled
        block_size = self.limits["block_size"]
        for request_id in scheduler_output.finished_request_ids:
            self.sequences.pop(request_id, None)
        assert sum(item.num_tokens for item in scheduled) <= self.limits["budget"]
        assert all(PENDING_TOKEN not in item.token_ids for item in scheduled)
        assert len({item.request_id for item in scheduled}) == len(scheduled)
        written: dict[int, str] = {}
        for item in scheduled:
            end = item.start_position + item.num_tokens
            assert len(item.block_table) * block_size >= end
            for position in range(item.start_position, end):
                block = item.block_table[position // block_size]
                assert written.setdefault(block, item.request_id) == item.request_id, \
                    "two requests write one block in a step"
        readers = {block for item in scheduled for block in item.block_table}
        for item in scheduled:
            sequence = self.sequences.setdefault(item.request_id,
                                                 list(item.prompt_token_ids))
            for position in range(item.start_position):
                slot = (item.block_table[position // block_size], position % block_size)
                assert self.kv.get(slot) == tuple(sequence[:position + 1]), \
                    f"{item.request_id} reads the wrong KV at position {position}"
        for item in scheduled:
            sequence = self.sequences[item.request_id]
            assert sequence[item.start_position:item.start_position + item.num_tokens] \
                == item.token_ids
            for position in range(item.start_position, item.start_position + item.num_tokens):
                self.kv[(item.block_table[position // block_size],
                         position % block_size)] = tuple(sequence[:position + 1])
        assert not (set(written) - readers)
        output = super().execute_model(scheduler_output)
        for request_id, token in output.sampled_token_ids.items():
            self.sequences[request_id].append(token)
        return output


class Pipeline:
    """Drives the core as ``AsyncLLMEngine`` does with ``async_scheduling``: the next
    step is scheduled before the previous one is processed. ``eager``: the runner
    computes each step as soon as it is scheduled (the model thread got to it before
    the loop processed the previous one); otherwise only when its results are needed
    (after any abort made meanwhile)."""

    def __init__(self, core: EngineCore, runner: CheckingRunner, *, eager: bool) -> None:
        self.core = core
        self.runner = runner
        self.eager = eager
        self.in_flight: deque[tuple[SchedulerOutput, RunnerOutput | None]] = deque()
        self.sampled: dict[str, int] = {}

    def _execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        fill_pending_tokens(scheduler_output, self.sampled)
        output = self.runner.execute_model(scheduler_output)
        self.sampled = output.sampled_token_ids
        return output

    def step(self) -> list[EngineOutput]:
        while len(self.in_flight) < 2:
            scheduler_output = self.core.schedule()
            if scheduler_output.is_empty:
                if not self.in_flight and scheduler_output.finished_request_ids:
                    self.runner.execute_model(scheduler_output)
                break
            self.in_flight.append((scheduler_output, self._execute(scheduler_output)
                                   if self.eager else None))
        if not self.in_flight:
            return []
        scheduler_output, output = self.in_flight.popleft()
        if output is None:
            output = self._execute(scheduler_output)
        return self.core.process(scheduler_output, output)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return fake_completion(prompt, max_tokens, VOCAB, MAX_MODEL_LEN)


def make_core(tokenizer: Any, *, budget: int, max_num_seqs: int, block_size: int,
              num_blocks: int, chunked: bool, caching: bool = True,
              policy: str = "fcfs") -> tuple[EngineCore, CheckingRunner]:
    args = EngineArgs(model="triollm/tiny-demo", max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=budget if chunked else max(budget, MAX_MODEL_LEN),
                      max_num_seqs=max_num_seqs, block_size=block_size,
                      enable_chunked_prefill=chunked, enable_prefix_caching=caching,
                      scheduling_policy=policy)
    config = args.create_engine_config()
    runner = CheckingRunner({"budget": config.scheduler.max_num_batched_tokens,
                             "block_size": block_size}, num_kv_blocks=num_blocks)
    return EngineCore(config, runner, tokenizer), runner


#: Prompts are drawn from a few shared openings, so prefix caching gets hits.
_OPENINGS = [[7] * 9, [11, 12, 13, 14, 15, 16, 17], [7] * 4 + [8] * 4]
request_strategy = st.tuples(
    st.tuples(st.sampled_from([[], *_OPENINGS]),
              st.lists(st.integers(5, VOCAB - 1), max_size=30))
    .map(lambda parts: parts[0] + parts[1]).filter(bool),  # prompt
    st.integers(1, 30),  # max_tokens
    st.integers(0, 12),  # arrival step
    st.one_of(st.none(), st.integers(0, 40)),  # abort at step
    st.integers(0, 2),  # priority under "priority"; latency-sensitive if 0 under "slo"
)


@given(
    requests=st.lists(request_strategy, min_size=1, max_size=12),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(1, 8),
    block_size=st.sampled_from([1, 2, 4, 16]),
    spare_blocks=st.integers(0, 40),
    chunked=st.booleans(),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority", "slo"]),
    pipelined=st.sampled_from([None, "eager", "lazy"]),
)
def test_outputs_are_independent_of_scheduling_and_blocks_never_leak(
    tokenizer: Any, requests: list[tuple[list[int], int, int, int | None, int]], budget: int,
    max_num_seqs: int, block_size: int, spare_blocks: int, chunked: bool, caching: bool,
    policy: str, pipelined: str | None,
) -> None:
    """Also with asynchronous scheduling (``pipelined``): each step scheduled while the
    previous one is in flight, computed before or after the aborts made meanwhile."""
    min_blocks = -(-MAX_MODEL_LEN // block_size)
    core, runner = make_core(tokenizer, budget=budget, max_num_seqs=max_num_seqs,
                             block_size=block_size, num_blocks=min_blocks + spare_blocks,
                             chunked=chunked, caching=caching, policy=policy)
    pipeline = None if pipelined is None else Pipeline(core, runner,
                                                       eager=pipelined == "eager")
    step_once = core.step if pipeline is None else pipeline.step
    finals: dict[str, Any] = {}
    aborted: set[str] = set()
    step = 0
    pending = sorted(enumerate(requests), key=lambda item: item[1][2])
    while pending or core.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            index, (prompt, max_tokens, _, _, rank) = pending.pop(0)
            core.add_request(str(index), {"prompt_token_ids": prompt},
                             SamplingParams(temperature=0, max_tokens=max_tokens,
                                            ignore_eos=True, detokenize=False),
                             priority=rank if policy == "priority" else 0,
                             is_latency_sensitive=policy == "slo" and rank == 0,
                             slo=1e-4 if policy == "slo" and rank == 0 else None)
        for index, (_, _, arrival, abort_at, _) in enumerate(requests):
            if abort_at is not None and arrival + abort_at == step and str(index) not in finals:
                for output in core.abort_requests([str(index)]):
                    aborted.add(output.request_id)
                    finals[output.request_id] = output
        for output in step_once():
            assert output.request_id not in finals, "output after the final one"
            if output.finished:
                finals[output.request_id] = output
        stats = core.statistics()
        assert stats.num_running <= max_num_seqs
        step += 1
        assert step < 5000, "no progress"

    while pipeline is not None and pipeline.in_flight:  # steps of requests aborted late
        assert step_once() == []
    assert not core.scheduler.has_steps_in_flight()
    note(f"steps={step} preemptions={core.statistics().num_preemptions}")
    stats = core.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert core.block_manager.statistics().num_requests == 0
    assert len(finals) == len(requests)
    for index, (prompt, max_tokens, _, _, _) in enumerate(requests):
        output = finals[str(index)].outputs[0]
        expected = expected_tokens(prompt, max_tokens)
        if str(index) in aborted:
            assert output.finish_reason == "abort"
            assert output.token_ids == expected[: len(output.token_ids)]
        else:
            assert output.token_ids == expected
            assert output.finish_reason == "length"


def test_preempted_request_resumes_with_identical_tokens(tokenizer: Any) -> None:
    core, _runner = make_core(tokenizer, budget=64, max_num_seqs=4, block_size=4,
                             num_blocks=26, chunked=True)
    prompts = [[10 + i] * 20 for i in range(4)]
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=40,
                                                        ignore_eos=True, detokenize=False))
    finals = {}
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                finals[output.request_id] = output
    assert core.statistics().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert finals[str(i)].outputs[0].token_ids == expected_tokens(prompt, 40)


def test_abort_frees_blocks_at_once_and_unknown_ids_are_ignored(tokenizer: Any) -> None:
    core, _ = make_core(tokenizer, budget=16, max_num_seqs=4, block_size=4, num_blocks=64,
                        chunked=True)
    core.add_request("a", [5] * 30, SamplingParams(max_tokens=10, detokenize=False))
    core.step()
    assert core.statistics().num_free_blocks < 64
    (final,) = core.abort_request(["a", "nope"])
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert core.statistics().num_free_blocks == 64
    assert core.abort_request("a") == []
    assert not core.has_unfinished_requests()


def test_duplicate_request_id_is_refused_without_disturbing_the_first(tokenizer: Any) -> None:
    core, _ = make_core(tokenizer, budget=16, max_num_seqs=4, block_size=4, num_blocks=64,
                        chunked=True)
    core.add_request("a", [5, 6, 7],
                     SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False))
    with pytest.raises(ValueError, match="request_id"):
        core.add_request("a", [8, 9], SamplingParams(max_tokens=3, detokenize=False))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    assert outputs[-1].prompt_token_ids == [5, 6, 7]
    assert outputs[-1].outputs[0].token_ids == expected_tokens([5, 6, 7], 3)
