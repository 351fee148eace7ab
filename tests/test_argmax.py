"""The sampler's argmax over a vocabulary gives torch.argmax's answer: ties to the first,
NaN as the largest, infinities, short last chunks."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.model.argmax import CHUNK, argmax

# few distinct values, so that ties within and across chunks are common
VALUES = st.sampled_from([0.0, 1.0, 2.0, -1.0, math.inf, -math.inf, math.nan, 2.0, 2.0])


@st.composite
def rows_of_logits(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(0, 5))
    width = draw(st.sampled_from([1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 7,
                                  draw(st.integers(1, 5 * CHUNK))]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(draw(
        st.integers(0, 2**16)))).to(dtype)
    for _ in range(draw(st.integers(0, 12))):  # plant values at chosen places
        if rows:
            x[draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))] = draw(VALUES)
    if rows and draw(st.booleans()):  # a whole row of one value
        x[draw(st.integers(0, rows - 1))] = draw(VALUES)
    return x


@settings(max_examples=300, deadline=None)
@given(rows_of_logits())
def test_argmax_is_torchs(x: torch.Tensor) -> None:
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))


def test_a_vocabulary_sized_row_with_its_largest_in_the_short_last_chunk() -> None:
    x = torch.randn(3, 151_936)
    x[0, -1] = 50.0
    x[1, 151_936 - CHUNK // 2] = math.nan
    x[2, 7] = x[2, 151_000] = 60.0
    assert argmax(x).tolist() == [151_935, 151_936 - CHUNK // 2, 7]
    assert torch.equal(argmax(x[:, :-3]), torch.argmax(x[:, :-3], dim=-1))  # a strided view
