"""Decode attention on CPU: the compiled kernel that reads KV blocks in place agrees with
gathering the blocks and calling SDPA, and the engine falls back to the gather path when
compiling is off (``enforce_eager``) or fails."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from triollm import LLM, SamplingParams
from triollm.model import torch_runner
from triollm.model.attention import (
    DecodeGroup,
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
    compiled_paged_decode_attention,
    paged_attention_forward,
)

BLOCK = 4


def _decode_outputs(lens: list[int], kv_heads: int, q_heads: int, sliding_window: int | None,
                    softcap: float | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention layer's output for single-token queries of contexts ``lens``, with
    the compiled kernel and with the gather path, over the same cache."""
    generator = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    dim = 8
    cache = PagedKVCache({id(module): KVCacheSpec(kv_heads, dim)}, num_blocks=64,
                         block_size=BLOCK, dtype=torch.float32, device=torch.device("cpu"))
    cache.keys[0].normal_(generator=generator)
    cache.values[0].normal_(generator=generator)
    widths = [-(-n // BLOCK) for n in lens]
    blocks = torch.randperm(64, generator=generator).tolist()
    tables = []
    for width in widths:
        tables.append(blocks[:width] + [0] * (max(widths) - width))
        blocks = blocks[width:]
    slots = [table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
             for table, n in zip(tables, lens, strict=True)]
    group = DecodeGroup(0, len(lens), torch.tensor(tables), torch.tensor(lens))
    tokens = len(lens)
    query = torch.randn(1, q_heads, tokens, dim, generator=generator)
    key = torch.randn(1, kv_heads, tokens, dim, generator=generator)
    value = torch.randn(1, kv_heads, tokens, dim, generator=generator)
    outputs = []
    for kernel in (compiled_paged_decode_attention, None):
        metadata = PagedAttentionMetadata(kv_cache=cache, slot_mapping=torch.tensor(slots),
                                          decode_groups=[group], decode_kernel=kernel)
        out, _ = paged_attention_forward(module, query, key, value, None, scaling=0.3,
                                         sliding_window=sliding_window, softcap=softcap,
                                         triollm_metadata=metadata)
        outputs.append(out)
    return outputs[0], outputs[1]


@pytest.mark.parametrize(("lens", "kv_heads", "q_heads", "sliding_window", "softcap"), [
    ([9, 7, 5], 2, 2, None, None),
    ([1], 2, 2, None, None),  # one row of one block: padded to 2 x 2 inside
    ([13, 4, 1, 12], 2, 6, None, None),  # grouped-query attention
    ([17, 16, 3], 2, 4, 5, None),  # sliding window shorter than the contexts
    ([11, 2], 1, 3, None, 7.5),  # logit softcap
])
def test_compiled_kernel_matches_the_gather_path(lens: list[int], kv_heads: int, q_heads: int,
                                                 sliding_window: int | None,
                                                 softcap: float | None) -> None:
    fused, gathered = _decode_outputs(lens, kv_heads, q_heads, sliding_window, softcap,
                                      seed=len(lens))
    torch.testing.assert_close(fused, gathered, atol=2e-5, rtol=1e-5)


def _generate(llm: LLM) -> list[list[int]]:
    prompts = ["The gardener planted beans", "A river ran", "Numbers: one two three four five"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_enforce_eager_uses_the_gather_path_with_the_same_answers(llama_path: Path) -> None:
    compiled = LLM(str(llama_path), dtype="float32", max_model_len=128)
    eager = LLM(str(llama_path), dtype="float32", max_model_len=128, enforce_eager=True)
    assert compiled.engine.runner.decode_kernel is not None  # type: ignore[attr-defined]
    assert eager.engine.runner.decode_kernel is None  # type: ignore[attr-defined]
    assert _generate(compiled) == _generate(eager)


def test_a_failed_compile_falls_back_to_the_gather_path(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch_runner, "compiled_paged_decode_attention", broken)
    with caplog.at_level(logging.WARNING, logger="triollm.model.torch_runner"):
        llm = LLM(str(llama_path), dtype="float32", max_model_len=128)
    assert llm.engine.runner.decode_kernel is None  # type: ignore[attr-defined]
    assert "no C++ compiler here" in caplog.text
    eager = LLM(str(llama_path), dtype="float32", max_model_len=128, enforce_eager=True)
    assert _generate(llm) == _generate(eager)


@given(widths=st.lists(st.integers(1, 80), max_size=40), padding_blocks=st.integers(0, 40))
def test_decode_spans_cover_the_step_and_bound_each_rows_padding(
        widths: list[int], padding_blocks: int) -> None:
    widths = sorted(widths, reverse=True)
    spans = torch_runner.decode_spans(widths, padding_blocks)
    assert [i for start, end in spans for i in range(start, end)] == list(range(len(widths)))
    for start, end in spans:
        for width in widths[start:end]:
            assert (width * torch_runner._MAX_DECODE_PADDING >= widths[start]
                    or widths[start] - width <= padding_blocks)
        if end < len(widths):  # a group ends only where the next decode would break both
            next_width = widths[end]
            assert next_width * torch_runner._MAX_DECODE_PADDING < widths[start]
            assert widths[start] - next_width > padding_blocks
