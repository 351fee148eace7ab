"""N-gram speculative decoding on real (tiny, random-weight) models: outputs identical
to the same engine without it, token for token, offline, async and served; the
acceptance counters show that drafts were accepted; sampled outputs keep the target's
distribution."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from helpers import finish_and_abort_a_mix
from server_helpers import server_in_thread
from triollm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from triollm.model.draft_verify import continue_drafts
from triollm.model.sampler import SamplingRow, sample
from triollm.outputs import RequestOutput
from triollm.sampling_params import RequestOutputKind

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 8}
ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 256,
                          "num_gpu_blocks_override": 256}
#: Prompts the random models continue by repeating themselves (greedy), so prompt
#: lookup finds matches; and one with few repeats.
PROMPTS = [[20, 21, 22, 23] * 6, [40, 41, 42, 43, 44, 45] * 4, [7, 8] * 10,
           [100 + (i * 37) % 300 for i in range(30)]]


def token_prompts(prompts: list[list[int]] = PROMPTS) -> list[Any]:
    return [{"prompt_token_ids": p} for p in prompts]


def greedy(max_tokens: int = 40, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def tokens_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def accepted(llm: LLM) -> int:
    spec = llm.engine.statistics().spec_decoding
    assert spec is not None
    return spec.num_accepted_tokens


@pytest.fixture(scope="module")
def spec_llm(llama_path: Path) -> LLM:
    return LLM(str(llama_path), speculative_config=SPEC, **ENGINE)


def test_greedy_outputs_match_without_speculation_and_drafts_are_accepted(
        llama_llm: LLM, spec_llm: LLM) -> None:
    params = [greedy(40), greedy(40, logprobs=2), greedy(7), greedy(1)]
    before = accepted(spec_llm)
    plain = llama_llm.generate(token_prompts(), params)
    spec = spec_llm.generate(token_prompts(), params)
    assert tokens_of(spec) == tokens_of(plain)
    assert [len(t) for t in tokens_of(spec)] == [40, 40, 7, 1]
    assert accepted(spec_llm) > before
    for mine, theirs in zip(spec[1].outputs[0].logprobs or [],
                            plain[1].outputs[0].logprobs or [], strict=True):
        assert mine.keys() == theirs.keys()
        for token, logprob in mine.items():
            assert logprob.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
            assert logprob.rank == theirs[token].rank
    assert spec[1].outputs[0].cumulative_logprob == pytest.approx(
        plain[1].outputs[0].cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "opt", "gpt2"])
def test_every_other_family_decodes_the_same_greedy_tokens_with_speculation(
        tiny_models: dict[str, Path], family: str) -> None:
    """(Llama and Qwen2 above and below.)"""
    plain = LLM(str(tiny_models[family]), **ENGINE)
    spec = LLM(str(tiny_models[family]), speculative_config=SPEC, **ENGINE)
    params = greedy(24)
    assert tokens_of(spec.generate(token_prompts(PROMPTS[:3]), params)) == tokens_of(
        plain.generate(token_prompts(PROMPTS[:3]), params))
    assert accepted(spec) > 0


def test_stop_strings_and_max_tokens_cut_inside_an_accepted_run(
        llama_llm: LLM, spec_llm: LLM) -> None:
    [full] = llama_llm.generate(token_prompts(PROMPTS[:1]), greedy(40))
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for max_tokens in (2, 5, 11, 17):
        params = greedy(max_tokens, stop=[stop], detokenize=True)
        [plain] = llama_llm.generate(token_prompts(PROMPTS[:1]), params)
        [spec] = spec_llm.generate(token_prompts(PROMPTS[:1]), params)
        assert (spec.outputs[0].text, spec.outputs[0].token_ids,
                spec.outputs[0].finish_reason) == (
            plain.outputs[0].text, plain.outputs[0].token_ids, plain.outputs[0].finish_reason)


def test_seeded_sampling_draws_the_same_tokens_as_without_speculation_n_too(
        llama_llm: LLM, spec_llm: LLM) -> None:
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=seed, max_tokens=30,
                             ignore_eos=True, n=1 + seed % 2) for seed in range(4)]
    prompts = token_prompts([PROMPTS[0]] * 4)

    def samples(outputs: list[RequestOutput]) -> list[list[list[int]]]:
        return [[list(c.token_ids) for c in o.outputs] for o in outputs]

    before = accepted(spec_llm)
    assert samples(spec_llm.generate(prompts, params)) == samples(
        llama_llm.generate(prompts, params))
    assert accepted(spec_llm) > before


def test_requests_the_verifier_cannot_reproduce_do_not_speculate(
        llama_llm: LLM, spec_llm: LLM) -> None:
    params = [greedy(30, repetition_penalty=1.3), greedy(30, presence_penalty=0.5),
              greedy(30, frequency_penalty=0.4), greedy(30, min_tokens=20)]
    spec = spec_llm.engine.statistics().spec_decoding
    outputs = spec_llm.generate(token_prompts([PROMPTS[0]] * 4), params)
    assert tokens_of(outputs) == tokens_of(
        llama_llm.generate(token_prompts([PROMPTS[0]] * 4), params))
    after = spec_llm.engine.statistics().spec_decoding
    assert spec is not None and after is not None
    # min_tokens speculates only once it is reached: at most 10 steps' drafts.
    assert after.num_drafts - spec.num_drafts <= 10


def test_qwen2_with_a_tiny_cache_that_preempts_matches_without_speculation(
        tiny_models: dict[str, Path]) -> None:
    engine = {**ENGINE, "max_model_len": 96, "num_gpu_blocks_override": 24,
              "block_size": 4, "max_num_seqs": 4}
    path = str(tiny_models["qwen2"])
    prompts = token_prompts(PROMPTS * 2)
    plain_llm = LLM(path, **engine)
    plain = plain_llm.generate(prompts, greedy(30))
    del plain_llm
    spec_llm = LLM(path, speculative_config=SPEC, **engine)
    spec = spec_llm.generate(prompts, greedy(30))
    assert tokens_of(spec) == tokens_of(plain)
    assert spec_llm.engine.statistics().num_preemptions > 0
    assert accepted(spec_llm) > 0
    # Everything back, and the same prompts again hit the prefix cache.
    stats = spec_llm.engine.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert tokens_of(spec_llm.generate(prompts[:2], greedy(30))) == tokens_of(plain[:2])
    assert spec_llm.engine.statistics().prefix_cache_hits > stats.prefix_cache_hits
    # a mix of finishes and aborts mid-run, while drafts are in flight
    finish_and_abort_a_mix(spec_llm.engine, prompts)


@pytest.mark.anyio
async def test_async_streams_carry_several_tokens_per_event(
        llama_path: Path, llama_llm: LLM) -> None:
    args = AsyncEngineArgs(model=str(llama_path), speculative_config=SPEC,
                           disable_log_requests=True, **ENGINE)
    expected = tokens_of(llama_llm.generate(token_prompts(), greedy(40)))
    streamed: dict[int, list[list[int]]] = {}

    async def consume(engine: AsyncLLMEngine, index: int) -> None:
        params = greedy(40, output_kind=RequestOutputKind.DELTA)
        chunks = streamed.setdefault(index, [])
        async for output in engine.generate(token_prompts()[index], params, str(index)):
            chunks.append(list(output.outputs[0].token_ids))

    async with AsyncLLMEngine.from_engine_args(args) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(len(PROMPTS)):
                tasks.start_soon(consume, engine, index)
        spec = engine.statistics().spec_decoding
    assert [[t for chunk in streamed[i] for t in chunk] for i in range(len(PROMPTS))
            ] == expected
    assert spec is not None and spec.num_accepted_tokens > 0
    assert max(len(chunk) for chunks in streamed.values() for chunk in chunks) > 1


def test_served_completions_match_and_metrics_count_drafts(
        llama_path: Path, llama_llm: LLM) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), speculative_config=SPEC, **ENGINE))
    expected = tokens_of(llama_llm.generate(token_prompts(PROMPTS[:2]), greedy(24)))
    with server_in_thread(engine, served_model_names=("m",)) as server:
        for prompt, tokens in zip(PROMPTS[:2], expected, strict=True):
            reply = httpx.post(server.url + "/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}, timeout=60).json()
            assert reply["choices"][0]["token_ids"] == tokens
        metrics = httpx.get(server.url + "/metrics").text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode") and 'position="0"' not in line
              and "per_pos" not in line}
    assert counts["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < counts["vllm:spec_decode_num_accepted_tokens_total"] <= counts[
        "vllm:spec_decode_num_draft_tokens_total"]
    assert any(line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")
               and 'position="0"' in line and 'model_name="m"' in line
               for line in metrics.splitlines())


# -- the distribution ------------------------------------------------------------------

SAMPLES = 4000


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True)
               if p > 0)


def verified_tokens(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                    seed: int) -> list[int]:
    """What a step verifying ``drafts`` yields: the first token sampled as the runner's
    batch samples it, the rest through ``continue_drafts``."""
    generator = torch.Generator().manual_seed(seed)
    row = SamplingRow(params, generator, [], [])
    [first], _ = sample(logits[:1], [row], None)
    if first != drafts[0]:
        return [first]
    more, _ = continue_drafts(logits[1:], drafts[1:], row, None)
    return [first, *more]


#: The 99.9% quantile of chi-square with 7 degrees of freedom.
CHI2_7_999 = 24.32


def test_sampled_tokens_keep_the_targets_distribution() -> None:
    """Token frequencies at each position of a verified step against the exact
    (temperature-scaled) softmax; the same test fails an accept-if-likely rule
    that does not renormalise, so it can tell."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    params = SamplingParams(temperature=0.8, max_tokens=4)
    probs = [torch.softmax(logits[i] / 0.8, dim=-1).tolist() for i in range(3)]
    # the most likely token first, then the second most likely
    drafts = [int(logits[0].argmax()), int(logits[1].topk(2).indices[1])]
    counts = [[0] * 8 for _ in range(3)]
    for seed in range(SAMPLES):
        for position, token in enumerate(verified_tokens(logits, drafts, params, seed)):
            counts[position][token] += 1
    for position in range(3):
        assert chi_square(counts[position], probs[position]) < CHI2_7_999, position
    # a token after each position exactly when the draft there held
    assert sum(counts[1]) == counts[0][drafts[0]]
    assert sum(counts[2]) == counts[1][drafts[1]] > 200

    def wrong_rule(seed: int) -> int:  # accept x with p(x), else sample p (x not removed)
        generator = torch.Generator().manual_seed(seed)
        if torch.rand((), generator=generator) < probs[0][drafts[0]]:
            return drafts[0]
        return int(torch.multinomial(torch.tensor(probs[0]), 1, generator=generator))

    wrong = [0] * 8
    for seed in range(SAMPLES):
        wrong[wrong_rule(seed)] += 1
    assert chi_square(wrong, probs[0]) > CHI2_7_999
    assert math.isclose(sum(probs[0]), 1.0, rel_tol=1e-5)
