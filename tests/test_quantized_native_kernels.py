"""triollm's own int4/int8 kernels, AVX2's (model/quantization/avx2_kernels.py),
AVX-512's (avx512_kernels.py) and VNNI's (vnni_kernels.py), each give the dequantized
fp32 product to bf16 rounding for any shape, group size and row count it takes (act
order included), the same bits on helper threads as on OpenMP; bf16 layers run on the
best one this CPU has, float32 ones and weights whose scales fp16 cannot hold on
torch's kernels. Each test runs for the kernels the CPU has and skips the others."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from triollm.model.cpu import build
from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.quantization import avx2_kernels, avx512_kernels, vnni_kernels
from triollm.model.quantization.avx2_kernels import (
    Avx2Int4Kernel,
    Avx2Int8Kernel,
    QuantizedGemm,
    load_quantized_gemm,
)
from triollm.model.quantization.avx512_kernels import (
    Avx512Int4Kernel,
    Avx512Int8Kernel,
    load_avx512_gemm,
)
from triollm.model.quantization.kernels import QuantizedKernel
from triollm.model.quantization.linear import QuantizedLinear, quantized_or_plain
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.vnni_kernels import (
    VnniInt4Kernel,
    VnniInt8Kernel,
    load_vnni_gemm,
)
from triollm.model.quantization.weights import QuantizedWeight

Build = Callable[[QuantizedGemm, QuantizedWeight], QuantizedKernel | None]


@dataclass(frozen=True)
class Native:
    """One of triollm's kernel libraries: its loader and its two layouts."""

    suffix: str
    load: Callable[[], QuantizedGemm | None]
    int4: Build
    int8: Build
    needs: str

    def gemm(self) -> QuantizedGemm:
        gemm = self.load()
        if gemm is None:
            pytest.skip(f"no {self.needs} on this CPU")
        return gemm

    def build(self, bits: int, weight: QuantizedWeight) -> QuantizedKernel:
        kernel = (self.int4 if bits == 4 else self.int8)(self.gemm(), weight)
        assert kernel is not None
        return kernel


AVX2 = Native("avx2", load_quantized_gemm, Avx2Int4Kernel.build, Avx2Int8Kernel.build,
              "AVX2, FMA and F16C without AVX-512")
AVX512 = Native("avx512", load_avx512_gemm, Avx512Int4Kernel.build, Avx512Int8Kernel.build,
                "AVX-512 F and BW")
VNNI = Native("vnni", load_vnni_gemm, VnniInt4Kernel.build, VnniInt8Kernel.build,
              "AVX-512 F, BW, VBMI and VNNI")
each_native = pytest.mark.parametrize("native", [AVX2, AVX512, VNNI],
                                      ids=["avx2", "avx512", "vnni"])


def _best_native() -> Native:
    """The kernel ``quantized_or_plain`` takes on this CPU (skips without any)."""
    for native in (VNNI, AVX512, AVX2):
        if native.load() is not None:
            return native
    pytest.skip("no kernel of triollm's own for this CPU")


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


def _assert_computes(kernel: nn.Module | QuantizedKernel,
                     weight: QuantizedWeight, rows: int, seed: int) -> None:
    x = torch.randn(rows, weight.in_features,
                    generator=torch.Generator().manual_seed(seed)).bfloat16()
    expected = nn.functional.linear(x.float(), weight.dequantize())
    got = kernel(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


@each_native
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 37), blocks=st.integers(1, 4), groups=st.integers(1, 5),
       group_size=st.sampled_from([8, 16, 32, 64, 128]), act_order=st.booleans(),
       seed=st.integers(0, 2**16))
def test_int4_gives_the_dequantized_product(native: Native, rows: int, blocks: int,
                                            groups: int, group_size: int, act_order: bool,
                                            seed: int) -> None:
    """Partial and whole chunks of rows and units of 16, any multiple-of-8 group."""
    weight = _weight(4, 16 * blocks, group_size * groups, group_size, act_order, seed)
    _assert_computes(native.build(4, weight), weight, rows, seed)


@each_native
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 37), blocks=st.integers(1, 4), pairs=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_int8_gives_the_dequantized_product(native: Native, rows: int, blocks: int,
                                            pairs: int, seed: int) -> None:
    """Any even input width (an odd count of input pairs included)."""
    weight = _weight(8, 16 * blocks, 2 * pairs, -1, False, seed)
    _assert_computes(native.build(8, weight), weight, rows, seed)


@each_native
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), bits=st.sampled_from([4, 8]), blocks=st.integers(1, 9),
       count=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_helpers_give_the_bits_of_openmp(native: Native, rows: int, bits: int, blocks: int,
                                         count: int, seed: int) -> None:
    """The kernel's pooled entry point against its OpenMP one (with helpers the AVX-512
    kernel computes every row count itself, so here it does without them too)."""
    weight = _weight(bits, 16 * blocks, 64, 32 if bits == 4 else -1, False, seed)
    kernel = native.build(bits, weight)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    gemm = native.gemm()
    if isinstance(gemm, avx512_kernels.Avx512Gemm):  # the VNNI kernel's too
        with _row_thresholds(gemm, dequantize=None, tiles=None):
            expected = kernel(x)
    else:
        expected = kernel(x)
    cpu_helpers.set_spare_threads(count)
    try:
        got = kernel(x)
    finally:
        cpu_helpers.set_spare_threads(0)
    assert torch.equal(got, expected)


@each_native
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 12), bits=st.sampled_from([4, 8]),
       group_size=st.sampled_from([8, 16, 64, 128]), groups=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_a_rows_product_is_the_same_alone_and_in_a_batch(native: Native, rows: int,
                                                         bits: int, group_size: int,
                                                         groups: int, seed: int) -> None:
    """Bit for bit, on the kernel's own path (one row takes a loop of its own in the VNNI
    kernel; greedy decoding must not depend on what else is in the batch)."""
    width = group_size * groups
    weight = _weight(bits, 32, width, group_size if bits == 4 else -1, False, seed)
    kernel = native.build(bits, weight)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).bfloat16()
    gemm = native.gemm()
    with (_row_thresholds(gemm, dequantize=None, tiles=None)
          if isinstance(gemm, avx512_kernels.Avx512Gemm) else contextlib.nullcontext()):
        batch = kernel(x)
        for row in range(rows):
            assert torch.equal(kernel(x[row:row + 1]), batch[row:row + 1])


def test_bf16_layers_run_on_the_best_and_float32_ones_on_torchs_kernels() -> None:
    native = _best_native()
    for bits, group_size in ((4, 128), (4, -1), (8, -1)):
        weight = _weight(bits, 32, 256, group_size, False, 0)
        bf16 = quantized_or_plain(weight, torch.randn(32), torch.bfloat16)
        fp32 = quantized_or_plain(weight, None, torch.float32)
        assert isinstance(bf16, QuantizedLinear)
        assert bf16.kernel.name == f"int{bits}-{native.suffix}"
        assert isinstance(fp32, QuantizedLinear) and fp32.kernel.name == f"int{bits}"


@each_native
def test_scales_fp16_cannot_hold_stay_on_torchs_kernel(native: Native) -> None:
    gemm = native.gemm()
    weight = _weight(4, 16, 64, 32, False, 0)
    tiny = QuantizedWeight(weight.qweight, weight.scales * 1e-6, weight.zeros, bits=4,
                           group_size=32)
    assert native.int4(gemm, tiny) is None
    layer = quantized_or_plain(tiny, None, torch.bfloat16)
    assert isinstance(layer, QuantizedLinear) and layer.kernel.name == "int4"


def test_a_cpu_without_avx2_or_avx512_keeps_torchs_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    flags = {"sse4_2", "f16c"}
    monkeypatch.setattr(avx2_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    loaders = (load_quantized_gemm, load_avx512_gemm, load_vnni_gemm)
    for load in loaders:
        load.cache_clear()
    try:
        assert all(load() is None for load in loaders)
        layer = quantized_or_plain(_weight(4, 16, 64, 32, False, 0), None, torch.bfloat16)
        assert isinstance(layer, QuantizedLinear) and layer.kernel.name == "int4"
    finally:
        for load in loaders:
            load.cache_clear()


def test_an_avx512_cpu_takes_an_avx512_kernel_not_the_avx2_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    AVX512.gemm()
    monkeypatch.setattr(avx2_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})
    load_quantized_gemm.cache_clear()
    try:
        assert load_quantized_gemm() is None
        layer = quantized_or_plain(_weight(4, 16, 64, 32, False, 0), None, torch.bfloat16)
        assert isinstance(layer, QuantizedLinear)
        assert layer.kernel.name == f"int4-{_best_native().suffix}"
    finally:
        load_quantized_gemm.cache_clear()


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 150), bits=st.sampled_from([4, 8]), blocks=st.integers(1, 6),
       steps=st.integers(1, 12), per_slice=st.integers(1, 4), act_order=st.booleans(),
       tiles=st.booleans(), seed=st.integers(0, 2**16))
def test_many_rows_multiply_the_weight_dequantized_a_slice_at_a_time(
        rows: int, bits: int, blocks: int, steps: int, per_slice: int, act_order: bool,
        tiles: bool, seed: int) -> None:
    """Past its row thresholds (on AMX CPUs; here forced at any count) the AVX-512 kernel
    multiplies on AMX tiles, 32 outputs dequantized at a time (inputs a multiple of 32
    wide), or dequantizes slices of ``per_slice`` blocks of 16 outputs into bf16 for
    torch's ``linear``."""
    in_features = 8 * steps * (1 if bits == 8 else 2)
    weight = _weight(bits, 16 * blocks, in_features, in_features // 2 if bits == 4 else -1,
                     act_order and bits == 4, seed)
    kernel = AVX512.build(bits, weight)
    gemm = AVX512.gemm()
    assert isinstance(gemm, avx512_kernels.Avx512Gemm)
    saved = avx512_kernels.SLICE_ELEMENTS
    avx512_kernels.SLICE_ELEMENTS = 16 * per_slice * in_features
    try:
        with _row_thresholds(gemm, dequantize=1,
                             tiles=1 if tiles and gemm.tiles_from is not None else None):
            _assert_computes(kernel, weight, rows, seed)
    finally:
        avx512_kernels.SLICE_ELEMENTS = saved


@contextlib.contextmanager
def _row_thresholds(gemm: avx512_kernels.Avx512Gemm, dequantize: int | None,
                    tiles: int | None) -> Iterator[None]:
    """``gemm``'s row thresholds set, for the block: both layouts' dequantization for
    torch's ``linear`` from ``dequantize`` rows, the AMX tiles from ``tiles``."""
    saved = gemm.dequantize_int4_from, gemm.dequantize_int8_from, gemm.tiles_from
    gemm.dequantize_int4_from = gemm.dequantize_int8_from = dequantize
    gemm.tiles_from = tiles
    try:
        yield
    finally:
        gemm.dequantize_int4_from, gemm.dequantize_int8_from, gemm.tiles_from = saved


def test_the_row_thresholds_follow_the_cpu() -> None:
    gemm = AVX512.gemm()
    assert isinstance(gemm, avx512_kernels.Avx512Gemm)
    amx = "amx_bf16" in build.cpu_flags()
    assert gemm.dequantize_int4_from == (avx512_kernels.DEQUANTIZE_INT4_FROM_ROWS if amx
                                         else None)
    assert gemm.dequantize_int8_from == (avx512_kernels.DEQUANTIZE_INT8_FROM_ROWS if amx
                                         else None)
    assert gemm.tiles_from == (avx512_kernels.TILES_FROM_ROWS if amx else None)


def _held(weight: QuantizedWeight) -> torch.Tensor:
    """``weight`` dequantized as the native kernels hold it: int4's scales and zero
    terms in fp16, int8's scales in fp32."""
    if weight.bits == 8:
        return weight.dequantize()
    groups = weight.groups()
    scales = weight.scales.float()
    return (weight.qweight.float() * scales.half().float()[:, groups]
            - (scales * weight.zeros.float()).half().float()[:, groups])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), bits=st.sampled_from([4, 8]), blocks=st.integers(1, 3),
       octets=st.integers(1, 40), spread=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_the_vnni_kernel_rounds_each_input_by_at_most_2_14_of_its_blocks_largest(
        rows: int, bits: int, blocks: int, octets: int, spread: int, seed: int) -> None:
    """Inputs spanning ``spread`` binades (outliers, tiny values, zeros): each output is
    within bf16's rounding of itself plus, per block of inputs, 2^-14 of the block's
    largest input times the block's summed weight magnitudes (at every row count: the
    many-row path, which rounds the weight to bf16 instead, is off here)."""
    in_features = 8 * octets
    group_size = in_features if bits == 8 or octets % 2 else in_features // 2
    weight = _weight(bits, 16 * blocks, in_features, group_size if bits == 4 else -1,
                     False, seed)
    kernel = VNNI.build(bits, weight)
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, in_features, generator=generator)
         * 2.0 ** torch.randint(-spread, 1, (rows, in_features), generator=generator)
         * (torch.rand(rows, in_features, generator=generator) > 0.1)).bfloat16()
    dense = _held(weight)
    expected = nn.functional.linear(x.float(), dense)
    size = 128
    while in_features % size or (bits == 4 and group_size % size):
        size //= 2
    largest = x.float().abs().view(rows, -1, size).amax(-1)
    magnitudes = dense.abs().view(dense.shape[0], -1, size).sum(-1)
    bound = 2.0 ** -14 * largest @ magnitudes.T
    gemm = VNNI.gemm()
    assert isinstance(gemm, vnni_kernels.VnniGemm)
    with _row_thresholds(gemm, dequantize=None, tiles=None):
        error = (kernel(x).float() - expected).abs()
    assert bool((error <= 2.0 ** -8 * expected.abs() + 1.001 * bound + 1e-30).all())


def test_the_vnni_kernel_keeps_non_finite_inputs_to_their_rows() -> None:
    for bits in (4, 8):
        weight = _weight(bits, 32, 256, 128 if bits == 4 else -1, False, 0)
        kernel = VNNI.build(bits, weight)
        x = torch.randn(3, 256).bfloat16()
        x[1, 5] = float("nan")
        x[2, 200] = float("inf")
        got = kernel(x)
        assert bool(got[1].isnan().all()) and bool(got[2].isnan().all())
        expected = nn.functional.linear(x[:1].float(), weight.dequantize())
        torch.testing.assert_close(got[:1].float(), expected, rtol=1e-2,
                                   atol=1e-2 * float(expected.abs().max()))


def test_vnni_int8_widths_off_a_multiple_of_8_take_the_fp32_kernel() -> None:
    gemm = VNNI.gemm()
    assert isinstance(gemm, vnni_kernels.VnniGemm)
    weight = _weight(8, 16, 36, -1, False, 0)
    kernel = VNNI.build(8, weight)
    x = torch.randn(2, 36).bfloat16()
    assert torch.equal(kernel(x), gemm.fp32(x, kernel.weight, kernel.scales, 16, 0))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_vnni_kernel_rounds_to_nearest_under_its_blocks_scale(bits: int) -> None:
    """Each output reads one input of a block whose largest input is 2^10 times larger,
    so the input's rounding (to a multiple of 2^-13 of the largest: about 2^-4 of it)
    shows through bf16's: rounded to nearest, never truncated."""
    selector = torch.zeros(16, 128)
    selector[torch.arange(16), torch.arange(1, 17)] = 1.0
    weight = quantize_weight(selector, bits, 128 if bits == 4 else -1)
    kernel = VNNI.build(bits, weight)
    generator = torch.Generator().manual_seed(1)
    x = torch.zeros(3, 128)
    x[:, 0] = 1.0  # the block's largest: its scale is 2^-13
    x[:, 1:17] = 2.0 ** -10 * (1 + torch.rand(3, 16, generator=generator))
    x = x.bfloat16()
    step = 2.0 ** -13
    expected = (x[:, 1:17].float() / step).round() * step * _held(weight)[0, 1]
    assert not torch.equal(expected, x[:, 1:17].float() * _held(weight)[0, 1])
    torch.testing.assert_close(kernel(x).float(), expected, rtol=2.0 ** -8, atol=0)
