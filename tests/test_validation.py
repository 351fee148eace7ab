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
])
def test_sampling_params_name_the_bad_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


@pytest.mark.parametrize(("field", "value"), [
    ("tensor_parallel_size", 2), ("block_size", 0), ("max_num_seqs", 0),
    ("gpu_memory_utilization", 1.5), ("kv_cache_space_gb", 0), ("scheduling_policy", "lifo"),
    ("dtype", "int8"), ("dtype", "float16"), ("device", "tpu"), ("max_model_len", 10**7),
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
