"""A compiled quantized model multiplies the layers that read one input (q, k and v;
gate and up) in one call each, over weights stored once, and gives the tokens and
log-probabilities it gives without the grouping; a group is fused only where exactly
its members share the input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import assert_grouping_keeps_outputs, bf16_compiled_llm, graph_of_calls
from test_greedy_matches_transformers import PROMPTS
from triollm import SamplingParams
from triollm.model.quantization import grouping, linear
from triollm.model.quantization.avx2_kernels import Avx2Int4Kernel, Avx2Int8Kernel
from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.runners import compile as runner_compile
from triollm.model.runners.precompiled import PrecompiledDecoder


def _native(layer: torch.nn.Module) -> bool:
    return isinstance(layer, QuantizedLinear) and isinstance(
        layer.kernel, Avx2Int4Kernel | Avx2Int8Kernel)


def _layer(out_features: int, seed: int, bits: int = 4) -> QuantizedLinear:
    weight = torch.randn(out_features, 64, generator=torch.Generator().manual_seed(seed))
    layer = quantized_or_plain(quantize_weight(weight, bits, 32 if bits == 4 else -1),
                               torch.randn(out_features), torch.bfloat16)
    if not _native(layer):
        pytest.skip("layers are grouped on triollm's own int4/int8 kernels only")
    assert isinstance(layer, QuantizedLinear)
    return layer


@pytest.mark.parametrize("bits", [4, 8])
def test_layers_on_one_input_are_one_call_with_the_same_outputs(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    calls: list[int] = []
    product = linear._product

    def counting(x: torch.Tensor, kernel: object, bias: torch.Tensor | None) -> torch.Tensor:
        out = product(x, kernel, bias)  # type: ignore[arg-type]
        calls.append(out.shape[-1])
        return out

    monkeypatch.setattr(linear, "_product", counting)
    # counted in Python: the C++ op (test_kernel_ops.py) would not pass through it
    monkeypatch.setattr(runner_compile, "call_kernels_from_cpp", lambda graph: 0)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    results = {}
    for grouped in (True, False):
        with monkeypatch.context() as patch:
            if not grouped:
                patch.setattr(runner_compile, "group_quantized_layers", lambda calls: 0)
            llm = bf16_compiled_llm(llama_path, quantization=f"int{bits}")
            decoder = llm.engine.runner.model.get_decoder()
            # compiled ahead of time, without guards, and not saved (handles are ours)
            assert isinstance(decoder._compiled_call_impl, PrecompiledDecoder)
            assert decoder._compiled_call_impl.directory is None
            attention = llm.engine.runner.model.model.layers[0].self_attn
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            if not all(_native(layer) for layer in projections):
                pytest.skip("layers are grouped on triollm's own int4/int8 kernels only")
            calls.clear()
            outputs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
            results[grouped] = (list(calls), outputs[0].outputs[0])
            shared = {layer.kernel.weight.untyped_storage().data_ptr()
                      for layer in projections}
            assert len(shared) == (1 if grouped else 3)
    config = llm.engine.runner.model.config
    steps = params.max_tokens
    head = [config.vocab_size] * (len(results[True][0]) // steps - 4 * config.num_hidden_layers)
    assert_grouping_keeps_outputs(config, steps, results[True], results[False], head)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_group_is_fused_only_where_exactly_its_members_share_the_input(bits: int) -> None:
    layers = [_layer(16 * (i + 1), i, bits) for i in range(3)]
    x = torch.randn(2, 64).bfloat16()
    expected = [layer(x) for layer in layers]
    assert grouping.group_quantized_layers([(x, layer) for layer in layers[:2]]) == 1
    first, second = (layer.kernel for layer in layers[:2])
    assert isinstance(first, Avx2Int4Kernel | Avx2Int8Kernel)
    assert isinstance(second, Avx2Int4Kernel | Avx2Int8Kernel)
    assert first.weight.data_ptr() + first.weight.nbytes == second.weight.data_ptr()
    assert first.scales.data_ptr() + first.scales.nbytes == second.scales.data_ptr()
    handles = [layer.handle for layer in layers]
    fused = graph_of_calls(linear.quantized_linear, [0, 0], handles[:2])
    assert grouping.fuse_quantized_calls(fused) == 1
    got_all = torch.fx.GraphModule(torch.nn.Module(), fused)(x)
    for got, want, layer in zip(got_all, expected[:2], layers[:2], strict=True):
        assert torch.equal(got, want) and torch.equal(layer(x), want)
    for inputs, members in (([0, 0, 0], handles), ([0, 1], handles[:2]),
                            ([0, 0], handles[1::-1])):
        graph = graph_of_calls(linear.quantized_linear, inputs, members)
        assert grouping.fuse_quantized_calls(graph) == 0


def test_layers_of_other_kinds_or_group_sizes_stay_apart() -> None:
    x = torch.randn(2, 64).bfloat16()
    int4, int8 = _layer(16, 0, 4), _layer(16, 1, 8)
    assert grouping.group_quantized_layers([(x, int4), (x, int8)]) == 0
    coarse = quantized_or_plain(quantize_weight(torch.randn(16, 64), 4, 64),
                                torch.randn(16), torch.bfloat16)
    assert grouping.group_quantized_layers([(x, _layer(16, 2, 4)), (x, coarse)]) == 0


def test_a_groups_handle_goes_with_its_layers() -> None:
    layers = [_layer(16, i) for i in range(2)]
    x = torch.randn(1, 64).bfloat16()
    assert grouping.group_quantized_layers([(x, layer) for layer in layers]) == 1
    members = tuple(layer.handle for layer in layers)
    group_handle = grouping._groups[members][0]
    assert group_handle in linear._registered
    del layers
    import gc

    gc.collect()
    assert members not in grouping._groups and group_handle not in linear._registered
