"""N-gram speculative decoding without a model: the config's checks, the prompt-lookup
proposer, and the engine's bookkeeping of drafts (budget, KV slots, rollback of
rejected positions, prefix caching) against a fake model whose outputs are known."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from triollm import EngineArgs, SamplingParams
from triollm.engine.core import EngineCore
from triollm.engine.speculative.config import default_disable_by_batch_size, speculative_config
from triollm.engine.speculative.ngram import INDEX_PER_CALL, NgramIndex
from triollm.step import RunnerOutput, SchedulerOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


# -- the config ----------------------------------------------------------------------


def parse(value: Any, **kwargs: Any) -> Any:
    return speculative_config(value, **{"async_scheduling": False, "runner": "generate",
                                        **kwargs})


def test_ngram_config_takes_vllms_fields_and_defaults() -> None:
    config = parse(NGRAM)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == ("ngram", 3, 5, 5)  # vLLM's default window
    assert config.disable_by_batch_size == default_disable_by_batch_size(3) == 2
    config = parse(json.dumps({**NGRAM, "prompt_lookup_max": 4}))  # the CLI's JSON
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = parse({**NGRAM, "prompt_lookup_min": 2, "disable_by_batch_size": 7})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert config.disable_by_batch_size == 7
    assert parse(None) is None and parse({}) is None
    config = parse({"method": "draft_model", "model": "d", "num_speculative_tokens": 4,
                    "draft_tensor_parallel_size": 1})
    assert (config.method, config.model, config.num_speculative_tokens,
            config.disable_by_batch_size) == ("draft_model", "d", 4, 1)


@pytest.mark.parametrize(("value", "kwargs", "message"), [
    ({**NGRAM, "model": "m"}, {}, r"speculative_config.model: does not apply to method"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, {},
     r"speculative_config.model: is required with method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "m",
      "draft_tensor_parallel_size": 2}, {}, "draft_tensor_parallel_size: must be 1"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "m",
      "prompt_lookup_max": 2}, {}, "prompt_lookup_max: does not apply to method"),
    ({"method": "draft_model", "model": "m"}, {}, "num_speculative_tokens: is required"),
    ({"method": "eagle", "num_speculative_tokens": 3}, {}, "'eagle' is not supported"),
    ({"num_speculative_tokens": 3}, {}, "speculative_config.method: is required"),
    ({"method": "ngram"}, {}, "num_speculative_tokens: is required"),
    ({**NGRAM, "num_speculative_tokens": 0}, {}, "num_speculative_tokens: must be"),
    ({**NGRAM, "num_speculative_tokens": True}, {}, "num_speculative_tokens: must be"),
    ({**NGRAM, "prompt_lookup_min": 0}, {}, "prompt_lookup_min: must be"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {},
     "prompt_lookup_min: 4 must be <= prompt_lookup_max=2"),
    ({**NGRAM, "disable_by_batch_size": "4"}, {}, "disable_by_batch_size: must be"),
    ({**NGRAM, "prompt_lookup_mx": 3}, {}, "unsupported field.*prompt_lookup_mx"),
    ("{not json", {}, "speculative_config: not JSON"),
    ([1], {}, "speculative_config: must be a JSON object"),
    (NGRAM, {"async_scheduling": True}, "async_scheduling"),
    (NGRAM, {"runner": "pooling"}, "generation models"),
])
def test_bad_configs_are_refused_naming_the_field(value: Any, kwargs: dict[str, Any],
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(value, **kwargs)


def test_engine_args_resolve_the_config_and_turn_async_scheduling_off() -> None:
    config = EngineArgs(model="triollm/tiny-demo", device="cpu",
                        speculative_config=NGRAM).create_engine_config()
    assert config.speculative is not None and config.speculative.num_speculative_tokens == 3
    assert not config.scheduler.async_scheduling
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        EngineArgs(model="triollm/tiny-demo", device="cpu",
                   speculative_config={"method": "eagle"}).create_engine_config()
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model="triollm/tiny-demo", device="cpu", async_scheduling=True,
                   speculative_config=NGRAM).create_engine_config()


# -- the proposer ----------------------------------------------------------------------


def test_the_longest_match_proposes_what_followed_its_latest_occurrence() -> None:
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # "6 7" occurred at 1-2 and 5-6; the latest is followed by 1 2 6 7.
    assert index.propose(tokens, 3) == [1, 2, 6]
    # Longer n-grams win: "9 6 7" only once, followed by 1 2.
    assert index.propose([*tokens, 9, 6, 7], 2) == [1, 2]
    assert index.propose([*tokens, 9, 6, 7, 4], 3) == []  # no match
    assert index.propose([1, 2, 3], 0) == []


def test_a_repeating_sequence_is_continued_with_its_period() -> None:
    index = NgramIndex(2, 4)
    assert index.propose([3, 4, 3, 4, 3, 4], 5) == [3, 4, 3, 4, 3]
    assert NgramIndex(2, 2).propose([9, 9, 9], 4) == [9, 9, 9, 9]


def test_a_long_prompt_is_indexed_a_bounded_piece_per_call() -> None:
    index = NgramIndex(2, 3)
    head = list(range(10, 10 + INDEX_PER_CALL + 100))
    prompt = [*head, 1, 2, 3, *range(5000, 5000 + 2 * INDEX_PER_CALL), 1, 2]
    assert index.propose(prompt, 2) == []  # the earlier "1 2" is not indexed yet
    assert index.num_indexed == INDEX_PER_CALL
    assert index.propose(prompt, 2) == [3, 5000]
    assert index.num_indexed == 2 * INDEX_PER_CALL


@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3),
       st.integers(0, 3), st.integers(1, 6))
def test_proposals_follow_an_earlier_occurrence_of_a_suffix(
        tokens: list[int], low: int, extra: int, k: int) -> None:
    high = low + extra
    proposal = NgramIndex(low, high).propose(tokens, k)
    if not proposal:
        return
    # Some n in [low, high]: the last n tokens occurred ending at e < len - 1, and the
    # proposal is what follows e, continued with the period len - 1 - e.
    assert len(proposal) == k
    found = False
    for n in range(low, min(high, len(tokens)) + 1):
        suffix = tokens[len(tokens) - n:]
        for end in range(n - 1, len(tokens) - 1):
            if tokens[end + 1 - n:end + 1] == suffix:
                period = len(tokens) - 1 - end
                found |= proposal == [tokens[end + 1 + i % period] for i in range(k)]
    assert found


# -- the bookkeeping, against a fake model ----------------------------------------------

VOCAB = 12
MAX_MODEL_LEN = 96


class LoopingRunner:
    """A fake model whose next token is ``table[last]`` (so sequences loop and prompt
    lookup finds matches), except at ``surprises`` positions; drafts are accepted while
    they are its prediction. It keeps a pretend KV cache and checks that every step
    reads exactly its own sequence's KV: a rejected position read later would fail."""

    def __init__(self, table: list[int], surprises: set[int], num_kv_blocks: int,
                 block_size: int) -> None:
        self.table = table
        self.surprises = surprises
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.sequences: dict[str, list[int]] = {}

    def next_token(self, last: int, position: int) -> int:
        surprise = position in self.surprises
        return (self.table[last] + 1 + position) % VOCAB if surprise else self.table[last]

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        size = self.block_size
        output = RunnerOutput()
        for request_id in scheduler_output.finished_request_ids:
            self.sequences.pop(request_id, None)
        for item in scheduler_output.scheduled:
            sequence = self.sequences.setdefault(item.request_id,
                                                 list(item.prompt_token_ids))
            for position in range(item.start_position):
                slot = (item.block_table[position // size], position % size)
                assert self.kv.get(slot) == tuple(sequence[:position + 1]), position
            written = sequence[:item.start_position] + item.token_ids
            for position in range(item.start_position, len(written)):
                self.kv[(item.block_table[position // size], position % size)] = tuple(
                    written[:position + 1])
            if not item.sample:
                continue
            k = item.num_draft_tokens
            position = len(written) - 1 - k
            tokens = [self.next_token(written[position], position)]
            for draft in written[len(written) - k:]:
                if draft != tokens[-1]:
                    break
                tokens.append(self.next_token(draft, position + len(tokens)))
            sequence[len(sequence):] = tokens  # the runner's own view, as a real one's
            output.sampled_token_ids[item.request_id] = tokens[0]
            if k:
                output.more_token_ids[item.request_id] = tokens[1:]
        return output

    def expected(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        while len(tokens) < min(MAX_MODEL_LEN, len(prompt) + max_tokens):
            tokens.append(self.next_token(tokens[-1], len(tokens) - 1))
        return tokens[len(prompt):]

    def shutdown(self) -> None:
        pass


@given(
    table=st.lists(st.integers(0, VOCAB - 1), min_size=VOCAB, max_size=VOCAB),
    surprises=st.sets(st.integers(0, MAX_MODEL_LEN), max_size=12),
    prompts=st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                        max_size=30), st.integers(1, 40)),
                     min_size=1, max_size=5),
    k=st.integers(1, 5),
    block_size=st.sampled_from([1, 2, 4, 16]),
    spare_blocks=st.integers(0, 30),
    budget=st.integers(8, 64),
    caching=st.booleans(),
)
def test_drafts_roll_back_exactly_and_blocks_come_back(
        tokenizer: Any, table: list[int], surprises: set[int],
        prompts: list[tuple[list[int], int]], k: int, block_size: int, spare_blocks: int,
        budget: int, caching: bool) -> None:
    """Outputs are the model's own whatever is accepted; after each step every running
    request has exactly its tokens but the last computed and holds no block past
    them; at the end every block is free again (no leak)."""
    num_blocks = -(-MAX_MODEL_LEN // block_size) + spare_blocks
    config = EngineArgs(
        model="triollm/tiny-demo", device="cpu", max_model_len=MAX_MODEL_LEN,
        block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=4,
        enable_prefix_caching=caching,
        speculative_config={"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                            "disable_by_batch_size": 4}).create_engine_config()
    runner = LoopingRunner(table, surprises, num_blocks, block_size)
    core = EngineCore(config, runner, tokenizer)
    for index, (prompt, max_tokens) in enumerate(prompts):
        core.add_request(str(index), {"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=max_tokens,
                                        ignore_eos=True, detokenize=False))
    finals: dict[str, Any] = {}
    steps = 0
    while core.has_unfinished_requests():
        scheduled = core.schedule()
        assert scheduled.num_batched_tokens <= budget
        drafted = {item.request_id for item in scheduled.scheduled if item.num_draft_tokens}
        for output in core.process(scheduled, runner.execute_model(scheduled)):
            if output.finished:
                finals[output.request_id] = output
        core.block_manager.check_invariants()
        for request in core.scheduler.running:
            blocks = len(core.block_manager.block_table(request.request_id))
            assert request.num_computed_tokens <= request.num_tokens - 1
            assert blocks <= -(-request.num_tokens // block_size)
            if request.request_id in drafted:
                assert request.num_computed_tokens == request.num_tokens - 1
        steps += 1
        assert steps < 2000
    spec = core.statistics().spec_decoding
    assert spec is not None
    note(f"steps={steps} drafts={spec.num_drafts} accepted={spec.num_accepted_tokens}")
    stats = core.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks
    for index, (prompt, max_tokens) in enumerate(prompts):
        assert finals[str(index)].outputs[0].token_ids == runner.expected(prompt, max_tokens)
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens


def test_a_looping_sequence_accepts_drafts_and_takes_fewer_steps(tokenizer: Any) -> None:
    def run(speculative: dict[str, Any] | None) -> tuple[list[int], int, Any]:
        config = EngineArgs(model="triollm/tiny-demo", device="cpu", max_model_len=64,
                            speculative_config=speculative).create_engine_config()
        runner = LoopingRunner([(t + 1) % 4 for t in range(VOCAB)], set(), 64, 16)
        core = EngineCore(config, runner, tokenizer)
        core.add_request("a", {"prompt_token_ids": [0, 1, 2, 3, 0, 1]},
                         SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                        detokenize=False, logprobs=0))
        outputs = []
        steps = 0
        while core.has_unfinished_requests():
            scheduled = core.schedule()
            outputs += core.process(scheduled, runner.execute_model(scheduled))
            steps += 1
        return outputs[-1].outputs[0].token_ids, steps, core.statistics().spec_decoding

    plain, plain_steps, _ = run(None)
    tokens, steps, spec = run({**NGRAM, "prompt_lookup_min": 2})
    assert tokens == plain and len(tokens) == 30
    assert steps < plain_steps / 2
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens_per_pos[2] > 0


def run_steps(core: EngineCore, runner: LoopingRunner) -> list[tuple[int, dict[str, int]]]:
    """Every step until all requests finish: the requests it scheduled, and the draft
    tokens each one that samples carried (by the name it was added with)."""
    steps = []
    while core.has_unfinished_requests():
        scheduled = core.schedule()
        steps.append((len(scheduled.scheduled), {
            item.request_id.rsplit("-", 1)[0]: item.num_draft_tokens
            for item in scheduled.scheduled if item.sample}))
        core.process(scheduled, runner.execute_model(scheduled))
        assert len(steps) < 1000
    return steps


def test_no_step_speculates_while_more_requests_run_than_the_threshold(
        tokenizer: Any) -> None:
    """Three requests with ``disable_by_batch_size`` 2: no drafts while all three run,
    drafts again once the shortest has finished."""
    config = EngineArgs(model="triollm/tiny-demo", device="cpu", max_model_len=64,
                        speculative_config={**NGRAM, "prompt_lookup_min": 1,
                                            "disable_by_batch_size": 2}
                        ).create_engine_config()
    runner = LoopingRunner([(t + 1) % 4 for t in range(VOCAB)], set(), 64, 16)
    core = EngineCore(config, runner, tokenizer)
    for name, max_tokens in (("a", 6), ("b", 40), ("c", 40)):
        core.add_request(name, {"prompt_token_ids": [0, 1, 2, 3, 0, 1]},
                         SamplingParams(temperature=0, max_tokens=max_tokens,
                                        ignore_eos=True, detokenize=False))
    steps = run_steps(core, runner)
    assert all(not any(drafts.values()) for running, drafts in steps if running > 2)
    assert any(any(drafts.values()) for running, drafts in steps if running <= 2)
    assert sum(1 for running, _ in steps if running == 3) >= 5  # "a" ran a while


class RejectingRunner(LoopingRunner):
    """A model whose every draft is wrong: it never accepts one (its own tokens are
    still ``table[last]``, which prompt lookup goes on predicting)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        output = RunnerOutput()
        for item in scheduler_output.scheduled:
            sequence = self.sequences.setdefault(item.request_id,
                                                 list(item.prompt_token_ids))
            written = sequence[:item.start_position] + item.token_ids
            if item.sample:
                position = len(written) - 1 - item.num_draft_tokens
                token = self.next_token(written[position], position)
                sequence[position + 1:] = [token]
                output.sampled_token_ids[item.request_id] = token
                if item.num_draft_tokens:
                    output.more_token_ids[item.request_id] = []
            else:
                sequence[:] = written
        return output


def test_a_request_whose_drafts_keep_failing_pauses_then_tries_again(tokenizer: Any) -> None:
    from triollm.engine.speculative.speculator import ACCEPTANCE_WINDOW, PAUSE_STEPS

    config = EngineArgs(model="triollm/tiny-demo", device="cpu", max_model_len=128,
                        speculative_config={**NGRAM, "prompt_lookup_min": 1}
                        ).create_engine_config()
    runner = RejectingRunner([(t + 1) % 4 for t in range(VOCAB)], set(), 64, 16)
    core = EngineCore(config, runner, tokenizer)
    core.add_request("a", {"prompt_token_ids": [0, 1, 2, 3, 0, 1]},
                     SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                                    detokenize=False))
    drafted = [bool(drafts.get("a")) for _, drafts in run_steps(core, runner)]
    first = drafted.index(True)
    assert drafted[first:first + ACCEPTANCE_WINDOW] == [True] * ACCEPTANCE_WINDOW
    paused = drafted[first + ACCEPTANCE_WINDOW:first + ACCEPTANCE_WINDOW + PAUSE_STEPS]
    assert paused == [False] * PAUSE_STEPS
    assert drafted[first + ACCEPTANCE_WINDOW + PAUSE_STEPS] is True  # tries afresh
    spec = core.statistics().spec_decoding
    assert spec is not None and spec.num_draft_tokens > 0 and spec.num_accepted_tokens == 0


def test_the_stats_line_gives_the_acceptance_since_the_previous_line(
        caplog: pytest.LogCaptureFixture) -> None:
    from triollm.engine.speculative.speculator import SpecDecodingStatistics
    from triollm.engine.stats import EngineStatistics, LoggingStatLogger

    def statistics(drafts: int, drafted: int, accepted: int) -> EngineStatistics:
        return EngineStatistics(
            num_running=1, num_waiting=0, num_free_blocks=8, num_total_blocks=8,
            num_open_streams=1, num_preemptions=0, num_steps=0,
            spec_decoding=SpecDecodingStatistics(drafts, drafted, accepted, (accepted, 0)))

    stats_line = LoggingStatLogger("CPU", clock=lambda: 0.0)
    caplog.set_level(logging.INFO, logger="triollm.engine.stats")
    stats_line.log(statistics(4, 12, 6))
    stats_line.log(statistics(6, 18, 6))  # two more drafts, nothing accepted
    stats_line.log(statistics(6, 18, 6))  # no draft since: no figure
    lines = [record.getMessage() for record in caplog.records]
    assert "Draft acceptance rate: 50.0%, Mean acceptance length: 2.50" in lines[0]
    assert "Draft acceptance rate: 0.0%, Mean acceptance length: 1.00" in lines[1]
    assert "acceptance" not in lines[2]


def test_the_cli_flag_reaches_the_engine_and_older_flags_point_to_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    from triollm.cli import build_parser, engine_args_from_namespace, normalize_argv

    def parse(*argv: str) -> Any:
        return build_parser().parse_args(normalize_argv(["serve", "m", *argv]))

    engine = engine_args_from_namespace(parse("--speculative-config", json.dumps(NGRAM)))
    assert engine.speculative_config == json.dumps(NGRAM)
    assert parse().speculative_config is None
    for older in (["--num-speculative-tokens", "3"], ["--speculative-disable-by-batch-size", "4"],
                  ["--ngram-prompt-lookup-max", "4"], ["--speculative-disable-mqa-scorer"]):
        with pytest.raises(SystemExit):
            parse(*older)
        error = capsys.readouterr().err
        assert "--speculative-config" in error and older[0] in error
    assert parse("--disable-logprobs-during-spec-decoding", "False").speculative_config is None
    with pytest.raises(SystemExit):
        parse("--disable-logprobs-during-spec-decoding")  # True: logprobs are returned
    assert "returns the logprobs a request asks for" in capsys.readouterr().err
