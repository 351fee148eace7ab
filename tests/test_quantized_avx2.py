"""The AVX2 int4/int8 kernel (model/quantization/avx2_kernels.py) gives the dequantized
fp32 product to bf16 rounding for any shape, group size and row count it takes (act
order included), the same bits on helper threads as on OpenMP; bf16 layers run on it
where the CPU has no AVX-512, float32 ones and weights whose scales fp16 cannot hold on
torch's kernels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.quantization import avx2_kernels
from triollm.model.quantization.avx2_kernels import (
    Avx2Int4Kernel,
    Avx2Int8Kernel,
    QuantizedGemm,
    load_quantized_gemm,
)
from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.weights import QuantizedWeight


def _gemm() -> QuantizedGemm:
    gemm = load_quantized_gemm()
    if gemm is None:
        pytest.skip("no AVX2, FMA and F16C without AVX-512 on this CPU")
    return gemm


def _weight(bits: int, out_features: int, in_features: int, group_size: int,
            act_order: bool, seed: int) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    weight = quantize_weight(torch.randn(out_features, in_features, generator=generator),
                             bits, group_size)
    if not act_order:
        return weight
    order = torch.randperm(in_features, generator=generator)
    return QuantizedWeight(weight.qweight[:, order], weight.scales, weight.zeros, bits=bits,
                           group_size=weight.group_size,
                           group_index=weight.groups()[order].int())


def _assert_computes(kernel: nn.Module | Avx2Int4Kernel | Avx2Int8Kernel,
                     weight: QuantizedWeight, rows: int, seed: int) -> None:
    x = torch.randn(rows, weight.in_features,
                    generator=torch.Generator().manual_seed(seed)).bfloat16()
    expected = nn.functional.linear(x.float(), weight.dequantize())
    got = kernel(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 37), blocks=st.integers(1, 4), groups=st.integers(1, 5),
       group_size=st.sampled_from([8, 16, 32, 64, 128]), act_order=st.booleans(),
       seed=st.integers(0, 2**16))
def test_int4_gives_the_dequantized_product(rows: int, blocks: int, groups: int,
                                            group_size: int, act_order: bool,
                                            seed: int) -> None:
    """Partial and whole chunks of 4 rows and units of 16, any multiple-of-8 group."""
    weight = _weight(4, 16 * blocks, group_size * groups, group_size, act_order, seed)
    kernel = Avx2Int4Kernel.build(_gemm(), weight)
    assert kernel is not None
    _assert_computes(kernel, weight, rows, seed)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 37), blocks=st.integers(1, 4), pairs=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_int8_gives_the_dequantized_product(rows: int, blocks: int, pairs: int,
                                            seed: int) -> None:
    """Any even input width (an odd count of input pairs included)."""
    weight = _weight(8, 16 * blocks, 2 * pairs, -1, False, seed)
    kernel = Avx2Int8Kernel.build(_gemm(), weight)
    assert kernel is not None
    _assert_computes(kernel, weight, rows, seed)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), bits=st.sampled_from([4, 8]), blocks=st.integers(1, 9),
       count=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_helpers_give_the_bits_of_openmp(rows: int, bits: int, blocks: int, count: int,
                                         seed: int) -> None:
    weight = _weight(bits, 16 * blocks, 64, 32 if bits == 4 else -1, False, seed)
    gemm = _gemm()
    kernel = (Avx2Int4Kernel.build if bits == 4 else Avx2Int8Kernel.build)(gemm, weight)
    assert kernel is not None
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    expected = kernel(x)
    cpu_helpers.set_spare_threads(count)
    try:
        got = kernel(x)
    finally:
        cpu_helpers.set_spare_threads(0)
    assert torch.equal(got, expected)


def test_bf16_layers_run_on_it_and_float32_ones_on_torchs_kernels() -> None:
    _gemm()
    for bits, group_size in ((4, 128), (4, -1), (8, -1)):
        weight = _weight(bits, 32, 256, group_size, False, 0)
        bf16 = quantized_or_plain(weight, torch.randn(32), torch.bfloat16)
        fp32 = quantized_or_plain(weight, None, torch.float32)
        assert isinstance(bf16, QuantizedLinear) and bf16.kernel.name == f"int{bits}-avx2"
        assert isinstance(fp32, QuantizedLinear) and fp32.kernel.name == f"int{bits}"


def test_scales_fp16_cannot_hold_stay_on_torchs_kernel() -> None:
    gemm = _gemm()
    weight = _weight(4, 16, 64, 32, False, 0)
    tiny = QuantizedWeight(weight.qweight, weight.scales * 1e-6, weight.zeros, bits=4,
                           group_size=32)
    assert Avx2Int4Kernel.build(gemm, tiny) is None
    layer = quantized_or_plain(tiny, None, torch.bfloat16)
    assert isinstance(layer, QuantizedLinear) and layer.kernel.name == "int4"


def test_an_avx512_cpu_keeps_torchs_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(avx2_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})
    load_quantized_gemm.cache_clear()
    try:
        assert load_quantized_gemm() is None
        layer = quantized_or_plain(_weight(4, 16, 64, 32, False, 0), None, torch.bfloat16)
        assert isinstance(layer, QuantizedLinear) and layer.kernel.name == "int4"
    finally:
        load_quantized_gemm.cache_clear()
