"""The AVX2 bf16 GEMM (model/cpu/gemm_avx2.py) gives the fp32 product to bf16 rounding
for any shape it takes (partial row tiles, one row, many rows, bias), the same bits on
helper threads as on OpenMP, and it is what bf16 layers and a tied LM head (on a packed
copy) run on where neither the AVX512-BF16 kernel nor oneDNN's bf16 packing is there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM

from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.cpu import packed_linear
from triollm.model.cpu.gemm import CpuGemm
from triollm.model.cpu.gemm_avx2 import load_avx2_gemm
from triollm.model.cpu.packed_linear import PackedLinear, pack_linear_layers


def _gemm() -> CpuGemm:
    gemm = load_avx2_gemm()
    if gemm is None:
        pytest.skip("no AVX2 and FMA on this CPU")
    return gemm


def _expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, float]:
    expected = nn.functional.linear(x.float(), weight.float(), bias)
    return expected, float(expected.abs().max()) if expected.numel() else 1.0


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 40), blocks=st.integers(1, 6), pairs=st.integers(1, 70),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_packed_product_is_the_fp32_one_to_bf16_rounding(
        rows: int, blocks: int, pairs: int, with_bias: bool, seed: int) -> None:
    """Any row count (full and partial tiles of 6 rows), any number of 16-wide output
    blocks, any even input width, with and without a bias."""
    gemm = _gemm()
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(16 * blocks, 2 * pairs, generator=generator).bfloat16()
    bias = torch.randn(16 * blocks, generator=generator) if with_bias else None
    x = torch.randn(rows, 2 * pairs, generator=generator).bfloat16()
    got = gemm(x, gemm.pack(weight), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 16 * blocks)
    expected, scale = _expected(x, weight, bias)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_rounding_is_to_nearest_even_once_and_keeps_nan_and_infinity() -> None:
    """x = [value, 0] by weight rows [1, 0] plus a bias: the output is the fp32 sum
    ``value + bias`` rounded to bf16 (halfway cases to even), as torch rounds it."""
    gemm = _gemm()
    weight = torch.zeros(16, 2, dtype=torch.bfloat16)
    weight[:, 0] = 1
    values = torch.tensor([1.0, 1.0078125, 1.0, -3.5, float("inf"), float("nan"), 1e-30,
                           65280.0])
    bias = torch.full((16,), 2.0 ** -8)  # halfway between 1 and the next bf16
    x = torch.stack([values, torch.zeros_like(values)], dim=1).bfloat16()
    got = gemm(x, gemm.pack(weight), bias)[:, 0]
    want = (x[:, 0].float() + bias[0]).bfloat16()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert got[0] == 1.0 and got[1] == 1.015625  # ties to the even neighbour


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 9), pairs=st.integers(1, 70),
       count=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_helpers_give_the_bits_of_openmp(rows: int, blocks: int, pairs: int, count: int,
                                         seed: int) -> None:
    gemm = _gemm()
    generator = torch.Generator().manual_seed(seed)
    packed = gemm.pack(torch.randn(16 * blocks, 2 * pairs, generator=generator).bfloat16())
    bias = torch.randn(16 * blocks, generator=generator)
    x = torch.randn(rows, 2 * pairs, generator=generator).bfloat16()
    expected = gemm(x, packed, bias)
    cpu_helpers.set_spare_threads(count)
    try:
        got = gemm(x, packed, bias)
    finally:
        cpu_helpers.set_spare_threads(0)
    assert torch.equal(got, expected)


def _as_an_avx2_only_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the AVX512-BF16 kernel nor oneDNN's bf16 packing, as on this machine."""
    _gemm()
    monkeypatch.setattr(packed_linear, "load_gemm", lambda: None)
    monkeypatch.setattr(packed_linear, "_onednn_supports",
                        lambda dtype: dtype == torch.float32)


def test_bf16_layers_run_on_it_where_nothing_else_packs_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _as_an_avx2_only_cpu(monkeypatch)
    bf16 = PackedLinear(torch.randn(48, 40).bfloat16(), None)
    odd_width = PackedLinear(torch.randn(24, 40), None)  # fp32 stays on oneDNN
    assert not bf16.packed_weight.is_mkldnn and bf16.packed_weight.shape == (3, 20, 16, 2)
    assert odd_width.packed_weight.is_mkldnn


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_a_tied_bf16_lm_head_runs_on_a_packed_copy(
        family: str, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedding keeps its weight; the head gives the plain model's logits."""
    _as_an_avx2_only_cpu(monkeypatch)
    plain = AutoModelForCausalLM.from_pretrained(tiny_models[family],
                                                 dtype=torch.bfloat16).eval()
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family],
                                                 dtype=torch.bfloat16).eval()
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding
    pack_linear_layers(model)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and not head.packed_weight.is_mkldnn
    assert model.get_input_embeddings().weight is embedding
    assert head.packed_weight.data_ptr() != embedding.data_ptr()
    ids = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids).logits.float()
        got = model(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
