"""Bad input raises ValueError naming the field, before it reaches the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from triollm import LLM, EngineArgs, SamplingParams
from triollm.errors import UnsupportedModelError


@pytest.mark.parametrize(("field", "value"), [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
    ("prompt_logprobs", -1), ("seed", "x"), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logit_bias", {"5": 1.0}), ("logit_bias", {5: float("nan")}), ("logit_bias", {-1: 1.0}),
    ("allowed_token_ids", []), ("allowed_token_ids", [-3]), ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", 2.5), ("bad_words", [""]), ("bad_words", "word"),
    # A seed torch cannot take killed the engine's step (vLLM bounds it to int64).
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 1180591620717411303424),
    ("temperature", float("inf")), ("temperature", float("nan")), ("top_p", float("nan")),
    ("repetition_penalty", float("inf")), ("min_p", float("nan")), ("temperature", "1"),
    ("stop", ["a\ud800b"]), ("bad_words", ["\udfff"]),
])
def test_sampling_params_name_the_bad_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


@pytest.mark.parametrize(("field", "value"), [
    ("max_logprobs", -2), ("tensor_parallel_size", 0), ("block_size", 0), ("max_num_seqs", 0),
    ("gpu_memory_utilization", 1.5), ("kv_cache_space_gb", 0), ("scheduling_policy", "lifo"),
    ("dtype", "int8"), ("dtype", "float16"), ("device", "tpu"), ("max_model_len", 10**7),
    ("async_scheduling", "yes"),
])
def test_engine_args_name_the_bad_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value}).create_engine_config()


def test_fp16_on_cpu_explains_itself() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        EngineArgs(dtype="float16", device="cpu").create_engine_config()


def test_unchunked_prefill_needs_a_budget_of_max_model_len() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(enable_chunked_prefill=False, max_num_batched_tokens=64,
                   max_model_len=128).create_engine_config()


def test_kv_cache_too_small_for_one_sequence(llama_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(llama_path), max_model_len=256, block_size=16, num_gpu_blocks_override=4)


@pytest.fixture(scope="module")
def small_llm(llama_path: Path) -> LLM:
    return LLM(str(llama_path), dtype="float32", max_model_len=64, num_gpu_blocks_override=64)


@pytest.mark.parametrize(("prompt", "field"), [
    ("", "prompt"),
    ([], "prompt"),
    ({"prompt_token_ids": []}, "prompt"),
    ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
    ({"nothing": 1}, "prompt"),
    ("word " * 200, "max_model_len"),
    (3.5, "prompt"),
    ("a\ud800b", "prompt"),  # a lone surrogate: JSON can carry it, no tokenizer can
    ({"prompt_token_ids": 5}, "prompt_token_ids"),
    ({"prompt_token_ids": [5], "prompt": 7}, "prompt"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
])
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(
        small_llm: LLM, prompt: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        small_llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not small_llm.engine.has_unfinished_requests()
    out = small_llm.generate("still works", SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].finished


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_refused(small_llm: LLM, field: str) -> None:
    outside = 10**6
    value: Any = {outside: 1.0} if field == "logit_bias" else [1, outside]
    with pytest.raises(ValueError, match=field):
        small_llm.engine.add_request("v", "hi", SamplingParams(**{field: value}))
    assert not small_llm.engine.has_unfinished_requests()


def test_priority_needs_the_priority_policy(small_llm: LLM) -> None:
    with pytest.raises(ValueError, match="priority"):
        small_llm.engine.add_request("p", "hi", SamplingParams(), priority=1)


def test_architecture_without_attention_interface_is_refused(tmp_path: Path,
                                                             tokenizer: Any) -> None:
    config = transformers.FalconConfig(vocab_size=len(tokenizer), hidden_size=32,
                                       num_hidden_layers=1, num_attention_heads=2)
    transformers.FalconForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="Llama, Qwen2, Qwen3, Mistral, OPT, GPT-2"):
        LLM(str(tmp_path), num_gpu_blocks_override=64)


def test_extreme_seeds_with_several_samples_run(small_llm: LLM) -> None:
    """The seeds of an n > 1 request's samples stay in range at the edges."""
    for seed in (2**63 - 1, -(2**63)):
        [output] = small_llm.generate("hi", SamplingParams(n=2, seed=seed, max_tokens=3),
                                      use_tqdm=False)
        assert [len(c.token_ids) for c in output.outputs] == [3, 3]
    [again] = small_llm.generate("hi", SamplingParams(n=2, seed=2**63 - 1, max_tokens=3),
                                 use_tqdm=False)
    assert again.outputs[0].token_ids != [] and again.finished


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_beyond_max_logprobs_are_refused(small_llm: LLM, field: str) -> None:
    """More than ``max_logprobs`` (20, vLLM's default; never more than the vocabulary)
    is a ValueError, not a failed step."""
    with pytest.raises(ValueError, match=f"{field}: 21 .*max_logprobs=20"):
        small_llm.engine.add_request("lp", "hi", SamplingParams(**{field: 21}))
    assert not small_llm.engine.has_unfinished_requests()


def test_max_logprobs_minus_one_means_the_whole_vocabulary(llama_path: Path) -> None:
    llm = LLM(str(llama_path), dtype="float32", max_model_len=64,
              num_gpu_blocks_override=16, max_logprobs=-1)
    vocab = llm.engine.vocab_size
    [output] = llm.generate("hi", SamplingParams(max_tokens=1, logprobs=vocab),
                            use_tqdm=False)
    assert output.outputs[0].logprobs is not None
    assert len(output.outputs[0].logprobs[0]) >= vocab
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=vocab + 1), use_tqdm=False)


def test_the_callers_sampling_params_are_left_alone(small_llm: LLM) -> None:
    params = SamplingParams(n=2, seed=7, max_tokens=2, bad_words=["x"])
    before = repr(params), params.all_stop_token_ids, params.bad_words_token_ids
    small_llm.generate("hi", params, use_tqdm=False)
    assert (repr(params), params.all_stop_token_ids, params.bad_words_token_ids) == before
    assert params.seed == 7 and params.n == 2
