"""The sampler's filters and penalties, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from triollm.model.sampler import SamplingRow, sample
from triollm.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, times: int = 2000,
         output: list[int] | None = None) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    rows = [SamplingRow(params, None, [0], list(output or [])) for _ in range(times)]
    tokens, _ = sample(logits.expand(times, -1).clone(), rows, generator)
    return tokens


@pytest.mark.parametrize(("kwargs", "allowed"), [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.7}, {0, 1}),  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: keep two
    ({"top_p": 0.5}, {0}),
    ({"min_p": 0.2}, {0, 1, 2}),  # threshold 0.2 * 0.5 = 0.1
    ({"top_k": 3, "top_p": 0.9}, {0, 1, 2}),
    ({}, {0, 1, 2, 3}),
])
def test_filters_keep_exactly_the_expected_tokens(kwargs: dict[str, float],
                                                  allowed: set[int]) -> None:
    assert set(draw(SamplingParams(temperature=1.0, **kwargs))) == allowed  # type: ignore[arg-type]


def test_sampling_follows_the_softmax_distribution() -> None:
    tokens = draw(SamplingParams(temperature=1.0), times=8000)
    for token, p in enumerate(PROBS.tolist()):
        frequency = tokens.count(token) / len(tokens)
        assert abs(frequency - p) < 4 * math.sqrt(p * (1 - p) / len(tokens))


def test_temperature_sharpens_and_flattens() -> None:
    cold = draw(SamplingParams(temperature=0.2)).count(0)
    hot = draw(SamplingParams(temperature=5.0)).count(0)
    assert cold > 1800 and hot < 800


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    positive = torch.tensor([[2.0, 1.9]])
    assert sample(positive.clone(), [SamplingRow(params, None, [0], [])], None)[0] == [1]
    negative = torch.tensor([[-1.0, -1.5]])
    assert sample(negative.clone(), [SamplingRow(params, None, [9], [0])], None)[0] == [1]
    assert sample(negative.clone(), [SamplingRow(params, None, [9], [1])], None)[0] == [0]


def test_frequency_and_presence_penalties_subtract_per_occurrence() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.4), None, [2],
                      [0, 0])
    assert sample(logits.clone(), [row], None)[0] == [1]  # 3.0 - 0.8 = 2.2 < 2.5
    row = SamplingRow(SamplingParams(temperature=0, presence_penalty=0.4), None, [2], [0, 0])
    assert sample(logits.clone(), [row], None)[0] == [0]  # 3.0 - 0.4 = 2.6 > 2.5


def test_min_tokens_blocks_stop_tokens_until_reached() -> None:
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[0])
    params.all_stop_token_ids = {0}
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    early = SamplingRow(params, None, [2], [1])
    late = SamplingRow(params, None, [2], [1, 1])
    assert sample(logits.clone().repeat(2, 1), [early, late], None)[0] == [1, 0]


def test_logprobs_report_rank_and_top_k_of_the_raw_logits() -> None:
    params = SamplingParams(temperature=1.0, logprobs=2, seed=3)
    row = SamplingRow(params, torch.Generator().manual_seed(3), [0], [])
    tokens, logprobs = sample(LOGITS[None].clone(), [row], None)
    entry = logprobs[0]
    assert entry is not None
    assert entry.token_ids[0] == tokens[0]
    assert entry.logprobs[0] == pytest.approx(math.log(PROBS[tokens[0]].item()), abs=1e-5)
    assert entry.ranks[0] == tokens[0] + 1  # PROBS is sorted descending
    assert entry.token_ids[1:] == [0, 1] and entry.ranks[1:] == [1, 2]


def test_allowed_token_ids_restrict_sampling_and_greedy() -> None:
    assert set(draw(SamplingParams(temperature=1.0, allowed_token_ids=[1, 3]))) == {1, 3}
    greedy = SamplingParams(temperature=0, allowed_token_ids=[2, 3])
    assert sample(LOGITS[None].clone(), [SamplingRow(greedy, None, [0], [])], None)[0] == [2]


def test_logit_bias_is_added_before_greedy_and_sampling() -> None:
    greedy = SamplingParams(temperature=0, logit_bias={3: 3.0})  # log .05 + 3 > log .5
    assert sample(LOGITS[None].clone(), [SamplingRow(greedy, None, [0], [])], None)[0] == [3]
    banned = draw(SamplingParams(temperature=1.0, logit_bias={0: -100.0}))
    assert 0 not in banned and set(banned) == {1, 2, 3}


def test_bad_words_ban_the_token_that_would_complete_them() -> None:
    params = SamplingParams(temperature=1.0)
    params.bad_words_token_ids = [[1], [2, 0]]  # "1" alone; "0" only right after "2"
    assert set(draw(params)) == {0, 2, 3}
    assert set(draw(params, output=[3, 2])) == {2, 3}
    assert set(draw(params, output=[2, 3])) == {0, 2, 3}
    greedy = SamplingParams(temperature=0)
    greedy.bad_words_token_ids = [[3, 2, 0]]
    assert sample(LOGITS[None].clone(), [SamplingRow(greedy, None, [0], [3, 2])], None)[0] == [1]
    assert sample(LOGITS[None].clone(), [SamplingRow(greedy, None, [0], [2, 2])], None)[0] == [0]


def test_allowed_tokens_and_bias_leave_other_rows_and_raw_logprobs_alone() -> None:
    biased = SamplingParams(temperature=0, logit_bias={3: 5.0}, logprobs=0)
    plain = SamplingParams(temperature=0, logprobs=0)
    rows = [SamplingRow(biased, None, [0], []), SamplingRow(plain, None, [0], [])]
    tokens, logprobs = sample(LOGITS[None].repeat(2, 1), rows, None)
    assert tokens == [3, 0]
    biased_entry = logprobs[0]
    assert biased_entry is not None  # logprobs are the model's, before the bias (as vLLM)
    assert biased_entry.logprobs[0] == pytest.approx(math.log(0.05), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_callers_logits_are_left_as_they_were(dtype: torch.dtype) -> None:
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 5.0},
                            min_tokens=4, stop_token_ids=[1], allowed_token_ids=[0, 1, 2])
    logits = LOGITS[None].repeat(2, 1).to(dtype)
    before = logits.clone()
    rows = [SamplingRow(params, None, [0, 2], [2]), SamplingRow(params, None, [3], [])]
    sample(logits, rows, None)
    assert torch.equal(logits, before)
