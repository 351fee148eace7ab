"""The compiled forward (``optimization_level`` > 0 on CPU): the same greedy tokens as
transformers in float32, no compiling after start-up whatever the step's size or the
thread count, and an eager fallback when compiling fails."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from test_greedy_matches_transformers import MAX_TOKENS, PROMPTS, reference
from triollm import LLM, SamplingParams
from triollm.model import packed_linear
from triollm.testing import build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def compiled_llm(path: Path, **args: Any) -> LLM:
    llm = LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=256,
              optimization_level=2, **{"cpu_threads": 1, **args})
    assert llm.engine.runner.compiled, "the model should have compiled"
    return llm


def graphs_compiled() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_compiled_greedy_equals_transformers_and_never_recompiles(
    family: str, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
    tokenizer: Any,
) -> None:
    """Rotary and learned positions, Conv1D, softcap and alternating sliding windows;
    steps of one token, of many, and of prompts split into chunks of 7."""
    path = (build_tiny_model("gemma2", tmp_path_factory.mktemp("gemma2"), tokenizer)
            if family == "gemma2" else tiny_models[family])
    llm = compiled_llm(path, max_num_batched_tokens=7)
    before = graphs_compiled()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference(path)
    alone = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # one token per step
    assert alone[0].outputs[0].token_ids == reference(path)[0]
    assert graphs_compiled() == before
    stats = llm.engine.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_each_thread_count_the_policy_may_pick_is_compiled_at_start(llama_path: Path) -> None:
    llm = compiled_llm(llama_path, cpu_threads=None)
    threads = llm.engine.runner.compute_threads
    counts = threads.thread_counts()
    before = graphs_compiled()
    try:
        for count in counts:
            torch.set_num_threads(count)
            outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == reference(llama_path)[:3]
    finally:
        torch.set_num_threads(threads.threads)
    assert graphs_compiled() == before


def test_a_model_that_fails_to_compile_runs_eagerly(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_compile(*args: Any, **kwargs: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no C++ compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger="triollm.model.torch_runner"):
        llm = LLM(str(llama_path), dtype="float32", max_model_len=128,
                  num_gpu_blocks_override=256, optimization_level=2)
    assert not llm.engine.runner.compiled
    assert "no C++ compiler here" in caplog.text
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference(llama_path)


def test_level_zero_and_enforce_eager_do_not_compile(llama_path: Path) -> None:
    for args in ({"optimization_level": 0}, {"optimization_level": 3, "enforce_eager": True}):
        llm = LLM(str(llama_path), dtype="float32", max_model_len=128,
                  num_gpu_blocks_override=256, **args)
        assert not llm.engine.runner.compiled


@pytest.mark.parametrize("level", [-1, 4, "2", True])
def test_optimization_level_out_of_range_is_refused_by_name(level: Any,
                                                            llama_path: Path) -> None:
    with pytest.raises(ValueError, match="optimization_level"):
        LLM(str(llama_path), optimization_level=level)


def test_a_packed_weight_is_registered_while_its_layer_lives() -> None:
    layer = packed_linear.PackedLinear(torch.randn(8, 4), None)
    handle = layer.handle
    x = torch.randn(3, 4)
    assert torch.allclose(packed_linear.packed_linear(x, handle, 8), layer(x))
    del layer
    gc.collect()
    assert handle not in packed_linear._registered
