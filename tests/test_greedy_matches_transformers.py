"""Greedy outputs of batched, chunked and preempted generation equal stock
transformers ``model.generate`` on each prompt alone, token for token."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from helpers import transformers_greedy
from triollm import LLM, SamplingParams
from triollm.testing import TINY_FAMILIES, build_tiny_model

PROMPTS = [
    "Hello",
    "The lighthouse keeper counted the ships that passed each evening",
    "Rain fell on Tuesday, the market opened late",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z and then some more letters follow",
    "Questions and answers: What is the time?",
    "Memory is cut into blocks of equal size, and each sequence keeps a table of the blocks "
    "that hold its keys and values.",
]
MAX_TOKENS = 24

# name -> engine arguments; every variant runs all prompts in one batch.
VARIANTS: dict[str, dict[str, Any]] = {
    "chunked": {"enable_chunked_prefill": True},
    "unchunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
    "split-prompts": {"enable_chunked_prefill": True, "max_num_batched_tokens": 7},
    "preemption": {"enable_chunked_prefill": True, "block_size": 8,
                   "num_gpu_blocks_override": 20, "max_num_batched_tokens": 32},
}


@functools.cache
def reference(path: Path) -> list[list[int]]:
    return transformers_greedy(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_batch_equals_transformers_generate(
    family: str, variant: str, tiny_models: dict[str, Path]
) -> None:
    path = tiny_models[family]
    args = {"dtype": "float32", "max_model_len": 128, "num_gpu_blocks_override": 256,
            **VARIANTS[variant]}
    llm = LLM(str(path), **args)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == reference(path)

    stats = llm.engine.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0
    if variant == "preemption":
        assert stats.num_preemptions > 0, "the variant must actually preempt"
        assert any(o.metrics and o.metrics.num_preemptions for o in outputs)


@pytest.mark.parametrize("variant", ["chunked", "split-prompts"])
def test_softcap_and_alternating_sliding_windows_match_transformers(
    variant: str, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any
) -> None:
    """Gemma2 passes ``softcap`` and per-layer ``sliding_window`` to the attention
    function; prompts longer than its 24-token window exercise both."""
    path = build_tiny_model("gemma2", tmp_path_factory.mktemp("gemma2"), tokenizer)
    llm = LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=256,
              **VARIANTS[variant])
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference(path)
