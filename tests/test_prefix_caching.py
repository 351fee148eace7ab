"""Automatic prefix caching: block-level invariants over generated add / step / abort /
preempt sequences (fake runner), and greedy outputs identical with caching on and off
over a real tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from triollm import LLM, EngineArgs, SamplingParams
from triollm.engine.core import EngineCore
from triollm.step import RunnerOutput, SchedulerOutput
from triollm.testing import FakeModelRunner, fake_completion

VOCAB = 500
MAX_MODEL_LEN = 96
BLOCK = 4


class WriteCheckingRunner(FakeModelRunner):
    """Every block a step writes belongs to exactly one request (cached blocks are only
    ever read); the block manager's invariants hold at every step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(vocab_size=VOCAB, **kwargs)
        self.core: EngineCore | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        assert self.core is not None
        manager = self.core.block_manager
        manager.check_invariants()
        holders: dict[int, int] = {}
        for table in manager._tables.values():
            for block in table:
                holders[block] = holders.get(block, 0) + 1
        for item in scheduler_output.scheduled:
            end = item.start_position + item.num_tokens
            written = item.block_table[item.start_position // BLOCK:-(-end // BLOCK)]
            assert all(holders[block] == 1 for block in written), "a shared block is written"
        return super().execute_model(scheduler_output)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return fake_completion(prompt, max_tokens, VOCAB, MAX_MODEL_LEN)


prefixes = st.lists(st.lists(st.integers(5, VOCAB - 1), min_size=0, max_size=40),
                    min_size=1, max_size=3)
operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.lists(st.integers(5, VOCAB - 1),
                                                          min_size=1, max_size=10),
              st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), min_size=1, max_size=40)
TOTAL_HITS: list[int] = []


# From one max_model_len sequence's blocks up, as an engine's start requires
# (model/runners/setup.py): a cache smaller than one request can never finish it.
@settings(max_examples=150, deadline=None)
@given(prefixes=prefixes, ops=operations,
       num_blocks=st.integers(-(-MAX_MODEL_LEN // BLOCK), 60),
       max_num_seqs=st.integers(1, 4), budget=st.integers(8, 32))
def test_blocks_never_leak_or_go_negative(prefixes: list[list[int]],
                                          ops: list[tuple[Any, ...]], num_blocks: int,
                                          max_num_seqs: int, budget: int) -> None:
    from triollm.model.loader import build_demo_tokenizer

    args = EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget,
                      block_size=BLOCK, max_num_seqs=max_num_seqs,
                      enable_prefix_caching=True)
    runner = WriteCheckingRunner(num_kv_blocks=num_blocks)
    core = EngineCore(args.create_engine_config(), runner, build_demo_tokenizer())
    runner.core = core
    prompts: dict[str, tuple[list[int], int]] = {}
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()

    def record(outputs: list[Any]) -> None:
        for output in outputs:
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)

    for op in ops:
        if op[0] == "add":
            _, which, suffix, max_tokens = op
            prompt = (prefixes[which % len(prefixes)] + suffix)[: MAX_MODEL_LEN - 1]
            request_id = str(len(prompts))
            prompts[request_id] = (prompt, max_tokens)
            core.add_request(request_id, {"prompt_token_ids": prompt},
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                            detokenize=False))
        elif op[0] == "step":
            for _ in range(op[1]):
                record(core.step())
        else:
            request_id = str(op[1])
            if request_id in prompts and request_id not in finished:
                aborted.add(request_id)
                core.abort_requests([request_id])
        core.block_manager.check_invariants()
    while core.has_unfinished_requests():
        record(core.step())
    stats = core.block_manager.statistics()
    note(f"{stats}")
    assert stats.num_free_blocks == num_blocks and stats.num_requests == 0
    core.block_manager.check_invariants()
    for request_id, tokens in finished.items():
        if request_id not in aborted:
            prompt, max_tokens = prompts[request_id]
            assert tokens == expected_tokens(prompt, max_tokens)
    assert core.reset_prefix_cache()
    assert core.block_manager.statistics().num_cached_blocks == 0
    TOTAL_HITS.append(stats.prefix_cache_hits)


def test_the_property_run_hit_the_cache() -> None:
    assert sum(TOTAL_HITS) > 0, "no example reused a cached block"


# -- greedy equality over a real model ---------------------------------------------------

@pytest.fixture(scope="module")
def llms(llama_path: Path) -> dict[bool, LLM]:
    return {caching: LLM(str(llama_path), dtype="float32", max_model_len=128,
                         block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=32,
                         num_gpu_blocks_override=40, enable_prefix_caching=caching)
            for caching in (False, True)}


SYSTEM_PROMPTS = [[10 + i for i in range(23)], [300, 301, 302, 303, 304, 305, 306, 307, 308],
                  [7] * 16]


@settings(max_examples=12, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 2),
                                   st.lists(st.integers(5, 400), min_size=0, max_size=9)),
                         min_size=2, max_size=6))
def test_greedy_outputs_are_identical_with_caching_on_and_off(
        llms: dict[bool, LLM], requests: list[tuple[int, list[int]]]) -> None:
    prompts: list[Any] = [{"prompt_token_ids": SYSTEM_PROMPTS[i] + suffix}
                          for i, suffix in requests]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {caching: [o.outputs[0].token_ids for o in
                         llm.generate(prompts, params, use_tqdm=False)]
               for caching, llm in llms.items()}
    assert results[True] == results[False]


def test_the_real_model_run_hit_the_cache(llms: dict[bool, LLM]) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    for llm in llms.values():  # one after the other: the second finds the first's blocks
        for suffix in ([1, 2], [3, 4]):
            llm.generate({"prompt_token_ids": SYSTEM_PROMPTS[0] + suffix}, params,
                         use_tqdm=False)
    stats = llms[True].engine.statistics()
    assert stats.prefix_cache_hits > 0 and llms[False].engine.statistics(
        ).prefix_cache_hits == 0
    print(f"prefix cache: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} "
          "prompt tokens found")


# -- who may share a cached prefix -------------------------------------------------------

@pytest.mark.parametrize(("first_salt", "second_salt", "shared"), [
    (None, None, True), ("tenant-a", "tenant-a", True), ("tenant-a", "tenant-b", False),
    ("tenant-a", None, False), (None, "tenant-a", False),
])
def test_only_requests_with_the_same_cache_salt_share_blocks(
        first_salt: str | None, second_salt: str | None, shared: bool) -> None:
    config = EngineArgs(max_model_len=MAX_MODEL_LEN, block_size=BLOCK,
                        num_gpu_blocks_override=64).create_engine_config()
    core = EngineCore(config, FakeModelRunner(num_kv_blocks=64, vocab_size=VOCAB), None)
    prompt = list(range(10, 30))
    for name, salt in (("first", first_salt), ("second", second_salt)):
        request: dict[str, Any] = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        before = core.statistics().prefix_cache_hits
        core.add_request(name, request, SamplingParams(max_tokens=2, ignore_eos=True,
                                                       detokenize=False))
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step()
        assert outputs[-1].outputs[0].token_ids == expected_tokens(prompt, 2)
        hits = core.statistics().prefix_cache_hits - before
    assert (hits > 0) == shared


def test_block_hashes_are_sha256_chained_over_the_whole_prefix() -> None:
    """Blocks are named by a collision-resistant hash of everything before them: the
    same tokens after another prefix, or under another salt or LoRA adapter, are another
    block."""
    from triollm.engine.block_manager import _chain_hash, _chain_root

    def root(salt: str | None = None, adapter: tuple[int, int] | None = None) -> bytes:
        return _chain_root(salt, adapter)

    first = _chain_hash(root(), [1, 2, 3, 4])
    assert len(first) == 32  # a SHA-256 digest, not Python's 64-bit hash()
    assert _chain_hash(first, [5, 6, 7, 8]) != _chain_hash(root(), [5, 6, 7, 8])
    assert _chain_hash(root("s"), [1, 2, 3, 4]) != first
    assert _chain_hash(root("s"), [1, 2, 3, 4]) == _chain_hash(root("s"), [1, 2, 3, 4])
    roots = {root(), root("s"), root(adapter=(1, 0)), root(adapter=(2, 0)),
             root(adapter=(1, 1)), root("s", (1, 0)), root("(1, 0)")}
    assert len(roots) == 7
