"""A compiled model's attention calls the C++ op ``triollm::decode_attention``: inside a
step of decodes begun in it, a layer's call is the C kernel's one-call step (the same
cache writes and outputs, bit for bit); anywhere else, and for a call or a step the
kernel does not take, the Python op ``triollm::paged_attention`` answers; the begun
step ends with the forward, even one that raises; a compiled model decodes as with
the Python op, calling it only for its prefill."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import bf16_compiled_llm
from test_greedy_matches_transformers import PROMPTS
from triollm import SamplingParams
from triollm.model.attention import op as attention_op
from triollm.model.attention.kv_storage import EIGHT_BIT_CACHE_DTYPES
from triollm.model.attention.metadata import (
    DecodeGroup,
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
    PrefillChunk,
)
from triollm.model.cpu import decode as cpu_decode
from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.cpu import kernel_ops
from triollm.model.runners import compile as runner_compile

BLOCK = 16
LAYERS = 3


@pytest.fixture(autouse=True)
def _ops() -> None:
    if not kernel_ops.load_kernel_ops() or cpu_decode.load_kernel() is None:
        pytest.skip("needs the C++ ops and the C decode kernel")


def _step(lens: list[int], kv_heads: int, dim: int, cache_dtype: torch.dtype, seed: int
          ) -> PagedAttentionMetadata:
    """A step of decodes only over ``LAYERS`` layers' random caches."""
    generator = torch.Generator().manual_seed(seed)
    specs = {layer: KVCacheSpec(kv_heads, dim) for layer in range(LAYERS)}
    cache = PagedKVCache(specs, num_blocks=48, block_size=BLOCK, dtype=cache_dtype,
                         device=torch.device("cpu"))
    for tensor in (*cache.keys, *cache.values):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    blocks = torch.randperm(48, generator=generator).tolist()
    tables = []
    for n in lens:
        tables.append(blocks[:-(-n // BLOCK)] + [0] * (5 - -(-n // BLOCK)))
        blocks = blocks[-(-n // BLOCK):]
    slots = torch.tensor([table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
                          for table, n in zip(tables, lens, strict=True)])
    kernel = cpu_decode.load_kernel()
    assert kernel is not None
    return PagedAttentionMetadata(
        kv_cache=cache, slot_mapping=slots, decode_kernel=kernel,
        decode_step=kernel.decode_step,
        decode_groups=[DecodeGroup(0, len(lens), torch.tensor(tables), torch.tensor(lens))])


def _inputs(tokens: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
            token_major: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def projected(heads: int) -> torch.Tensor:  # [heads, tokens, dim]
        if token_major:
            return torch.randn(tokens, heads, dim, generator=generator).to(dtype).transpose(0, 1)
        return torch.randn(heads, tokens, dim, generator=generator).to(dtype)

    return projected(q_heads), projected(kv_heads), projected(kv_heads)


def _same_bits(first: torch.Tensor, second: torch.Tensor) -> bool:
    if first.element_size() == 1:  # torch compares no float8 tensors
        return torch.equal(first.view(torch.uint8), second.view(torch.uint8))
    return torch.equal(first, second)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3]),
       dim=st.sampled_from([8, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       eight_bit=st.sampled_from([None, *EIGHT_BIT_CACHE_DTYPES]),
       window=st.none() | st.integers(1, 40), softcap=st.none() | st.just(7.5),
       token_major=st.booleans(), helpers=st.sampled_from([0, 2]),
       layer=st.integers(0, LAYERS - 1), seed=st.integers(0, 2**16))
def test_a_begun_step_runs_the_kernels_one_call_step_bit_for_bit(
        lens: list[int], kv_heads: int, groups: int, dim: int, dtype: torch.dtype,
        eight_bit: torch.dtype | None, window: int | None, softcap: float | None,
        token_major: bool, helpers: int, layer: int, seed: int) -> None:
    expected_step = _step(lens, kv_heads, dim, eight_bit or dtype, seed)
    step = _step(lens, kv_heads, dim, eight_bit or dtype, seed)
    query, key, value = _inputs(len(lens), kv_heads * groups, kv_heads, dim, dtype,
                                token_major, seed)
    group = step.decode_groups[0]
    cpu_helpers.set_spare_threads(helpers)
    try:
        expected = expected_step.decode_step(  # type: ignore[misc]
            query, key, value, step.slot_mapping, expected_step.kv_cache.keys[layer],
            expected_step.kv_cache.values[layer], group.block_tables, group.context_lens,
            0.3, window, softcap)
        assert step.kv_cache is not None and isinstance(step.decode_kernel,
                                                        cpu_decode.CpuDecodeKernel)
        assert kernel_ops.begin_decode_step(
            step.kv_cache.keys, step.kv_cache.values, step.slot_mapping, group.block_tables,
            group.context_lens, step.decode_kernel.native_step)
        try:
            got = torch.ops.triollm.decode_attention(query, key, value, layer, 0.3, window,
                                                     softcap)
        finally:
            kernel_ops.end_decode_step()
    finally:
        cpu_helpers.set_spare_threads(0)
    assert expected is not None and got.stride() == query.stride()
    assert torch.equal(got, expected)
    for mine, theirs in ((step.kv_cache.keys, expected_step.kv_cache.keys),
                         (step.kv_cache.values, expected_step.kv_cache.values)):
        assert all(_same_bits(a, b) for a, b in zip(mine, theirs, strict=True))


def test_outside_a_step_the_python_op_answers() -> None:
    query, key, value = _inputs(1, 2, 1, 8, torch.float32, False, 0)
    # the Python op's own error: the call reached it
    with pytest.raises(RuntimeError, match="outside forward_metadata"):
        torch.ops.triollm.decode_attention(query, key, value, 0, 0.3, None, None)
    step = _step([5], 1, 8, torch.float32, 0)
    with attention_op.forward_metadata(step):
        got = torch.ops.triollm.decode_attention(query, key, value, 1, 0.3, None, None)
    expected_step = _step([5], 1, 8, torch.float32, 0)
    with attention_op.forward_metadata(expected_step):
        expected = torch.ops.triollm.paged_attention(query, key, value, 1, 0.3, None, None)
    assert torch.equal(got, expected)


@pytest.fixture
def python_op_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Grows by one at each call the Python op answers (before it raises, not)."""
    calls: list[int] = []
    write_and_attend = attention_op.write_and_attend

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return write_and_attend(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_op, "write_and_attend", counted)
    return calls


def test_a_call_or_a_step_the_kernel_does_not_take_goes_to_the_python_op(
        monkeypatch: pytest.MonkeyPatch, python_op_calls: list[int]) -> None:
    calls = python_op_calls
    step = _step([5, 9], 1, 8, torch.float32, 0)
    query, key, value = _inputs(2, 2, 1, 8, torch.float32, False, 0)
    with attention_op.forward_metadata(step):
        assert torch.ops.triollm.decode_step_begun()
        torch.ops.triollm.decode_attention(query, key, value, 0, 0.3, None, None)
        assert calls == []
        # a bf16 query over an fp32 cache, a layer the step has no cache for
        torch.ops.triollm.decode_attention(query.bfloat16(), key.bfloat16(),
                                           value.bfloat16(), 0, 0.3, None, None)
        with pytest.raises(RuntimeError, match="list index out of range"):
            torch.ops.triollm.decode_attention(query, key, value, LAYERS, 0.3, None, None)
    assert len(calls) == 1  # the bf16 call's (the last raised before it wrote)
    assert not torch.ops.triollm.decode_step_begun()
    # steps begun nowhere: a prefill chunk in it, two groups, int32 lengths
    prefill = _step([5], 1, 8, torch.float32, 0)
    prefill.prefills = [PrefillChunk(0, 1, 5, torch.tensor([0]))]
    two = _step([5, 9], 1, 8, torch.float32, 0)
    tables, lens = two.decode_groups[0].block_tables, two.decode_groups[0].context_lens
    two.decode_groups = [DecodeGroup(0, 1, tables[:1], lens[:1]),
                         DecodeGroup(1, 2, tables[1:], lens[1:])]
    int32 = _step([5], 1, 8, torch.float32, 0)
    int32.decode_groups[0].context_lens = int32.decode_groups[0].context_lens.int()
    for meta in (prefill, two, int32):
        with attention_op.forward_metadata(meta):
            assert not torch.ops.triollm.decode_step_begun()


@pytest.mark.parametrize("mismatch", ["rows", "head dim", "kv heads", "query heads"])
def test_a_call_whose_shapes_do_not_fit_the_step_goes_to_the_python_op(mismatch: str
                                                                       ) -> None:
    step = _step([5, 9], 2, 8, torch.float32, 0)
    assert step.kv_cache is not None and isinstance(step.decode_kernel,
                                                    cpu_decode.CpuDecodeKernel)
    group = step.decode_groups[0]
    shapes = {"rows": (4, 2, 1, 8), "head dim": (4, 2, 2, 16), "kv heads": (4, 1, 2, 8),
              "query heads": (3, 2, 2, 8)}[mismatch]
    q_heads, kv_heads, tokens, dim = shapes
    query, key, value = _inputs(tokens, q_heads, kv_heads, dim, torch.float32, False, 0)
    assert kernel_ops.begin_decode_step(step.kv_cache.keys, step.kv_cache.values,
                                        step.slot_mapping, group.block_tables,
                                        group.context_lens, step.decode_kernel.native_step)
    try:  # outside forward_metadata the Python op refuses: the call reached it
        with pytest.raises(RuntimeError, match="outside forward_metadata"):
            torch.ops.triollm.decode_attention(query, key, value, 0, 0.3, None, None)
    finally:
        kernel_ops.end_decode_step()


def test_the_step_ends_with_a_forward_that_raises() -> None:
    step = _step([5], 1, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="the forward failed"):
        with attention_op.forward_metadata(step):
            assert torch.ops.triollm.decode_step_begun()
            raise ValueError("the forward failed")
    assert not torch.ops.triollm.decode_step_begun()


def test_begin_takes_only_layouts_the_kernel_reads() -> None:
    step = _step([5, 9], 1, 8, torch.float32, 0)
    assert step.kv_cache is not None and isinstance(step.decode_kernel,
                                                    cpu_decode.CpuDecodeKernel)
    group = step.decode_groups[0]
    native = step.decode_kernel.native_step
    keys, values = step.kv_cache.keys, step.kv_cache.values
    strided = torch.tensor([[0, 1, 2, 3]] * 2).T.contiguous().T
    cases = [
        (keys, values[:-1], step.slot_mapping, group.block_tables, group.context_lens),
        (keys, values, step.slot_mapping, strided, group.context_lens),
        (keys, values, step.slot_mapping, group.block_tables, group.context_lens.int()),
        (keys, values, step.slot_mapping[:1], group.block_tables, group.context_lens),
        (keys, [v.transpose(1, 2) for v in values], step.slot_mapping, group.block_tables,
         group.context_lens),
        ([k.to(torch.int8) for k in keys], [v.to(torch.int8) for v in values],
         step.slot_mapping, group.block_tables, group.context_lens),
    ]
    for case in cases:
        assert not kernel_ops.begin_decode_step(*case, native)
        assert not torch.ops.triollm.decode_step_begun()
    assert kernel_ops.begin_decode_step(keys, values, step.slot_mapping, group.block_tables,
                                        group.context_lens, native)
    kernel_ops.end_decode_step()


def test_a_compiled_model_attends_in_cpp_and_decodes_as_with_the_python_op(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch, python_op_calls: list[int]
) -> None:
    """The second engine with the C++ op loads the first's saved compiled graphs (or both
    load an earlier run's): a loaded graph calls it too."""
    calls = python_op_calls
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    results = []
    for cpp in (True, True, False):
        with monkeypatch.context() as patch:
            if not cpp:
                patch.setattr(runner_compile, "call_attention_from_cpp", lambda graph: 0)
                patch.setattr(runner_compile, "load_kernel_ops", lambda: False)
            llm = bf16_compiled_llm(llama_path)
            layers = llm.engine.runner.model.config.num_hidden_layers
            calls.clear()
            completion = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
            results.append((completion, len(calls)))
            del llm
            gc.collect()
    assert [count for _, count in results] == [layers, layers, 6 * layers], (
        "only the prefill should reach the Python op")
    for completion, _ in results[:2]:
        assert completion.token_ids == results[2][0].token_ids
        assert completion.logprobs == results[2][0].logprobs


def test_without_the_cpp_ops_graphs_keep_the_python_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_op, "load_kernel_ops", lambda: False)
    graph = torch.fx.Graph()
    query = graph.placeholder("query")
    graph.call_function(attention_op.paged_attention, (query, query, query, 0, 0.3, None,
                                                       None))
    assert attention_op.call_attention_from_cpp(graph) == 0
    assert [node.target for node in graph.nodes if node.op == "call_function"] == [
        attention_op.paged_attention]
