"""LoRA adapters in the scheduler and the prefix cache (fake model runner).

The checking runner keeps a pretend KV cache whose every slot records which adapter
computed it: a step that reads KV another adapter (or the base model) wrote fails,
whatever the chunking, preemption and prefix caching did. It also checks that no step
holds more than ``max_loras`` adapters.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from triollm import EngineArgs, LoRARequest, SamplingParams
from triollm.engine.core import EngineCore
from triollm.step import RunnerOutput, SchedulerOutput
from triollm.testing import FakeModelRunner, fake_completion

VOCAB = 500
MAX_MODEL_LEN = 96


class AdapterCheckingRunner(FakeModelRunner):
    def __init__(self, *, block_size: int, max_loras: int, num_kv_blocks: int) -> None:
        super().__init__(num_kv_blocks=num_kv_blocks, vocab_size=VOCAB)
        self.block_size = block_size
        self.max_loras = max_loras
        self.loaded: set[int] = set()
        #: (block, offset) -> (adapter id or 0, the sequence up to that slot)
        self.kv: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        self.sequences: dict[str, list[int]] = {}
        self.adapters_per_step: list[set[int]] = []

    def add_lora(self, lora_request: LoRARequest) -> bool:
        new = lora_request.lora_int_id not in self.loaded
        self.loaded.add(lora_request.lora_int_id)
        return new

    def remove_lora(self, lora_id: int) -> bool:
        removed = lora_id in self.loaded
        self.loaded.discard(lora_id)
        return removed

    def list_loras(self) -> set[int]:
        return set(self.loaded)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        size = self.block_size
        for request_id in scheduler_output.finished_request_ids:
            self.sequences.pop(request_id, None)
        adapters = {item.lora_request.lora_int_id for item in scheduler_output.scheduled
                    if item.lora_request is not None}
        assert len(adapters) <= self.max_loras, f"a step holds adapters {adapters}"
        self.adapters_per_step.append(adapters)
        for item in scheduler_output.scheduled:
            adapter = item.lora_request.lora_int_id if item.lora_request is not None else 0
            sequence = self.sequences.setdefault(item.request_id, list(item.prompt_token_ids))
            for position in range(item.start_position):
                slot = (item.block_table[position // size], position % size)
                assert self.kv.get(slot) == (adapter, tuple(sequence[:position + 1])), \
                    f"{item.request_id} (adapter {adapter}) reads KV it did not compute"
            for position in range(item.start_position, item.start_position + item.num_tokens):
                self.kv[(item.block_table[position // size], position % size)] = (
                    adapter, tuple(sequence[:position + 1]))
        output = super().execute_model(scheduler_output)
        for request_id, token in output.sampled_token_ids.items():
            self.sequences[request_id].append(token)
        return output


def make_core(tokenizer: Any, *, max_loras: int, budget: int = 64, max_num_seqs: int = 8,
              block_size: int = 4, num_blocks: int = 200, chunked: bool = True,
              policy: str = "fcfs") -> tuple[EngineCore, AdapterCheckingRunner]:
    args = EngineArgs(model="triollm/tiny-demo", max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=budget if chunked else max(budget, MAX_MODEL_LEN),
                      max_num_seqs=max_num_seqs, block_size=block_size,
                      enable_chunked_prefill=chunked, scheduling_policy=policy,
                      enable_lora=True, max_loras=max_loras)
    config = args.create_engine_config()
    runner = AdapterCheckingRunner(block_size=block_size, max_loras=max_loras,
                                   num_kv_blocks=num_blocks)
    return EngineCore(config, runner, tokenizer), runner


def adapter(lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}")


_OPENING = [7] * 12  # every prompt may share it: only the same adapter may reuse its KV
request_strategy = st.tuples(
    st.tuples(st.sampled_from([[], _OPENING]), st.lists(st.integers(5, VOCAB - 1),
                                                        max_size=20))
    .map(lambda parts: parts[0] + parts[1]).filter(bool),  # prompt
    st.integers(1, 20),  # max_tokens
    st.integers(0, 10),  # arrival step
    st.integers(0, 4),  # adapter (0: the base model)
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step
)


@given(
    requests=st.lists(request_strategy, min_size=1, max_size=14),
    max_loras=st.integers(1, 3),
    budget=st.integers(8, 64),
    max_num_seqs=st.integers(1, 8),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 40),
    chunked=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_steps_hold_at_most_max_loras_adapters_and_never_share_kv_across_adapters(
    tokenizer: Any, requests: list[tuple[list[int], int, int, int, int | None]],
    max_loras: int, budget: int, max_num_seqs: int, block_size: int, spare_blocks: int,
    chunked: bool, policy: str,
) -> None:
    min_blocks = -(-MAX_MODEL_LEN // block_size)
    core, runner = make_core(tokenizer, max_loras=max_loras, budget=budget,
                             max_num_seqs=max_num_seqs, block_size=block_size,
                             num_blocks=min_blocks + spare_blocks, chunked=chunked,
                             policy=policy)
    finals: dict[str, Any] = {}
    step = 0
    pending = sorted(enumerate(requests), key=lambda item: item[1][2])
    while pending or core.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            index, (prompt, max_tokens, _, lora_id, _) = pending.pop(0)
            lora = adapter(lora_id) if lora_id else None
            if lora is not None:
                core.add_lora(lora)
            core.add_request(str(index), {"prompt_token_ids": prompt},
                             SamplingParams(temperature=0, max_tokens=max_tokens,
                                            ignore_eos=True, detokenize=False),
                             priority=index % 3 if policy == "priority" else 0,
                             lora_request=lora)
        for index, (_, _, arrival, _, abort_at) in enumerate(requests):
            if abort_at is not None and arrival + abort_at == step and str(index) not in finals:
                for output in core.abort_requests([str(index)]):
                    finals[output.request_id] = output
        for output in core.step():
            if output.finished:
                finals[output.request_id] = output
        step += 1
        assert step < 5000, "no progress"
    note(f"steps={step} adapters per step={runner.adapters_per_step}")
    stats = core.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert len(finals) == len(requests)
    for index, (prompt, max_tokens, _, _, _) in enumerate(requests):
        output = finals[str(index)].outputs[0]
        expected = fake_completion(prompt, max_tokens, VOCAB, MAX_MODEL_LEN)
        assert output.token_ids == expected[: len(output.token_ids)]
        if output.finish_reason != "abort":
            assert output.token_ids == expected


def test_a_waiting_adapter_is_not_starved_by_a_stream_of_running_ones(tokenizer: Any) -> None:
    """max_loras=1: adapter 1 gets a new request every step, forever; adapter 2's one
    request, held back, must still run, and before the adapter-1 requests that arrived
    after it. Requests for the base model are never held back."""
    core, runner = make_core(tokenizer, max_loras=1, max_num_seqs=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
    for lora_id in (1, 2):
        core.add_lora(adapter(lora_id))
    first_step: dict[str, int] = {}
    for step in range(40):
        if step < 30:
            core.add_request(f"a1-{step}", [5, 6, step + 7], params, lora_request=adapter(1))
        if step == 2:
            core.add_request("a2", [9, 9, 9], params, lora_request=adapter(2))
        if step == 3:
            core.add_request("base", [8, 8, 8], params)
        output = core.schedule()
        for item in output.scheduled:
            first_step.setdefault(item.request_id.rsplit("-", 1)[0], step)
        core.process(output, runner.execute_model(output))
    assert "a2" in first_step, "adapter 2's request never ran"
    assert first_step["base"] == 3
    later = [first_step[f"a1-{s}"] for s in range(3, 30) if f"a1-{s}" in first_step]
    assert all(when > first_step["a2"] for when in later)
    assert all(len(adapters) <= 1 for adapters in runner.adapters_per_step)


def test_an_adapter_id_names_one_adapter(tokenizer: Any) -> None:
    core, _ = make_core(tokenizer, max_loras=2)
    assert core.add_lora(adapter(1)) is True
    assert core.add_lora(adapter(1)) is False
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'adapter-1'"):
        core.add_lora(LoRARequest("other", 1, "/adapters/other"))
    with pytest.raises(ValueError, match="not loaded"):
        core.add_request("x", [5, 6], SamplingParams(), lora_request=adapter(3))
    assert core.list_loras() == {1}
    assert core.remove_lora(1) and core.list_loras() == set()


def test_a_forgotten_adapter_is_refused_before_the_runner_unloads_it(tokenizer: Any) -> None:
    """The async engine forgets on the loop and unloads in the model thread, after the
    steps queued before: between the two no new request may name the adapter, while a
    request already running with it finishes with it."""
    core, runner = make_core(tokenizer, max_loras=2)
    assert core.add_lora(adapter(1)) is True
    core.add_request("running", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True),
                     lora_request=adapter(1))
    core.step()
    assert core.loras.forget(1) is True
    assert runner.loaded == {1}  # still in the runner: the queued steps may use it
    with pytest.raises(ValueError, match="lora_request: adapter 'adapter-1' is not loaded"):
        core.add_request("late", [5, 6], SamplingParams(), lora_request=adapter(1))
    while core.has_unfinished_requests():
        core.step()
    core.loras.unload(1)
    assert runner.loaded == set() and core.list_loras() == set()
