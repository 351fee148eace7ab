"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors) made offline by each format's
reference packing decode greedily like the same model dequantized and run by
transformers; each format's unpacking equals the packed weights exactly; methods and
schemes triollm cannot read are refused by name."""

from __future__ import annotations

import copy
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from helpers import transformers_greedy
from quantized_checkpoints import (
    build_quantized_checkpoint,
    quantization_config,
    quantize_layer,
)
from triollm import LLM, SamplingParams
from triollm.model.quantization.detect import checkpoint_format
from triollm.model.quantization.linear import QuantizedLinear

PROMPTS = ["Hello", "The lighthouse keeper counted the ships that passed each evening",
           "Questions and answers: What is the time?"]
MAX_TOKENS = 16


def _unpacking_cases() -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []
    for bits in (4, 8):
        for group_size in (32, 64, 128, -1):
            for sym in (True, False):
                for desc_act in (False, True):
                    for fmt in ("gptq", "gptq_v2"):
                        cases.append(("gptq", {"bits": bits, "group_size": group_size,
                                               "sym": sym, "desc_act": desc_act,
                                               "checkpoint_format": fmt}))
            for sym in (True, False):
                for actorder in (False, True):
                    cases.append(("compressed-tensors", {
                        "bits": bits, "group_size": None if group_size == -1 else group_size,
                        "sym": sym, "actorder": actorder}))
    cases += [("awq", {"group_size": g}) for g in (32, 64, 128, -1)]
    return cases


@pytest.mark.parametrize(("method", "settings"), _unpacking_cases(),
                         ids=lambda v: v if isinstance(v, str) else "-".join(
                             f"{k}={x}" for k, x in v.items()))
def test_unpacked_layer_equals_the_weight_the_reference_packer_wrote(
        method: str, settings: dict[str, Any]) -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 256, generator=generator) * 0.1
    layer = quantize_layer(method, weight, settings, generator)
    fmt = checkpoint_format(_config(quantization_config(method, settings)))
    assert fmt is not None
    unpacked = fmt.read_layer("layer", lambda name: layer.tensors[name.removeprefix("layer.")])
    assert unpacked.qweight.shape == (96, 256)
    assert unpacked.qweight.min() >= 0 and unpacked.qweight.max() < 2 ** unpacked.bits
    assert torch.equal(unpacked.dequantize(), layer.weight)
    assert not torch.equal(layer.weight, weight), "the packer must actually quantize"


# name -> (family, method, settings, engine arguments, shards, model config overrides)
END_TO_END: dict[str, tuple[str, str, dict[str, Any], dict[str, Any], int, dict[str, Any]]] = {
    "gptq-4bit-g128-sym-compiled": (
        "llama", "gptq", {"bits": 4, "group_size": 128, "sym": True, "desc_act": False,
                          "checkpoint_format": "gptq"}, {}, 1, {}),
    "gptq-4bit-g32-asym-desc_act-sharded": (
        "qwen2", "gptq", {"bits": 4, "group_size": 32, "sym": False, "desc_act": True,
                          "checkpoint_format": "gptq"}, {"enforce_eager": True}, 3, {}),
    "gptq-8bit-per_channel-asym-v2": (
        "llama", "gptq", {"bits": 8, "group_size": -1, "sym": False, "desc_act": False,
                          "checkpoint_format": "gptq_v2"}, {"enforce_eager": True}, 1, {}),
    "gptq-8bit-g64-sym-desc_act": (
        "qwen2", "gptq", {"bits": 8, "group_size": 64, "sym": True, "desc_act": True,
                          "checkpoint_format": "gptq"}, {"enforce_eager": True}, 1, {}),
    "awq-g128-tied_head": ("llama", "awq", {"group_size": 128}, {"enforce_eager": True}, 1,
                           {"tie_word_embeddings": True}),
    "awq-g64": ("qwen2", "awq", {"group_size": 64}, {"enforce_eager": True}, 1, {}),
    "w4a16-g128": ("llama", "compressed-tensors",
                   {"bits": 4, "group_size": 128, "sym": True, "actorder": False},
                   {"enforce_eager": True}, 1, {}),
    "w8a16-per_channel": ("qwen2", "compressed-tensors",
                          {"bits": 8, "group_size": None, "sym": True, "actorder": False},
                          {"enforce_eager": True}, 2, {}),
    "w4a16-g32-asym-actorder": ("qwen2", "compressed-tensors",
                                {"bits": 4, "group_size": 32, "sym": False, "actorder": True},
                                {"enforce_eager": True}, 1, {"tie_word_embeddings": True}),
}


#: Layouts no kernel takes (torch's int8 kernel has one symmetric scale per output
#: channel): their layers compute on the dequantized weight.
DEQUANTIZED = {"gptq-8bit-per_channel-asym-v2", "gptq-8bit-g64-sym-desc_act"}


@functools.cache
def _reference(path: Path) -> list[list[int]]:
    return transformers_greedy(path, PROMPTS, MAX_TOKENS, stop_at_eos=False)


@pytest.mark.parametrize("case", list(END_TO_END))
def test_quantized_checkpoint_decodes_like_transformers_on_its_dequantized_weights(
        case: str, tmp_path: Path, tokenizer: Any) -> None:
    family, method, settings, engine, shards, overrides = END_TO_END[case]
    checkpoint, reference = build_quantized_checkpoint(family, tmp_path, tokenizer, method,
                                                       settings, shards=shards, **overrides)
    if overrides.get("tie_word_embeddings"):
        assert not any("lm_head" in name for name in _tensor_names(checkpoint))
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=128,
              num_gpu_blocks_override=64, **engine)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _reference(reference)
    quantized = [module for module in llm.engine.runner.model.modules()
                 if isinstance(module, QuantizedLinear)]
    assert len(quantized) == (0 if case in DEQUANTIZED else 7 * 2)


def test_gptq_settings_in_quantize_config_json_are_read_when_quantization_names_gptq(
        tmp_path: Path, tokenizer: Any) -> None:
    """Older AutoGPTQ checkpoints keep their settings in quantize_config.json, not in
    config.json; vLLM reads that file for ``--quantization gptq``, and so does triollm."""
    checkpoint, reference = build_quantized_checkpoint(
        "llama", tmp_path, tokenizer, "gptq", {"bits": 4, "group_size": 64, "sym": False,
                                               "desc_act": False, "checkpoint_format": "gptq"})
    config = json.loads((checkpoint / "config.json").read_text())
    settings = config.pop("quantization_config")
    settings.pop("quant_method")
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "quantize_config.json").write_text(json.dumps(settings))
    llm = LLM(str(checkpoint), quantization="gptq", dtype="float32", max_model_len=128,
              num_gpu_blocks_override=64, enforce_eager=True)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _reference(reference)


@pytest.fixture(scope="module")
def awq_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, Path]:
    """An AWQ checkpoint of a Llama and its dequantized reference."""
    return build_quantized_checkpoint(
        "llama", tmp_path_factory.mktemp("awq"), tokenizer, "awq", {"group_size": 64})


@pytest.fixture(scope="module")
def awq_checkpoint(awq_model: tuple[Path, Path]) -> Path:
    return awq_model[0]


def test_quantized_checkpoint_embeds_like_transformers_as_a_pooling_model(
        awq_model: tuple[Path, Path], tokenizer: Any) -> None:
    """The bare model of a causal LM's quantized checkpoint: its tensors' names lose the
    base model's prefix."""
    from transformers import AutoModel

    checkpoint, reference = awq_model
    llm = LLM(str(checkpoint), runner="pooling", dtype="float32", max_model_len=128,
              enforce_eager=True)
    prompt = PROMPTS[1]
    got = torch.tensor(llm.embed([prompt], use_tqdm=False)[0].outputs.embedding)
    model = AutoModel.from_pretrained(reference, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(tokenizer(prompt, return_tensors="pt").input_ids).last_hidden_state
    expected = torch.nn.functional.normalize(hidden[0, -1], dim=0)
    assert torch.allclose(got, expected, atol=1e-4)


def _with_quantization_config(source: Path, target: Path, config: dict[str, Any]) -> Path:
    shutil.copytree(source, target)
    model_config = json.loads((target / "config.json").read_text())
    model_config["quantization_config"] = config
    (target / "config.json").write_text(json.dumps(model_config))
    return target


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
])
def test_checkpoint_of_an_unsupported_method_is_refused_by_name(
        config: dict[str, Any], named: str, awq_checkpoint: Path, tmp_path: Path) -> None:
    path = _with_quantization_config(awq_checkpoint, tmp_path / "model", config)
    with pytest.raises(ValueError, match=f"quantized with {named}.*cannot load"):
        LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
            enforce_eager=True)


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False, "sym": True},
     "GPTQ with bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
      "version": "gemv"}, "AWQ version 'gemv'"),
    ({**quantization_config("compressed-tensors", {"bits": 8, "group_size": None,
                                                   "sym": True, "actorder": False}),
      "format": "int-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized",
                                    "weights": {"num_bits": 8, "type": "int",
                                                "strategy": "channel", "symmetric": True},
                                    "input_activations": {"num_bits": 8, "type": "int",
                                                          "strategy": "token",
                                                          "dynamic": True}}}},
     "quantizes activations .*int8 activation GEMM"),
    ({**quantization_config("compressed-tensors", {"bits": 8, "group_size": None,
                                                   "sym": True, "actorder": False}),
      "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float",
                                                "strategy": "channel"}}}},
     "format 'float-quantized' is not supported"),
])
def test_unsupported_scheme_of_a_supported_method_is_refused(
        config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint_format(_config(config))


def test_quantization_naming_another_method_than_the_checkpoints_is_refused(
        awq_checkpoint: Path) -> None:
    config = AutoConfig.from_pretrained(awq_checkpoint)
    assert checkpoint_format(config, "awq") is not None
    assert checkpoint_format(config, "awq_marlin") is not None
    for method in ("gptq", "int4"):
        with pytest.raises(ValueError, match=rf"--quantization {method} does not match .*\(awq\)"):
            LLM(str(awq_checkpoint), quantization=method, dtype="float32", max_model_len=128,
                num_gpu_blocks_override=64, enforce_eager=True)


def test_quantization_naming_the_checkpoints_method_loads_it(awq_checkpoint: Path) -> None:
    llm = LLM(str(awq_checkpoint), quantization="awq", dtype="float32", max_model_len=128,
              num_gpu_blocks_override=64, enforce_eager=True)
    outputs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4


def test_quantization_naming_a_checkpoint_format_on_a_full_precision_model_is_refused(
        llama_path: Path) -> None:
    config = AutoConfig.from_pretrained(llama_path)
    with pytest.raises(ValueError, match=r"--quantization gptq .* not quantized"):
        checkpoint_format(config, "gptq")
    assert checkpoint_format(config) is None


def _config(quantization: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig()
    config.quantization_config = copy.deepcopy(quantization)
    return config


def _tensor_names(checkpoint: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


def test_gptqmodel_dynamic_rules_override_a_modules_bits_and_group_size() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 256, generator=generator) * 0.1
    base = {"bits": 4, "group_size": 128, "sym": True, "desc_act": False,
            "checkpoint_format": "gptq"}
    override = {**base, "bits": 8, "group_size": 32}
    config = {**quantization_config("gptq", base),
              "dynamic": {r"+:.*\.down_proj": {"bits": 8, "group_size": 32},
                          r"-:.*\.gate_proj": {}}}
    fmt = checkpoint_format(_config(config))
    assert fmt is not None
    for name, settings in [("model.layers.0.mlp.down_proj", override),
                           ("model.layers.0.mlp.up_proj", base)]:
        layer = quantize_layer("gptq", weight, settings, generator)
        unpacked = fmt.read_layer(name, functools.partial(_by_suffix, layer.tensors))
        assert (unpacked.bits, unpacked.group_size) == (settings["bits"],
                                                        settings["group_size"])
        assert torch.equal(unpacked.dequantize(), layer.weight)


def test_compressed_tensors_config_groups_apply_by_target_name_before_class() -> None:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 256, generator=generator) * 0.1
    four = {"bits": 4, "group_size": 64, "sym": True, "actorder": False}
    eight = {"bits": 8, "group_size": None, "sym": False, "actorder": False}
    config = quantization_config("compressed-tensors", four)
    eight_group = quantization_config("compressed-tensors", eight)["config_groups"]["group_0"]
    config["config_groups"] = {"group_0": config["config_groups"]["group_0"],
                               "group_1": {**eight_group, "targets": ["re:.*down_proj$"]}}
    fmt = checkpoint_format(_config(config))
    assert fmt is not None
    for name, settings in [("model.layers.1.mlp.down_proj", eight),
                           ("model.layers.1.self_attn.o_proj", four)]:
        layer = quantize_layer("compressed-tensors", weight, settings, generator)
        unpacked = fmt.read_layer(name, functools.partial(_by_suffix, layer.tensors))
        assert unpacked.bits == settings["bits"]
        assert torch.equal(unpacked.dequantize(), layer.weight)


def test_compressed_tensors_int_quantized_weight_only_reads_signed_int8() -> None:
    """W8A16 in ``int-quantized`` form: the int8 weight itself, a scale per channel."""
    generator = torch.Generator().manual_seed(5)
    signed = torch.randint(-128, 128, (48, 96), generator=generator, dtype=torch.int8)
    scales = (torch.rand(48, 1, generator=generator) / 100).half()
    tensors = {"weight": signed, "weight_scale": scales}
    config = quantization_config("compressed-tensors", {"bits": 8, "group_size": None,
                                                        "sym": True, "actorder": False})
    config["format"] = "int-quantized"
    config["config_groups"]["group_0"]["format"] = "int-quantized"
    fmt = checkpoint_format(_config(config))
    assert fmt is not None
    unpacked = fmt.read_layer("layer", lambda key: tensors[key.rpartition(".")[2]])
    assert torch.equal(unpacked.dequantize(), signed.float() * scales.float())


def _by_suffix(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return tensors[name.rpartition(".")[2]]
