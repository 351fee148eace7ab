"""Draft-model speculative decoding on tiny random-weight models: a draft that is the
target with noisy weights (so that some drafts are accepted and some not), and a
smaller draft of the same vocabulary. Greedy outputs identical to the target's alone,
offline, async and served, with a tiny cache that preempts; every block back after
finishes and aborts; vLLM's general rejection rule keeps the target's distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from helpers import finish_and_abort_a_mix
from server_helpers import server_in_thread
from test_speculative_models import ENGINE, PROMPTS, greedy, token_prompts, tokens_of
from triollm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from triollm.model.draft_verify import rejection_sample
from triollm.model.sampler import SamplingRow
from triollm.sampling_params import RequestOutputKind
from triollm.testing import build_tiny_model, tiny_config


def draft_spec(model: Path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k,
            "disable_by_batch_size": 8}


def noisy_copy(target: Path, directory: Path, noise: float) -> Path:
    """The target with Gaussian noise added to its weights: it agrees with the target
    often, not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(target).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path],
           tokenizer: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {
        "noisy-llama": noisy_copy(tiny_models["llama"], root / "noisy-llama", 0.01),
        "noisy-qwen2": noisy_copy(tiny_models["qwen2"], root / "noisy-qwen2", 0.01),
        # one layer, another family: only the vocabulary is shared
        "small": build_tiny_model("gpt2", root / "small", tokenizer, seed=3,
                                  n_layer=1),
        "big-vocab": big_vocabulary(root / "big-vocab", tokenizer),
    }


def big_vocabulary(directory: Path, tokenizer: Any) -> Path:
    """A tiny Llama with 64 token ids more than ``tokenizer`` has."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", len(tokenizer) + 64)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def draft_llm(llama_path: Path, drafts: dict[str, Path]) -> LLM:
    return LLM(str(llama_path), speculative_config=draft_spec(drafts["noisy-llama"]),
               **ENGINE)


def spec_counts(llm: LLM) -> tuple[int, int]:
    spec = llm.engine.statistics().spec_decoding
    assert spec is not None
    return spec.num_draft_tokens, spec.num_accepted_tokens


def test_greedy_outputs_match_without_speculation_with_some_drafts_rejected(
        llama_llm: LLM, draft_llm: LLM) -> None:
    params = [greedy(40), greedy(40, logprobs=2), greedy(7), greedy(1)]
    drafted, accepted = spec_counts(draft_llm)
    plain = llama_llm.generate(token_prompts(), params)
    spec = draft_llm.generate(token_prompts(), params)
    assert tokens_of(spec) == tokens_of(plain)
    assert [len(t) for t in tokens_of(spec)] == [40, 40, 7, 1]
    more_drafted, more_accepted = spec_counts(draft_llm)
    assert 0 < more_accepted - accepted < more_drafted - drafted
    for mine, theirs in zip(spec[1].outputs[0].logprobs or [],
                            plain[1].outputs[0].logprobs or [], strict=True):
        assert mine.keys() == theirs.keys()


def test_a_smaller_draft_of_another_family_changes_nothing(
        llama_llm: LLM, llama_path: Path, drafts: dict[str, Path]) -> None:
    llm = LLM(str(llama_path), speculative_config=draft_spec(drafts["small"], k=2), **ENGINE)
    assert tokens_of(llm.generate(token_prompts(), greedy(30))) == tokens_of(
        llama_llm.generate(token_prompts(), greedy(30)))
    assert spec_counts(llm)[0] > 0


def test_a_draft_with_a_larger_vocabulary_is_refused(
        llama_path: Path, drafts: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*share the target's "
                                         r"tokenizer"):
        LLM(str(llama_path), speculative_config=draft_spec(drafts["big-vocab"]), **ENGINE)


def test_tiny_cache_preemption_prefix_caching_and_aborts_free_every_block(
        tiny_models: dict[str, Path], drafts: dict[str, Path]) -> None:
    engine = {**ENGINE, "max_model_len": 96, "num_gpu_blocks_override": 24,
              "block_size": 4, "max_num_seqs": 4}
    path = str(tiny_models["qwen2"])
    prompts = token_prompts(PROMPTS * 2)
    plain_llm = LLM(path, **engine)
    plain = plain_llm.generate(prompts, greedy(30))
    del plain_llm
    llm = LLM(path, speculative_config=draft_spec(drafts["noisy-qwen2"]), **engine)
    assert tokens_of(llm.generate(prompts, greedy(30))) == tokens_of(plain)
    stats = llm.engine.statistics()
    assert stats.num_preemptions > 0 and spec_counts(llm)[1] > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    # the prefix cache hits, its blocks hold the draft's keys too
    assert tokens_of(llm.generate(prompts[:2], greedy(30))) == tokens_of(plain[:2])
    # a mix of finishes and aborts mid-run
    core = llm.engine
    finish_and_abort_a_mix(core, prompts)
    core.step()  # the runner hears of the last finishes with the next step
    runner: Any = core.runner
    assert not runner.draft._computed and not runner._requests


def test_seeded_sampling_with_a_draft_is_reproducible(draft_llm: LLM) -> None:
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=20, ignore_eos=True,
                             n=1 + seed % 2) for seed in range(3)]
    prompts = token_prompts([PROMPTS[0]] * 3)
    first = [[list(c.token_ids) for c in o.outputs] for o in draft_llm.generate(prompts, params)]
    again = [[list(c.token_ids) for c in o.outputs] for o in draft_llm.generate(prompts, params)]
    assert first == again


@pytest.mark.anyio
async def test_async_and_served_outputs_match(
        llama_path: Path, llama_llm: LLM, drafts: dict[str, Path]) -> None:
    args = AsyncEngineArgs(model=str(llama_path), disable_log_requests=True,
                           speculative_config=draft_spec(drafts["noisy-llama"]), **ENGINE)
    expected = tokens_of(llama_llm.generate(token_prompts(), greedy(30)))
    streamed: dict[int, list[int]] = {}

    async def consume(engine: AsyncLLMEngine, index: int) -> None:
        params = greedy(30, output_kind=RequestOutputKind.DELTA)
        tokens = streamed.setdefault(index, [])
        async for output in engine.generate(token_prompts()[index], params, str(index)):
            tokens.extend(output.outputs[0].token_ids)

    async with AsyncLLMEngine.from_engine_args(args) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(len(PROMPTS)):
                tasks.start_soon(consume, engine, index)
        spec = engine.statistics().spec_decoding
    assert [streamed[i] for i in range(len(PROMPTS))] == expected
    assert spec is not None and spec.num_accepted_tokens > 0


def test_served_completions_match(llama_path: Path, llama_llm: LLM,
                                  drafts: dict[str, Path]) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), speculative_config=draft_spec(drafts["noisy-llama"]),
        **ENGINE))
    expected = tokens_of(llama_llm.generate(token_prompts(PROMPTS[:2]), greedy(24)))
    with server_in_thread(engine, served_model_names=("m",)) as server:
        for prompt, tokens in zip(PROMPTS[:2], expected, strict=True):
            reply = httpx.post(server.url + "/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}, timeout=60).json()
            assert reply["choices"][0]["token_ids"] == tokens
        metrics = httpx.get(server.url + "/metrics").text
    assert any(line.startswith("vllm:spec_decode_num_accepted_tokens_total")
               and float(line.rsplit(" ", 1)[1]) > 0 for line in metrics.splitlines())


# -- the distribution ------------------------------------------------------------------

SAMPLES = 4000
#: The 99.9% quantile of chi-square with 7 degrees of freedom.
CHI2_7_999 = 24.32


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True)
               if p > 0)


def test_drafts_sampled_from_a_draft_distribution_keep_the_targets() -> None:
    """Each trial draws two drafts from a draft distribution ``q`` that differs from
    the target's ``p``; the tokens at each position follow ``p`` exactly, and the
    first draft is accepted as often as vLLM's rule says (sum of min(p, q)), more than
    accepting only a draft the target samples itself would (sum of p * q)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    params = SamplingParams(temperature=0.8, max_tokens=4)
    p = torch.softmax(logits / 0.8, dim=-1)
    q = torch.softmax(torch.randn(2, 8) * 1.5, dim=-1)
    counts = [[0] * 8 for _ in range(3)]
    first_accepted = 0
    for seed in range(SAMPLES):
        generator = torch.Generator().manual_seed(seed)
        drafts = [int(torch.multinomial(q[j], 1, generator=generator)) for j in range(2)]
        row = SamplingRow(params, generator, [], [])
        tokens, _ = rejection_sample(logits, drafts, q, row, None)
        first_accepted += len(tokens) > 1
        for position, token in enumerate(tokens):
            counts[position][token] += 1
    for position in range(3):
        assert chi_square(counts[position], p[position].tolist()) < CHI2_7_999, position
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(first_accepted / SAMPLES - expected) < 0.03
    assert expected > float((p[0] * q[0]).sum()) + 0.1


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_lora_requests_speculate_and_match_without_speculation(
        method: str, tmp_path: Path, llama_path: Path, drafts: dict[str, Path]) -> None:
    from triollm.lora.request import LoRARequest
    from triollm.testing import build_lora_adapter

    first = LoRARequest("a", 1, str(build_lora_adapter(llama_path, tmp_path / "a", seed=5)))
    second = LoRARequest("b", 2, str(build_lora_adapter(llama_path, tmp_path / "b", seed=7)))
    adapters = [first, second, None, first]  # two adapters and the base in one batch
    engine = {**ENGINE, "enable_lora": True, "max_loras": 2}
    spec = (draft_spec(drafts["noisy-llama"]) if method == "draft_model" else
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "disable_by_batch_size": 8})
    plain = LLM(str(llama_path), **engine).generate(
        token_prompts(), greedy(30), lora_request=adapters)
    llm = LLM(str(llama_path), speculative_config=spec, **engine)
    assert tokens_of(llm.generate(token_prompts(), greedy(30), lora_request=adapters)
                     ) == tokens_of(plain)
    assert spec_counts(llm)[1] > 0


def test_the_cache_holds_fewer_blocks_as_each_costs_both_models_bytes(
        llama_path: Path, drafts: dict[str, Path]) -> None:
    engine = {"dtype": "float32", "max_model_len": 256, "kv_cache_space_gb": 0.001}
    alone = LLM(str(llama_path), **engine).engine.statistics().num_total_blocks
    # the noisy copy has the target's layers: a block costs twice the bytes
    both = LLM(str(llama_path), speculative_config=draft_spec(drafts["noisy-llama"]),
               **engine).engine.statistics().num_total_blocks
    assert both == alone // 2
