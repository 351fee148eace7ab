"""The compiled forward (``optimization_level`` > 0 on CPU): the same greedy tokens as
transformers in float32, no compiling after start-up whatever the step's size or the
thread count, and an eager fallback when compiling fails."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import assert_grouping_keeps_outputs, bf16_compiled_llm, graph_of_calls
from test_greedy_matches_transformers import MAX_TOKENS, PROMPTS, reference
from triollm import LLM, SamplingParams
from triollm.engine import args as engine_args
from triollm.model.cpu import packed_linear
from triollm.model.runners import compile as runner_compile
from triollm.testing import TINY_FAMILIES, build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
#: The level users get, read when pytest imports this module, before conftest.py's
#: session fixture sets it to 0 for the rest of the suite.
SHIPPED_OPTIMIZATION_LEVEL = engine_args.DEFAULT_OPTIMIZATION_LEVEL


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
    monkeypatch.setattr(runner_compile, "cache_directory", lambda key: None)  # none saved
    with caplog.at_level(logging.WARNING, logger=runner_compile.__name__):
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


def test_the_op_reads_the_layer_of_the_model_whose_forward_runs() -> None:
    """Handles number a model's layers from 0, so two models' handles coincide; the op
    reads the weights ``packed_weights`` set, and none outside it."""
    first, second = (packed_linear.PackedLinear(torch.randn(8, 4), None) for _ in range(2))
    assert first.handle == second.handle == 0
    x = torch.randn(3, 4)
    for layer in (first, second):
        with packed_linear.packed_weights(layer.weights):
            assert torch.allclose(packed_linear.packed_linear(x, 0, 8), layer(x))
    with pytest.raises(RuntimeError, match="outside packed_weights"):
        packed_linear.packed_linear(x, 0, 8)


def test_a_model_s_packed_layers_are_numbered_from_zero_on_one_registry(llama_path: Path) -> None:
    """The same in every process that packs the model: what saved compiled code needs."""
    model = LLM(str(llama_path), dtype="float32", max_model_len=128,
                num_gpu_blocks_override=256, optimization_level=0).engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, packed_linear.PackedLinear)]
    assert sorted(layer.handle for layer in layers) == list(range(len(layers)))
    assert {id(layer.weights) for layer in layers} == {id(layers[0].weights)}


def test_layers_on_one_input_are_one_call_with_the_same_outputs(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled bf16 Llama multiplies q, k and v in one call and gate and up in
    another, over weights stored once, and gives what it gives without the grouping."""
    if packed_linear.load_gemm() is None:
        pytest.skip("layers are grouped on model/cpu/gemm.py's layout only (AVX512-BF16); "
                    "two compiles: too slow for the suite where the AVX2 kernel runs")
    calls: list[int] = []
    linear = packed_linear._linear

    def counting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        calls.append(16 * weight.shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(packed_linear, "_linear", counting)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    results = {}
    for grouped in (True, False):
        with monkeypatch.context() as patch:
            if not grouped:
                patch.setattr(runner_compile, "group_weights_of_shared_inputs", lambda calls: 0)
            llm = bf16_compiled_llm(llama_path)
            calls.clear()
            outputs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
            results[grouped] = (list(calls), outputs[0].outputs[0])
            attention = llm.engine.runner.model.model.layers[0].self_attn
            shared = {p.packed_weight.untyped_storage().data_ptr()
                      for p in (attention.q_proj, attention.k_proj, attention.v_proj)}
            assert len(shared) == (1 if grouped else 3)
    config = llm.engine.runner.model.config
    assert_grouping_keeps_outputs(config, params.max_tokens, results[True], results[False],
                                  [config.vocab_size])


def test_a_group_is_fused_only_where_exactly_its_members_share_the_input() -> None:
    if packed_linear._bf16_gemm() is None:
        pytest.skip("layers are grouped on model/cpu/gemm.py's layout only (AVX512-BF16, "
                    "or AVX2 where oneDNN cannot pack bf16)")
    layers = [packed_linear.PackedLinear(torch.randn(16, 8).bfloat16(), None)
              for _ in range(3)]
    weights = packed_linear.PackedWeights()
    for layer in layers:
        weights.adopt(layer)
    x = torch.randn(2, 8).bfloat16()
    expected = [layer(x) for layer in layers]
    assert packed_linear.group_weights_of_shared_inputs([(x, layer) for layer in layers[:2]]) == 1
    assert layers[0].packed_weight.data_ptr() + layers[0].packed_weight.nbytes == (
        layers[1].packed_weight.data_ptr())
    first, second, third = (layer.handle for layer in layers)
    fused = graph_of_calls(packed_linear.packed_linear, [0, 0], [first, second])
    assert packed_linear.fuse_shared_input_calls(fused, weights) == 1
    module = torch.fx.GraphModule(torch.nn.Module(), fused)
    with packed_linear.packed_weights(weights):
        got_all = module(x)
    for got, want in zip(got_all, expected[:2], strict=True):
        assert torch.equal(got, want)
    for inputs, handles in (([0, 0, 0], [first, second, third]), ([0, 1], [first, second]),
                            ([0, 0], [second, first])):
        graph = graph_of_calls(packed_linear.packed_linear, inputs, handles)
        assert packed_linear.fuse_shared_input_calls(graph, weights) == 0


@pytest.fixture
def shipped_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built at the optimization level users get, and a recompile limit as low
    as the runner allows, so that no test relies on another's having raised it."""
    assert SHIPPED_OPTIMIZATION_LEVEL > 0, "the shipped default should compile on CPU"
    monkeypatch.setattr(engine_args, "DEFAULT_OPTIMIZATION_LEVEL", SHIPPED_OPTIMIZATION_LEVEL)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)


def _compiled_at_shipped_default(path: Path, caplog: pytest.LogCaptureFixture,
                                 **args: Any) -> LLM:
    """At the shipped optimization level, in float32 (``auto`` is bfloat16 on a CPU
    with AVX512-BF16, whose tokens no float32 reference is held to)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=runner_compile.__name__):
        llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64,
                  **{"cpu_threads": 1, "dtype": "float32", **args})
    assert llm.engine.runner.compiled, caplog.text
    assert "compiling the model failed" not in caplog.text
    return llm


@pytest.mark.usefixtures("shipped_default")
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_each_family_compiled_at_the_shipped_default_equals_transformers(
        family: str, tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_models[family]
    llm = _compiled_at_shipped_default(path, caplog)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference(path)


@pytest.mark.usefixtures("shipped_default")
def test_the_nth_engine_in_a_process_is_compiled_like_the_first(
        llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Engines of one model built one after another each compile their own forward:
    dynamo's compiled code for one model (whose guards name that model's modules)
    neither stands in for another's nor counts towards its recompile limit."""
    configurations: list[dict[str, Any]] = [
        {}, {"max_num_seqs": 4}, {"block_size": 8, "max_num_batched_tokens": 32}]
    eager = LLM(str(llama_path), dtype="float32", max_model_len=128,
                num_gpu_blocks_override=64, optimization_level=0)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for configuration in configurations:
        llm = _compiled_at_shipped_default(llama_path, caplog, **configuration)
        before = graphs_compiled()
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert graphs_compiled() == before
