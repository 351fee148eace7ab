"""Quantized linear layers: each ``QuantizedWeight`` layout computes what its dequantized
weight computes, on torch's int4 or int8 kernel where one takes it (act order included)
and on a plain layer of the dequantized weight where none does; on-the-fly quantization
keeps the LM head and tied weights, and a compiled graph calls the layer as one op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import group_size_for, quantize_weight
from triollm.model.quantization.replace import (
    quantizable_layers,
    quantize_linear_layers,
    replace_linear_layers,
    weight_bytes,
)
from triollm.model.quantization.rescored_head import RescoredHead
from triollm.model.quantization.weights import QuantizedWeight


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


def assert_computes(layer: nn.Module, weight: QuantizedWeight, bias: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> None:
    x = torch.randn(2, 5, weight.in_features, generator=torch.Generator().manual_seed(1))
    expected = nn.functional.linear(x.to(dtype).float(), weight.dequantize(), bias)
    got = layer(x.to(dtype)).float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize(("bits", "group_size", "kernel"), [
    (4, 32, "int4"), (4, 64, "int4"), (4, 128, "int4"), (4, 256, "int4"),
    (4, 512, "int4"),  # wider than the kernel's groups: repeated scales
    (4, -1, "int4"),   # per channel
    (8, -1, "int8"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_layout_runs_on_its_kernel_and_computes_the_dequantized_product(
        bits: int, group_size: int, kernel: str, dtype: torch.dtype) -> None:
    weight = quantize_weight(random_weight(48, 1024), bits, group_size)
    bias = torch.randn(48)
    layer = quantized_or_plain(weight, bias, dtype)
    assert isinstance(layer, QuantizedLinear) and layer.kernel.name.split("-")[0] == kernel
    assert_computes(layer, weight, bias, dtype)


def test_quantization_error_is_within_half_a_step() -> None:
    original = random_weight(32, 256)
    for bits, group_size in ((8, -1), (4, 64)):
        weight = quantize_weight(original, bits, group_size)
        step = weight.scales[:, weight.groups()]
        assert ((weight.dequantize() - original).abs() <= step / 2 + 1e-6).all()
        assert int(weight.qweight.min()) >= 0 and int(weight.qweight.max()) < 2**bits


def test_act_order_groups_are_permuted_onto_the_int4_kernel() -> None:
    """GPTQ's desc_act: column k is in group group_index[k], groups interleaved."""
    grouped = quantize_weight(random_weight(32, 256), 4, 64)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(2))
    shuffled = QuantizedWeight(grouped.qweight[:, order], grouped.scales, grouped.zeros,
                               bits=4, group_size=64,
                               group_index=(torch.arange(256) // 64)[order].int())
    layer = quantized_or_plain(shuffled, None, torch.float32)
    assert isinstance(layer, QuantizedLinear) and layer.kernel.name == "int4"
    assert_computes(layer, shuffled, None)
    assert not torch.equal(shuffled.dequantize(), grouped.dequantize())


def test_what_no_kernel_takes_is_dequantized_into_a_plain_layer() -> None:
    grouped8 = quantize_weight(random_weight(32, 256), 8, -1)
    grouped8 = QuantizedWeight(grouped8.qweight, grouped8.scales.repeat(1, 4),
                               grouped8.zeros.repeat(1, 4), bits=8, group_size=64)
    odd_rows = quantize_weight(random_weight(24, 256), 4, 64)  # not a multiple of 16
    unequal = QuantizedWeight(odd_rows.qweight[:16], odd_rows.scales[:16],
                              odd_rows.zeros[:16], bits=4, group_size=64,
                              group_index=torch.tensor([0] * 100 + [1] * 28 + [2] * 64
                                                       + [3] * 64, dtype=torch.int32))
    for weight in (grouped8, odd_rows, unequal):
        layer = quantized_or_plain(weight, None, torch.float32)
        assert type(layer) is nn.Linear
        assert torch.equal(layer.weight, weight.dequantize())


def test_a_4_bit_channel_weight_int4_cannot_take_runs_on_int8() -> None:
    weight = quantize_weight(random_weight(24, 256), 4, -1)
    layer = quantized_or_plain(weight, None, torch.float32)
    assert isinstance(layer, QuantizedLinear) and layer.kernel.name == "int8"
    assert_computes(layer, weight, None)


def test_group_size_falls_back_to_one_the_layer_divides() -> None:
    assert group_size_for(896, 128) == 128
    assert group_size_for(64, 128) == 64
    assert group_size_for(192, 128) == 64
    assert group_size_for(96, 64) == 32
    assert group_size_for(100, 32) == 100  # per channel
    assert group_size_for(4096, -1) == 4096


def tiny_llama(tie: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                         tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_on_the_fly_quantization_keeps_the_embeddings_and_makes_the_head_int8(
        tie: bool) -> None:
    """The head computes on an int8 copy (a tied one, a ``RescoredHead``, outside a
    step's greedy rows); the embedding keeps its weight; the weights' bytes count the
    copies."""
    model = tiny_llama(tie)
    embedding = model.model.embed_tokens.weight
    values = embedding.clone()
    head = model.lm_head.weight.clone()
    before = weight_bytes(model)
    assert quantize_linear_layers(model, "int4", 128) == 14
    assert model.model.embed_tokens.weight is embedding and torch.equal(embedding, values)
    if tie:
        assert isinstance(model.lm_head, RescoredHead)
        assert model.lm_head.weight is embedding
    else:
        assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == 8
    assert model.get_output_embeddings() is model.lm_head
    x = torch.randn(3, 64)
    expected = nn.functional.linear(x, quantize_weight(head, 8, -1).dequantize())
    assert torch.allclose(model.lm_head(x), expected, atol=1e-4)
    assert quantizable_layers(model) == []
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear | RescoredHead)]
    assert len(quantized) == 15 and weight_bytes(model) < before
    tensors = {id(t): t.nbytes for t in [*model.parameters(), *model.buffers()]}
    assert weight_bytes(model) == sum(tensors.values()) + sum(m.nbytes for m in quantized)


def test_replacing_a_name_that_is_no_linear_layer_is_a_key_error() -> None:
    model = tiny_llama(False)
    weight = quantize_weight(model.model.layers[0].mlp.up_proj.weight, 8, -1)
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp"):
        replace_linear_layers(model, {"model.layers.0.mlp": weight})
    assert replace_linear_layers(model, {"model.layers.0.mlp.up_proj": weight}) == 1
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantizedLinear)


def test_a_compiled_graph_calls_the_layer_as_one_op() -> None:
    weight = quantize_weight(random_weight(32, 128), 4, 32)
    layer = quantized_or_plain(weight, torch.randn(32), torch.float32)
    x = torch.randn(3, 128)
    with torch.inference_mode():
        eager = layer(x)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    assert torch.allclose(eager, compiled)
