"""Sampling parameters on a real tiny model, checked against values computed
directly from the model's logits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from triollm import LLM, RequestOutputKind, SamplingParams

PROMPT = "The gardener planted beans along the fence"


@pytest.fixture(scope="module")
def llm(llama_llm: LLM) -> LLM:
    return llama_llm


@pytest.fixture(scope="module")
def reference_model(llama_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


def greedy(llm: LLM, max_tokens: int = 16, **kwargs: object) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_seeded_sampling_ignores_what_else_is_in_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n) for n in (5, 30, 12)]
    batch = llm.generate(["Cats sleep in the sun", PROMPT, "Numbers help: one, two", "x"],
                         [others[0], params, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([PROMPT, PROMPT], [params, SamplingParams(seed=99, max_tokens=20)],
                         use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone
    assert again[1].outputs[0].token_ids != alone


def test_unseeded_sampling_varies_and_greedy_is_deterministic(llm: LLM) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=16)
    samples = {tuple(o.outputs[0].token_ids)
               for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)}
    assert len(samples) > 1
    assert greedy(llm) == greedy(llm)


def test_top_k_one_is_greedy(llm: LLM) -> None:
    assert greedy(llm) == llm.generate(
        PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=16), use_tqdm=False
    )[0].outputs[0].token_ids


def test_max_tokens_caps_length(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_stop_string_spanning_tokens_is_found_and_cut(llm: LLM, tokenizer: object) -> None:
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 12, "the model must write enough text for this test"
    stop = text[5:11]  # six characters that in general straddle token boundaries
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    tokens = greedy(llm)
    stop_token = tokens[2]
    first = tokens.index(stop_token)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                              stop_token_ids=[stop_token]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token
    # as vLLM: the stop token's text is left out, unless include_stop_str_in_output
    tokenizer = llm.get_tokenizer()
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                               stop_token_ids=[stop_token],
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert tokenizer.decode(tokens[:first]).startswith(out.text)
    assert kept.text == tokenizer.decode(tokens[: first + 1])
    assert len(kept.text) > len(out.text) and kept.text.startswith(out.text)
    held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=8,
                                               stop_token_ids=[stop_token]),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 8
    assert stop_token not in held.token_ids[:8]


@pytest.fixture(scope="module")
def eos_model(llama_path: Path, llama_llm: LLM, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[LLM, list[int]]:
    """The same weights, with the eos id set to the 4th token greedy decoding writes."""
    tokens = greedy(llama_llm)
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(llama_path, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = tokens[3]
    (path / "config.json").write_text(json.dumps(config))
    return LLM(str(path), dtype="float32", max_model_len=256,
               num_gpu_blocks_override=64), tokens


def test_eos_stops_and_ignore_eos_and_min_tokens(eos_model: tuple[LLM, list[int]]) -> None:
    llm, tokens = eos_model
    eos = tokens[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                                  ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens
    assert ignored.finish_reason == "length"
    held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=10),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 10 and eos not in held.token_ids[:10]


def test_logprobs_match_the_models_logits(llm: LLM, tokenizer: object,
                                          reference_model: torch.nn.Module) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                              prompt_logprobs=2), use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        logits = reference_model(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)

    assert completion.logprobs is not None and len(completion.logprobs) == 8
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs,
                                              strict=True)):
        row = expected[n_prompt - 1 + step]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy
        top = torch.topk(row, 3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
        total += row[token].item()
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)

    prompt_lps = out.prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == n_prompt
    assert prompt_lps[0] is None
    for position in range(1, n_prompt):
        entry = prompt_lps[position]
        assert entry is not None
        token = out.prompt_token_ids[position]
        row = expected[position - 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert len(set(entry) - {token}) <= 2


def test_prompt_logprobs_survive_chunked_prefill(llama_path: Path, llama_llm: LLM) -> None:
    whole = llama_llm
    chunked = LLM(str(llama_path), dtype="float32", max_model_len=256,
                  num_gpu_blocks_override=64, max_num_batched_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    a = whole.generate(PROMPT, params, use_tqdm=False)[0].prompt_logprobs
    b = chunked.generate(PROMPT, params, use_tqdm=False)[0].prompt_logprobs
    assert a is not None and b is not None and len(a) == len(b)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x is not None and y is not None and x.keys() == y.keys()
        for token in x:
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


def test_penalties_change_greedy_output_and_stay_finite(llm: LLM) -> None:
    plain = greedy(llm, max_tokens=24)
    for kwargs in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0},
                   {"presence_penalty": 2.0}):
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, logprobs=0,
                                                  **kwargs), use_tqdm=False)[0].outputs[0]  # type: ignore[arg-type]
        assert len(out.token_ids) == 24
        assert out.token_ids != plain, kwargs
        assert out.cumulative_logprob is not None and math.isfinite(out.cumulative_logprob)


def test_presence_penalty_discourages_repeats(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                              presence_penalty=2.0, frequency_penalty=2.0),
                       use_tqdm=False)[0].outputs[0]
    plain = greedy(llm, max_tokens=24)
    assert len(set(out.token_ids)) >= len(set(plain))


def test_allowed_token_ids_and_logit_bias_steer_a_real_batch(llm: LLM) -> None:
    plain = greedy(llm, max_tokens=12)
    allowed = [*sorted(set(plain[1:]))[:2], 40, 41]
    restricted = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True,
                                allowed_token_ids=allowed)
    forced = SamplingParams(temperature=0, max_tokens=12, logit_bias={77: 100.0})
    outputs = llm.generate([PROMPT] * 3, [restricted, forced, SamplingParams(
        temperature=0, max_tokens=12)], use_tqdm=False)
    assert set(outputs[0].outputs[0].token_ids) <= set(allowed)
    assert outputs[1].outputs[0].token_ids == [77] * 12
    assert outputs[2].outputs[0].token_ids == plain  # the neighbours in the batch are untouched


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm: LLM) -> None:
    tokens = llm.get_tokenizer().encode(PROMPT)
    assert len(tokens) > 4
    params = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=4)
    long_prompt = [5] * 300 + tokens  # longer than max_model_len=256 before truncation
    truncated, short, text = llm.generate(
        [tokens, tokens[-4:], {"prompt_token_ids": long_prompt}], params, use_tqdm=False)
    assert truncated.prompt_token_ids == tokens[-4:]
    assert truncated.outputs[0].token_ids == short.outputs[0].token_ids
    assert text.prompt_token_ids == tokens[-4:]
    [whole] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                  truncate_prompt_tokens=len(tokens) + 5),
                           use_tqdm=False)
    assert whole.prompt == PROMPT and whole.prompt_token_ids == tokens


def test_bad_words_never_appear_in_the_output(llm: LLM) -> None:
    from triollm.engine.inputs import bad_words_token_ids

    tokenizer = llm.get_tokenizer()
    plain = greedy(llm, max_tokens=16)
    # Words the model writes when left alone: one token, and a two-token stretch.
    words = [tokenizer.decode(plain[:1]), tokenizer.decode(plain[4:6])]
    sequences = bad_words_token_ids([w for w in words if w.strip()], tokenizer)
    assert sequences and any(len(s) > 1 for s in sequences)
    assert any(_contains(plain, s) for s in sequences)
    for params in (SamplingParams(temperature=0, max_tokens=16, bad_words=words),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=16, n=3,
                                  bad_words=words)):
        for completion in llm.generate(PROMPT, params, use_tqdm=False)[0].outputs:
            assert not any(_contains(completion.token_ids, s) for s in sequences)


def _contains(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[i:i + len(sequence)] == sequence for i in range(len(tokens)))


def test_n_samples_share_the_prompt(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_delta_outputs_concatenate_to_the_cumulative_result(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("delta", PROMPT, SamplingParams(temperature=0, max_tokens=20,
                                                       output_kind=RequestOutputKind.DELTA))
    engine.add_request("cumulative", PROMPT, SamplingParams(temperature=0, max_tokens=20))
    deltas_text, deltas_tokens, last = "", [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "delta":
                deltas_text += output.outputs[0].text
                deltas_tokens += output.outputs[0].token_ids
            else:
                last = output
    assert last is not None and last.finished
    assert deltas_text == last.outputs[0].text
    assert deltas_tokens == last.outputs[0].token_ids
