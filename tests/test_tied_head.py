"""A tied bf16 LM head on a CPU with AMX tiles runs on the row-major kernel over the
embedding's own weight (no copy) and computes what aten's ``linear`` computes, for any
row count, between products on the packed layout's tiles in the same thread; without
tiles it stays aten's ``nn.Linear``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM

from triollm.model.cpu import tied_head
from triollm.model.cpu.gemm import load_gemm
from triollm.model.cpu.packed_linear import pack_linear_layers
from triollm.model.cpu.tied_head import TiedHead, tied_head_on_tiles


def _tiles() -> bool:
    gemm = load_gemm()
    return gemm is not None and gemm.takes_row_major(torch.zeros(16, 32, dtype=torch.bfloat16))


needs_tiles = pytest.mark.skipif(not _tiles(), reason="needs a CPU with AMX-BF16 tiles")


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 7), width=st.sampled_from([32, 64, 96]),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_row_major_product_is_torchs(rows: int, blocks: int, width: int,
                                         with_bias: bool, seed: int) -> None:
    gemm = load_gemm()
    assert gemm is not None
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(16 * blocks, width, generator=generator).bfloat16()
    bias = torch.randn(16 * blocks, generator=generator) if with_bias else None
    x = torch.randn(rows, width, generator=generator).bfloat16()
    expected = nn.functional.linear(x.float(), weight.float(), bias)
    # a product on the packed layout's tiles first: each kernel configures its own
    packed = gemm(x, gemm.pack(weight), None)
    got = gemm.row_major(x, weight, bias).float()
    tolerance = 1e-2 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=tolerance)
    torch.testing.assert_close(gemm(x, gemm.pack(weight), None), packed)


@needs_tiles
def test_it_refuses_inputs_of_another_width_or_dtype() -> None:
    gemm = load_gemm()
    assert gemm is not None
    weight = torch.randn(32, 64).bfloat16()
    with pytest.raises(ValueError, match="bf16"):
        gemm.row_major(torch.randn(2, 32).bfloat16(), weight, None)
    with pytest.raises(ValueError, match="bf16"):
        gemm.row_major(torch.randn(2, 64), weight, None)
    assert not gemm.takes_row_major(torch.randn(24, 64).bfloat16())  # out not 16k
    assert not gemm.takes_row_major(torch.randn(32, 48).bfloat16())  # in not 32k
    assert not gemm.takes_row_major(torch.randn(64, 32).bfloat16().t())  # not contiguous
    assert not gemm.takes_row_major(torch.randn(32, 64))  # fp32


@needs_tiles
@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_a_tied_bf16_head_reads_the_embedding_weight_in_place(
        family: str, tiny_models: dict[str, Path]) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tiny_models[family],
                                                 dtype=torch.bfloat16).eval()
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family],
                                                 dtype=torch.bfloat16).eval()
    embedding = model.get_input_embeddings().weight
    pack_linear_layers(model)
    head = model.get_output_embeddings()
    assert isinstance(head, TiedHead)
    assert head.weight is embedding and model.get_input_embeddings().weight is embedding
    ids = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids).logits.float()
        got = model(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_tiles
def test_more_rows_than_the_tiles_take_go_to_aten(tiny_models: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_models["opt"],
                                                 dtype=torch.bfloat16).eval()
    pack_linear_layers(model)
    head = model.get_output_embeddings()
    assert isinstance(head, TiedHead)
    generator = torch.Generator().manual_seed(2)
    for rows in (tied_head.MAX_ROWS, tied_head.MAX_ROWS + 1):
        x = torch.randn(rows, head.in_features, generator=generator).bfloat16()
        with torch.inference_mode():
            got = head(x)
        aten = nn.functional.linear(x, head.weight)
        if rows > tied_head.MAX_ROWS:
            assert torch.equal(got, aten)
        else:
            torch.testing.assert_close(got.float(), aten.float(), rtol=2e-2, atol=2e-2)


def test_without_tiles_the_head_stays_atens(tiny_models: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tied_head, "load_gemm", lambda: None)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["opt"],
                                                 dtype=torch.bfloat16).eval()
    head = model.get_output_embeddings()
    assert tied_head_on_tiles(head) is None
    if load_gemm() is not None:  # else the AVX2 kernel may pack a copy
        pack_linear_layers(model)
        assert model.get_output_embeddings() is head and type(head) is nn.Linear


@needs_tiles
def test_a_kernel_that_disagrees_keeps_aten(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    gemm = load_gemm()
    assert gemm is not None
    original = type(gemm).row_major
    monkeypatch.setattr(type(gemm), "row_major",
                        lambda self, x, weight, bias: original(self, x, weight, bias) + 1.0)
    head = nn.Linear(64, 32, bias=False).bfloat16()
    with caplog.at_level(logging.WARNING, logger=tied_head.__name__):
        assert tied_head_on_tiles(head) is None
    assert "disagrees" in caplog.text


def test_it_takes_only_bf16_weights_the_kernel_fits() -> None:
    assert tied_head_on_tiles(nn.Linear(64, 32)) is None  # fp32
    assert tied_head_on_tiles(nn.Linear(64, 24).bfloat16()) is None  # out not 16k
    assert tied_head_on_tiles(nn.Linear(48, 32).bfloat16()) is None  # in not 32k
