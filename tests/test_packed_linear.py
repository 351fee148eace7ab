"""CPU linear layers on packed weights (the AVX512-BF16 kernel for bf16 where the CPU has
it, the AVX2 one where oneDNN cannot pack bf16, oneDNN otherwise) compute what the
original layers compute, leave shared (tied) weights alone (but for a bf16 LM head on
the AVX2 kernel, which runs on a packed copy), and fall back to the original layer
when the packed product cannot be trusted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from triollm import LLM
from triollm.model.cpu import build as native_build
from triollm.model.cpu import packed_linear
from triollm.model.cpu.gemm import load_gemm
from triollm.model.cpu.gemm_avx2 import load_avx2_gemm
from triollm.model.cpu.packed_linear import PackedLinear, pack_linear_layers, padded_rows
from triollm.testing import TINY_FAMILIES


def _load(path: Path, dtype: torch.dtype) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _onednn_packs_bf16() -> bool:
    """oneDNN packs bf16 weights only on CPUs with avx512bw/vl/dq or avx_ne_convert."""
    return packed_linear._onednn_supports(torch.bfloat16)


def _avx2_runs_bf16() -> bool:
    """Whether bf16 layers run on the AVX2 kernel here: it loads, and neither the
    AVX512-BF16 kernel nor oneDNN's bf16 packing is there."""
    return (packed_linear.load_gemm() is None and not _onednn_packs_bf16()
            and load_avx2_gemm() is not None)


def _packable(model: nn.Module) -> list[str]:
    """Names of the layers that may be packed: plain linears whose weight no other
    module uses, and a tied bf16 LM head where the AVX2 kernel runs bf16."""
    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    head = model.get_output_embeddings()
    tied_head = (type(head) is nn.Linear and head.weight.dtype == torch.bfloat16
                 and _avx2_runs_bf16())
    return [name for name, module in model.named_modules()
            if type(module) in (nn.Linear, Conv1D)
            and (uses[id(module.weight)] == 1 or (module is head and tied_head))]


@pytest.mark.parametrize("onednn_only", [False, True], ids=["as-here", "no-avx512-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_packed_model_gives_the_same_logits(family: str, dtype: torch.dtype,
                                            onednn_only: bool, tiny_models: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``onednn_only``: as on a CPU without AVX512-BF16, where bf16 layers stay on
    oneDNN."""
    if onednn_only:
        monkeypatch.setattr(packed_linear, "load_gemm", lambda: None)
    if dtype == torch.bfloat16 and not _onednn_packs_bf16() and (
            onednn_only or load_gemm() is None) and load_avx2_gemm() is None:
        pytest.skip("neither AVX512-BF16, AVX2 nor oneDNN's bf16 packing on this CPU")
    plain = _load(tiny_models[family], dtype)
    packed = _load(tiny_models[family], dtype)
    expected_names = _packable(packed)
    assert expected_names, "the family has no packable layer"

    assert pack_linear_layers(packed) == len(expected_names)
    modules = dict(packed.named_modules())
    assert all(isinstance(modules[name], PackedLinear) for name in expected_names)
    if onednn_only and (dtype == torch.float32 or _onednn_packs_bf16()):
        assert all(modules[name].packed_weight.is_mkldnn for name in expected_names)

    ids = torch.randint(4, 500, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids).logits.float()
        got = packed(ids).logits.float()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_bf16_layers_stay_on_aten_where_nothing_packs_them(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with neither AVX512-BF16, AVX2 nor oneDNN's bf16 packing, a bf16 model
    keeps its layers as they are instead of failing to load."""
    monkeypatch.setattr(packed_linear, "load_gemm", lambda: None)
    monkeypatch.setattr(packed_linear, "load_avx2_gemm", lambda: None)
    monkeypatch.setattr(packed_linear, "_onednn_supports",
                        lambda dtype: dtype == torch.float32)
    model = _load(tiny_models["llama"], torch.bfloat16)
    assert pack_linear_layers(model) == 0
    assert not any(isinstance(module, PackedLinear) for module in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_row_count_gives_the_plain_product(dtype: torch.dtype) -> None:
    """Rows padded up to a cached size are computed and dropped: every row count, in
    the batch shapes the runner uses, gives F.linear's result and shape."""
    if (dtype == torch.bfloat16 and not _onednn_packs_bf16() and load_gemm() is None
            and load_avx2_gemm() is None):
        pytest.skip("neither AVX512-BF16, AVX2 nor oneDNN's bf16 packing on this CPU")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, dtype=dtype, generator=generator)
    bias = torch.randn(48, dtype=dtype, generator=generator)
    layer = PackedLinear(weight, bias)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for rows in [1, 7, 32, 33, 34, 35, 63, 100, 257, 1000]:
        for shape in [(rows, 40), (1, rows, 40)]:
            x = torch.randn(*shape, dtype=dtype, generator=generator)
            got = layer(x)
            assert got.shape == (*shape[:-1], 48)
            torch.testing.assert_close(got.float(), nn.functional.linear(x, weight, bias)
                                       .float(), rtol=tolerance, atol=tolerance)


def test_padded_row_counts_are_few_and_close() -> None:
    """oneDNN caches one primitive per row count, so the counts the layers see are
    bounded: at most 16 per doubling above 32, never more than 1/16 above the request."""
    sizes = {padded_rows(rows) for rows in range(1, 8193)}
    assert len(sizes) == 32 + 16 * 8
    for rows in range(1, 8193):
        padded = padded_rows(rows)
        assert rows <= padded <= rows * 17 / 16
        assert padded_rows(padded) == padded
    assert all(padded_rows(rows) == rows for rows in range(1, 33))


def test_tied_lm_head_keeps_the_embedding_weight(tiny_models: dict[str, Path]) -> None:
    model = _load(tiny_models["opt"], torch.float32)  # OPT ties its LM head
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight

    pack_linear_layers(model)

    assert model.get_output_embeddings() is head
    assert type(head) is nn.Linear


def test_without_onednn_nothing_is_packed(tiny_models: dict[str, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = _load(tiny_models["llama"], torch.float32)
    assert pack_linear_layers(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_a_layer_that_fails_the_check_keeps_aten(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    original = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: original(self, x) + 1.0)
    model = _load(tiny_models["llama"], torch.float32)
    with caplog.at_level(logging.WARNING, logger=packed_linear.__name__):
        assert pack_linear_layers(model) == 0
    assert "disagrees" in caplog.text
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_the_cpu_runner_packs_its_model(llama_path: Path, llama_llm: LLM) -> None:
    model = llama_llm.engine.runner.model
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == len(_packable(
        _load(llama_path, torch.float32)))


def test_bf16_layers_take_the_avx512_bf16_kernel_where_the_cpu_has_it() -> None:
    """The kernel loads exactly where the CPU has AVX512-BF16 (this machine has a C
    compiler); there, bf16 weights that fit it use it and the rest stay on oneDNN (on a CPU
    where oneDNN packs bf16: it needs avx512bw/vl/dq or avx_ne_convert)."""
    gemm = load_gemm()
    assert (gemm is not None) == ("avx512_bf16" in native_build.cpu_flags())
    if not _onednn_packs_bf16():
        pytest.skip("oneDNN does not pack bf16 weights on this CPU")
    fits = PackedLinear(torch.randn(48, 40).bfloat16(), None)
    odd_width = PackedLinear(torch.randn(24, 40).bfloat16(), None)  # 24 outputs: not 16k
    fp32 = PackedLinear(torch.randn(48, 40), None)
    assert fits.packed_weight.is_mkldnn == (gemm is None)
    assert odd_width.packed_weight.is_mkldnn and fp32.packed_weight.is_mkldnn


def test_bf16_products_run_on_amx_tiles_where_the_cpu_has_them() -> None:
    gemm = load_gemm()
    if gemm is None:
        pytest.skip("no AVX512-BF16 on this CPU")
    assert gemm.has_tiles == ("amx_bf16" in native_build.cpu_flags())


@given(rows=st.integers(0, 70), blocks=st.integers(1, 6),
       pairs=st.one_of(st.integers(1, 70), st.sampled_from([16, 32, 48])),
       with_bias=st.booleans(), strided=st.booleans(), tiles=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_bf16_kernel_gives_the_fp32_product_to_bf16_rounding(
        rows: int, blocks: int, pairs: int, with_bias: bool, strided: bool, tiles: bool,
        seed: int) -> None:
    """Any row count (full and partial tiles of 8 rows, of AMX's 16 and 32), one or two
    16-wide output blocks per tile, any even input width (AMX's multiples of 32 among
    them), with and without a bias, on contiguous inputs and on strided ones (a
    transposed view); on AMX tiles and off them, where the CPU has them."""
    gemm = load_gemm()
    if gemm is None:
        pytest.skip("no AVX512-BF16 on this CPU")
    tiles_from = gemm.use_tiles_from(1 if tiles else 0)
    try:
        _check_bf16_product(rows, blocks, pairs, with_bias, strided, seed)
    finally:
        gemm.use_tiles_from(tiles_from)


def _check_bf16_product(rows: int, blocks: int, pairs: int, with_bias: bool, strided: bool,
                        seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(16 * blocks, 2 * pairs, generator=generator).bfloat16()
    bias = torch.randn(16 * blocks, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(1, rows, 2 * pairs, generator=generator).bfloat16()
    if strided:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
        assert rows < 2 or not x.is_contiguous()
    got = PackedLinear(weight, bias)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 16 * blocks)
    expected = nn.functional.linear(x.float(), weight.float(),
                                    None if bias is None else bias.float())
    scale = float(expected.abs().max()) if rows else 1.0
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)
