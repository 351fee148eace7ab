"""On-the-fly weight-only quantization (``quantization="int8"`` / ``"int4"``) of real
transformers models: greedy tokens in float32 equal transformers' ``generate`` on the same
model with its weights replaced by the dequantized ones, eager and compiled, with a LoRA
adapter over the quantized base, and for a pooling model; prompt log-likelihoods agree
with the dequantized model's, in bfloat16 within a bound; unknown methods are refused
naming them."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from helpers import peft_greedy
from test_greedy_matches_transformers import MAX_TOKENS, PROMPTS, reference
from triollm import LLM, LoRARequest, SamplingParams
from triollm.engine.args import EngineArgs
from triollm.model.quantization.linear import QuantizedLinear
from triollm.model.quantization.lm_head import HEAD_BITS, lm_head_name
from triollm.model.quantization.methods import ON_THE_FLY_BITS
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.replace import quantizable_layers

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
LONG_TEXT = " ".join(PROMPTS * 2)


def dequantized_copy(path: Path, target: Path, method: str, group_size: int,
                     auto: Any = AutoModelForCausalLM) -> Path:
    """``path``'s model saved under ``target`` with each layer on-the-fly quantization
    replaces holding its quantized weight, dequantized to float32 (the LM head its
    int8 one, untied from the embedding)."""
    if not target.exists():
        shutil.copytree(path, target)
        model = auto.from_pretrained(path, dtype=torch.float32)
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name in quantizable_layers(model):
                weight = modules[name].weight
                weight.copy_(quantize_weight(weight, ON_THE_FLY_BITS[method],
                                             group_size).dequantize())
            head_name = lm_head_name(model)
            if head_name is not None:
                head = model.get_submodule(head_name)
                head.weight = torch.nn.Parameter(
                    quantize_weight(head.weight, HEAD_BITS, -1).dequantize())
                model.config.tie_word_embeddings = False
        model.save_pretrained(target)
    return target


def quantized_llm(path: Path, method: str, group_size: int = 128, **args: Any) -> LLM:
    llm = LLM(str(path), quantization=method, quantization_group_size=group_size,
              **{"dtype": "float32", "max_model_len": 512, "num_gpu_blocks_override": 256,
                 **args})
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 15, "every decoder projection and the head should run quantized"
    return llm


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dequantized")


@pytest.mark.parametrize(("method", "group_size"), [("int8", 128), ("int4", 128),
                                                    ("int4", 32)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers_on_the_dequantized_weights(
        family: str, method: str, group_size: int, tiny_models: dict[str, Path],
        copies: Path) -> None:
    path = tiny_models[family]
    copy = dequantized_copy(path, copies / f"{family}-{method}-{group_size}", method,
                            group_size)
    llm = quantized_llm(path, method, group_size)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference(copy)
    ids = [5, 17, 42, 99, 7, 300, 12]
    assert transformers_logprobs(copy, ids) != transformers_logprobs(path, ids), (
        "quantizing should change the model's outputs")


def prompt_logprobs(llm: LLM, token_ids: list[int]) -> list[float]:
    output = llm.generate({"prompt_token_ids": token_ids},
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert output.prompt_logprobs is not None
    return [entry[token].logprob for entry, token in
            zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)
            if entry is not None]


def transformers_logprobs(path: Path, token_ids: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    picked = logits.log_softmax(-1).gather(1, torch.tensor(token_ids[1:])[:, None])
    return picked[:, 0].tolist()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_prompt_log_likelihood_agrees_with_the_dequantized_model(
        method: str, tiny_models: dict[str, Path], copies: Path, tokenizer: Any) -> None:
    """Token by token in float32; over the whole text in bfloat16, where the kernels
    compute (and the scales are held) in bfloat16."""
    path = tiny_models["llama"]
    token_ids = tokenizer(LONG_TEXT).input_ids
    assert len(token_ids) > 250
    expected = transformers_logprobs(
        dequantized_copy(path, copies / f"llama-{method}-128", method, 128), token_ids)
    exact = prompt_logprobs(quantized_llm(path, method), token_ids)
    assert max(abs(a - b) for a, b in zip(exact, expected, strict=True)) < 1e-3
    bf16 = prompt_logprobs(quantized_llm(path, method, dtype="bfloat16"), token_ids)
    mean_expected = sum(expected) / len(expected)
    mean_bf16 = sum(bf16) / len(bf16)
    assert abs(mean_bf16 - mean_expected) < 0.002 * abs(mean_expected)
    assert math.isfinite(mean_bf16)


def test_compiled_forward_gives_the_eager_tokens(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama"]
    eager = quantized_llm(path, "int4", optimization_level=0).generate(
        PROMPTS, GREEDY, use_tqdm=False)
    compiled = quantized_llm(path, "int4", optimization_level=2, cpu_threads=1)
    assert compiled.engine.runner.compiled, "the model should have compiled"
    outputs = compiled.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in eager]


def test_a_lora_adapter_over_the_quantized_base_matches_peft_over_the_dequantized(
        lora_models: dict[str, Path], copies: Path, tokenizer: Any) -> None:
    base = dequantized_copy(lora_models["llama"], copies / "llama-int8-128", "int8", 128)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:3]]
    llm = quantized_llm(lora_models["llama"], "int8", enable_lora=True, max_loras=2,
                        max_lora_rank=16)
    adapter = LoRARequest("all4", 1, str(lora_models["all4"]))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           use_tqdm=False, lora_request=adapter)
    expected = peft_greedy(base, lora_models["all4"], prompts, 8)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert expected != peft_greedy(base, None, prompts, 8)


def test_a_pooling_model_embeds_like_its_dequantized_copy(
        pooling_models: dict[str, Path], copies: Path) -> None:
    path = pooling_models["qwen2"]
    copy = dequantized_copy(path, copies / "qwen2-embed-int8", "int8", 128, auto=AutoModel)
    texts = ["a short text", "another one, somewhat longer than the first"]
    args = {"dtype": "float32", "max_model_len": 128}
    quantized = LLM(str(path), quantization="int8", **args).embed(texts, use_tqdm=False)
    expected = LLM(str(copy), **args).embed(texts, use_tqdm=False)
    for got, want in zip(quantized, expected, strict=True):
        assert torch.allclose(torch.tensor(got.outputs.embedding),
                              torch.tensor(want.outputs.embedding), atol=1e-4)


@pytest.mark.parametrize(("args", "message"), [
    ({"quantization": "fp8"}, "quantization: the quantization method 'fp8' is not supported"),
    ({"quantization": "int4", "quantization_group_size": 48},
     "quantization_group_size: must be -1 (per channel) or a positive multiple of 32"),
])
def test_unknown_methods_and_group_sizes_are_refused_naming_them(
        args: dict[str, Any], message: str, llama_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(model=str(llama_path), **args).create_engine_config()
