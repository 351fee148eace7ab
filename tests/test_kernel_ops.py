"""A compiled quantized model's layers on triollm's own kernels are called through the
C++ op ``triollm::kernel_linear``: it gives what the Python op gives, bit for bit, at
every row count and on every path (OpenMP threads, the helper pool, AMX tiles), with and
without a bias and over grouped weights; its registry lets go of a layer with the
layer; a compiled model calls it and decodes as with the Python op; a bad call is an
error, not a crash; where the C++ does not build, layers keep the Python op."""

from __future__ import annotations

import ctypes
import gc
import logging
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import bf16_compiled_llm, graph_of_calls
from test_greedy_matches_transformers import PROMPTS
from triollm import SamplingParams
from triollm.model.cpu import kernel_ops
from triollm.model.cpu.build import KernelBuildError, load_pool
from triollm.model.cpu.helpers import set_spare_threads
from triollm.model.quantization import grouping, kernel_calls, linear
from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.runners import compile as runner_compile


def _layer(out_features: int, in_features: int, bits: int, bias: bool, seed: int = 0
           ) -> QuantizedLinear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    layer = quantized_or_plain(quantize_weight(weight, bits, 32 if bits == 4 else -1),
                               torch.randn(out_features, generator=generator) if bias
                               else None, torch.bfloat16)
    if not isinstance(layer, QuantizedLinear) or not kernel_calls._registers(layer.handle):
        pytest.skip("the C++ op takes layers on triollm's own int4/int8 kernels only")
    return layer


def _pool_jobs() -> int:
    counts = (ctypes.c_int64 * 3)()
    load_pool().triollm_pool_statistics(counts)
    return int(counts[0])


def _cpp(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    return torch.ops.triollm.kernel_linear(x, layer.handle, layer.out_features)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_the_cpp_op_gives_the_python_ops_products_bit_for_bit(bits: int, bias: bool) -> None:
    layer = _layer(48, 96, bits, bias)
    generator = torch.Generator().manual_seed(1)
    for spare in (0, 1):
        set_spare_threads(spare)
        try:
            for rows in (1, 3, 15, 16, 17, 40, 130):
                x = torch.randn(rows, 96, generator=generator).bfloat16()
                expected = linear.quantized_linear(x, layer.handle, 48)
                jobs = _pool_jobs()
                assert torch.equal(_cpp(x, layer), expected), (rows, spare)
                assert _pool_jobs() == jobs + spare  # on the helper pool where allowed
            batched = torch.randn(2, 5, 96, generator=generator).bfloat16()
            assert torch.equal(_cpp(batched, layer),
                               linear.quantized_linear(batched, layer.handle, 48))
            strided = torch.randn(96, 4, generator=generator).bfloat16().t()
            assert torch.equal(_cpp(strided, layer),
                               linear.quantized_linear(strided, layer.handle, 48))
        finally:
            set_spare_threads(0)
    assert _cpp(torch.empty(0, 96, dtype=torch.bfloat16), layer).shape == (0, 48)


@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_layers_are_one_cpp_call_with_the_same_outputs(bits: int) -> None:
    layers = [_layer(16 * (i + 1), 64, bits, bias=True, seed=i) for i in range(2)]
    x = torch.randn(3, 64).bfloat16()
    expected = [layer(x) for layer in layers]
    assert grouping.group_quantized_layers([(x, layer) for layer in layers]) == 1
    graph = graph_of_calls(linear.quantized_linear, [0, 0], [layer.handle for layer in layers])
    assert grouping.fuse_quantized_calls(graph) == 1
    assert kernel_calls.call_kernels_from_cpp(graph) == 1  # the group's one call
    targets = [node.target for node in graph.nodes if node.op == "call_function"]
    assert kernel_ops.kernel_linear_op() in targets and linear.quantized_linear not in targets
    got = torch.fx.GraphModule(torch.nn.Module(), graph)(x)
    for got_one, want in zip(got, expected, strict=True):
        assert torch.equal(got_one, want)


def test_the_registry_lets_go_of_a_layer_with_the_layer() -> None:
    gc.collect()  # earlier tests' layers, which would go below
    before = torch.ops.triollm.kernel_linear_count() if kernel_ops.load_kernel_ops() else 0
    layer = _layer(16, 64, 4, bias=True)
    handle = layer.handle
    assert torch.ops.triollm.kernel_linear_count() == before + 1
    assert handle in linear.registered_in_cpp
    del layer
    gc.collect()
    assert torch.ops.triollm.kernel_linear_count() == before
    assert handle not in linear.registered_in_cpp
    with pytest.raises(RuntimeError, match="no layer"):
        torch.ops.triollm.kernel_linear(torch.zeros(1, 64, dtype=torch.bfloat16), handle, 16)


def test_a_bad_call_is_an_error() -> None:
    layer = _layer(16, 64, 8, bias=False)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.triollm.kernel_linear(torch.zeros(1, 64), layer.handle, 16)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.triollm.kernel_linear(torch.zeros(1, 32, dtype=torch.bfloat16),
                                        layer.handle, 16)
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.triollm.kernel_linear(torch.zeros(1, 64, dtype=torch.bfloat16),
                                        layer.handle, 32)


def test_a_layout_that_does_not_fit_is_refused_at_registration() -> None:
    layer = _layer(16, 64, 4, bias=False)
    kernel = layer.kernel
    products = kernel_calls._products(kernel)
    assert products is not None
    register = torch.ops.triollm.register_kernel_linear
    good = (kernel.weight, kernel.scales, None, 64, 16, 32,  # type: ignore[attr-defined]
            products.product, products.pooled, 0, 0)
    assert register(-1, *good) is None
    torch.ops.triollm.unregister_kernel_linear(-1)
    for bad, match in (
            ((kernel.weight.flatten()[:8], *good[1:]), "int4 layout"),  # too few weights
            ((kernel.weight.float(), *good[1:]), "int4 layout"),
            ((*good[:2], torch.zeros(8, dtype=torch.bfloat16), *good[3:]), "bias"),
            ((*good[:3], 64, 24, *good[5:]), "multiple of 16"),
            ((*good[:6], 0, *good[7:]), "products"),
            ((*good[:5], 0, *good[6:]), "int8 layout")):
        with pytest.raises(RuntimeError, match=match):
            register(-1, *bad)
    with pytest.raises(RuntimeError, match="no layer"):
        torch.ops.triollm.kernel_linear(torch.zeros(1, 64, dtype=torch.bfloat16), -1, 16)


def test_a_compiled_model_calls_the_cpp_op_and_decodes_as_with_the_python_op(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python_calls: list[int] = []
    product = linear._product

    def counting(x: torch.Tensor, kernel: object, bias: torch.Tensor | None) -> torch.Tensor:
        out = product(x, kernel, bias)  # type: ignore[arg-type]
        python_calls.append(int(out.shape[-1]))
        return out

    monkeypatch.setattr(linear, "_product", counting)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    results = {}
    for cpp in (True, False):
        with monkeypatch.context() as patch:
            if not cpp:
                patch.setattr(runner_compile, "call_kernels_from_cpp", lambda graph: 0)
            llm = bf16_compiled_llm(llama_path, quantization="int4")
            layers = [module for module in llm.engine.runner.model.get_decoder().modules()
                      if isinstance(module, QuantizedLinear)]
            if not all(kernel_calls._products(layer.kernel) for layer in layers):
                pytest.skip("the C++ op takes layers on triollm's own kernels only")
            python_calls.clear()
            completion = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
            vocabulary = llm.engine.runner.model.config.vocab_size
            decoder_calls = [width for width in python_calls if width != vocabulary]
            results[cpp] = (completion, len(decoder_calls))
            del llm
            gc.collect()
    assert results[True][1] == 0, "a compiled decoder layer ran through the Python op"
    assert results[False][1] > 0
    assert results[True][0].token_ids == results[False][0].token_ids
    assert results[True][0].logprobs == results[False][0].logprobs


def test_without_a_cpp_compiler_layers_keep_the_python_op(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler() -> Path:
        raise subprocess.CalledProcessError(1, ["c++"], stderr="c++: not found")

    monkeypatch.setattr(kernel_ops, "_build", no_compiler)
    with pytest.raises(KernelBuildError, match="C\\+\\+ kernel ops"):
        kernel_ops._load()
    monkeypatch.setenv("TRIOLLM_STRICT_KERNELS", "0")
    with caplog.at_level(logging.WARNING):
        assert kernel_ops._load() is False
    assert ("the Python op of each compiled quantized layer and attention runs instead"
            in caplog.text)
    monkeypatch.setattr(kernel_ops, "load_kernel_ops", lambda: False)
    layer = quantized_or_plain(quantize_weight(torch.randn(16, 64), 4, 32), None,
                               torch.bfloat16)
    assert isinstance(layer, QuantizedLinear)
    graph = graph_of_calls(linear.quantized_linear, [0], [layer.handle])
    assert kernel_calls.call_kernels_from_cpp(graph) == 0
    assert [node.target for node in graph.nodes if node.op == "call_function"] == [
        linear.quantized_linear]
