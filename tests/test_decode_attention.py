"""Decode attention on CPU: the C kernel and the compiled kernel that read KV blocks in
place agree with gathering the blocks and calling SDPA, and the engine falls back (C
kernel → compiled kernel → gather path) when building is off (``enforce_eager``) or
fails."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from triollm import LLM, SamplingParams
from triollm.model.attention import compute as attention_compute
from triollm.model.attention.kernel import DecodeStepKernel
from triollm.model.attention.kv_storage import EIGHT_BIT_CACHE_DTYPES, write_slots
from triollm.model.attention.metadata import (
    DecodeGroup,
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
)
from triollm.model.attention.paged import paged_attention_forward
from triollm.model.attention.torch_decode import compiled_paged_decode_attention
from triollm.model.cpu import build as native_build
from triollm.model.cpu import decode as cpu_decode
from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.runners import batch as runner_batch
from triollm.model.runners import compile as runner_compile
from triollm.model.runners import torch_runner

BLOCK = 4


def _decode_outputs(lens: list[int], kv_heads: int, q_heads: int, sliding_window: int | None,
                    softcap: float | None, seed: int, kernel: object,
                    dtype: torch.dtype = torch.float32, dim: int = 8,
                    block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention layer's output for single-token queries of contexts ``lens``, with
    ``kernel`` and with the gather path, over the same cache."""
    generator = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    cache = PagedKVCache({id(module): KVCacheSpec(kv_heads, dim)}, num_blocks=64,
                         block_size=block, dtype=dtype, device=torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=generator))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=generator))
    widths = [-(-n // block) for n in lens]
    blocks = torch.randperm(64, generator=generator).tolist()
    tables = []
    for width in widths:
        tables.append(blocks[:width] + [0] * (max(widths) - width))
        blocks = blocks[width:]
    slots = [table[(n - 1) // block] * block + (n - 1) % block
             for table, n in zip(tables, lens, strict=True)]
    group = DecodeGroup(0, len(lens), torch.tensor(tables), torch.tensor(lens))
    tokens = len(lens)
    query = torch.randn(1, q_heads, tokens, dim, generator=generator)
    key = torch.randn(1, kv_heads, tokens, dim, generator=generator)
    value = torch.randn(1, kv_heads, tokens, dim, generator=generator)
    outputs = []
    for each in (kernel, None):
        step = each.decode_step if isinstance(each, DecodeStepKernel) else None
        metadata = PagedAttentionMetadata(kv_cache=cache, slot_mapping=torch.tensor(slots),
                                          decode_groups=[group], decode_kernel=each,  # type: ignore[arg-type]
                                          decode_step=step)
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
@pytest.mark.parametrize("kernel", ["c", "compiled"])
def test_kernels_match_the_gather_path(lens: list[int], kv_heads: int, q_heads: int,
                                       sliding_window: int | None, softcap: float | None,
                                       kernel: str) -> None:
    chosen = cpu_decode.load_kernel() if kernel == "c" else compiled_paged_decode_attention
    assert chosen is not None, "this machine has a C compiler: the kernel must build"
    fused, gathered = _decode_outputs(lens, kv_heads, q_heads, sliding_window, softcap,
                                      seed=len(lens), kernel=chosen)
    torch.testing.assert_close(fused, gathered, atol=2e-5, rtol=1e-5)
    if kernel == "c":  # bf16 and 8-bit caches, widened as read and computed in fp32
        for dtype in (torch.bfloat16, *EIGHT_BIT_CACHE_DTYPES):
            fused, gathered = _decode_outputs(lens, kv_heads, q_heads, sliding_window,
                                              softcap, seed=len(lens), kernel=chosen,
                                              dtype=dtype)
            torch.testing.assert_close(fused, gathered, atol=2e-5, rtol=1e-5)


def test_the_compiled_kernel_reads_an_eight_bit_cache() -> None:
    fused, gathered = _decode_outputs([13, 4, 1, 12], 2, 6, None, None, seed=3,
                                      kernel=compiled_paged_decode_attention,
                                      dtype=torch.float8_e5m2)
    torch.testing.assert_close(fused, gathered, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("portable", [False, True], ids=["as-built", "portable"])
@pytest.mark.parametrize(("dim", "block"), [(8, 4), (16, 4), (64, 16), (80, 8), (128, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *EIGHT_BIT_CACHE_DTYPES])
def test_both_c_kernel_paths_match_the_gather_path(dim: int, block: int, portable: bool,
                                                   dtype: torch.dtype) -> None:
    """The AVX-512 path (head sizes that are multiples of 16; runs of 16 tokens inside a
    32-token block) and the portable one that CPUs without AVX-512 run, built here."""
    kernel = cpu_decode.CpuDecodeKernel(ctypes.CDLL(str(cpu_decode._build(portable))))
    has_avx512 = "avx512f" in native_build.cpu_flags()
    assert kernel.vectorized(dim) == (not portable and dim % 16 == 0 and has_avx512)
    for lens, kv_heads, q_heads, window, softcap in [
            ([70, 33, 1, 16, 17], 2, 2, None, None),
            ([45, 12, 31], 2, 6, None, None),
            ([90, 40, 3], 1, 2, 37, None),
            ([64, 5], 2, 4, None, 7.5)]:
        fused, gathered = _decode_outputs(lens, kv_heads, q_heads, window, softcap,
                                          seed=dim + len(lens), kernel=kernel, dtype=dtype,
                                          dim=dim, block=block)
        torch.testing.assert_close(fused, gathered, atol=2e-5, rtol=1e-5)


@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3]),
       dim=st.sampled_from([8, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       eight_bit=st.sampled_from([None, *EIGHT_BIT_CACHE_DTYPES]),
       window=st.none() | st.integers(1, 40), softcap=st.none() | st.just(7.5),
       token_major=st.booleans(), helpers=st.sampled_from([0, 2]), portable=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_step_of_decodes_is_one_call_with_the_writes_and_answers_of_the_layer_path(
        lens: list[int], kv_heads: int, groups: int, dim: int, dtype: torch.dtype,
        eight_bit: torch.dtype | None, window: int | None, softcap: float | None,
        token_major: bool, helpers: int, portable: bool, seed: int) -> None:
    """``decode_step`` (the cache writes and the attention in one C call, queries, keys
    and values in the model's dtype, the cache in it or in 8 bits, laid out token-major
    as a model's projections give them or head-major; on OpenMP or, as beside a busy
    neighbour, on helpers; built as here or as for CPUs without AVX-512) against
    writing with ``index_copy_`` (torch's rounding cast into an 8-bit cache), the kernel
    on fp32 queries and rounding the output: the same caches and the same output, bit
    for bit, laid out as the query; and ``paged_attention_forward`` takes it for such a
    step."""
    kernel = cpu_decode.CpuDecodeKernel(ctypes.CDLL(str(cpu_decode._build(portable))))
    generator = torch.Generator().manual_seed(seed)
    q_heads, tokens, block = kv_heads * groups, len(lens), 16
    module = torch.nn.Module()
    cache_dtype = dtype if eight_bit is None else eight_bit
    cache = PagedKVCache({id(module): KVCacheSpec(kv_heads, dim)}, num_blocks=48,
                         block_size=block, dtype=cache_dtype, device=torch.device("cpu"))
    for tensor in (cache.keys[0], cache.values[0]):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    blocks = torch.randperm(48, generator=generator).tolist()
    tables = []
    for n in lens:
        tables.append(blocks[:-(-n // block)] + [0] * (5 - -(-n // block)))
        blocks = blocks[-(-n // block):]
    slots = torch.tensor([table[(n - 1) // block] * block + (n - 1) % block
                          for table, n in zip(tables, lens, strict=True)])
    block_tables, context_lens = torch.tensor(tables), torch.tensor(lens)

    def projected(heads: int) -> torch.Tensor:  # [heads, tokens, dim]
        if token_major:
            return torch.randn(tokens, heads, dim, generator=generator).to(dtype).transpose(0, 1)
        return torch.randn(heads, tokens, dim, generator=generator).to(dtype)

    query, key, value = projected(q_heads), projected(kv_heads), projected(kv_heads)
    if eight_bit is not None:  # also values that round to subnormals, ties and 448+
        key = key * torch.tensor([1e-4, 1.0, 600.0])[torch.arange(tokens) % 3][None, :, None]
        key = key.to(dtype)
    keys, values = cache.keys[0].clone(), cache.values[0].clone()
    write_slots(keys, slots, key)
    write_slots(values, slots, value)
    expected = kernel(query.transpose(0, 1).float(), keys, values, block_tables,
                      context_lens, 0.3, window, softcap).transpose(0, 1).to(dtype)

    cpu_helpers.set_spare_threads(helpers)
    try:
        got = kernel.decode_step(query, key, value, slots, cache.keys[0], cache.values[0],
                                 block_tables, context_lens, 0.3, window, softcap)
    finally:
        cpu_helpers.set_spare_threads(0)
    assert got is not None and got.stride() == query.stride()
    assert torch.equal(got, expected)
    assert _same_bits(cache.keys[0], keys) and _same_bits(cache.values[0], values)

    calls = []

    def counted(*args: object) -> torch.Tensor | None:
        calls.append(args)
        return kernel.decode_step(*args)  # type: ignore[arg-type]

    metadata = PagedAttentionMetadata(
        kv_cache=cache, slot_mapping=slots, decode_kernel=kernel, decode_step=counted,
        decode_groups=[DecodeGroup(0, tokens, block_tables, context_lens)])
    out, _ = paged_attention_forward(
        module, query[None], key[None], value[None], None, scaling=0.3,
        sliding_window=window, softcap=softcap, triollm_metadata=metadata)
    assert len(calls) == 1
    assert torch.equal(out[0].transpose(0, 1), expected)


def _same_bits(first: torch.Tensor, second: torch.Tensor) -> bool:
    if first.element_size() == 1:  # torch compares no float8 tensors
        return torch.equal(first.view(torch.uint8), second.view(torch.uint8))
    return torch.equal(first, second)


def _generate(llm: LLM) -> list[list[int]]:
    prompts = ["The gardener planted beans", "A river ran", "Numbers: one two three four five"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("amx", [False, True])
def test_prefill_attention_computes_in_bf16_only_on_an_amx_cpu(
        monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """A bf16 model's prefill chunks run SDPA in bf16 where the CPU has AMX-BF16; its
    decodes, an fp32 model and a CPU without AMX compute in fp32."""
    monkeypatch.setattr(attention_compute, "_has_amx_bf16", lambda: amx)
    dtype_of = attention_compute.attention_dtype
    cache = torch.empty(1, 1, 16, 8, dtype=torch.bfloat16)
    assert dtype_of(torch.bfloat16, cache, prefill=True) == (
        torch.bfloat16 if amx else torch.float32)
    assert dtype_of(torch.bfloat16, cache, prefill=False) == torch.float32
    assert dtype_of(torch.bfloat16, cache.float(), prefill=True) == (
        torch.bfloat16 if amx else torch.float32)  # enforce_eager's fp32 cache
    assert dtype_of(torch.float32, cache.float(), prefill=True) == torch.float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_enforce_eager_uses_the_gather_path_with_the_same_answers(llama_path: Path,
                                                                  dtype: str) -> None:
    built = LLM(str(llama_path), dtype=dtype, max_model_len=128)
    eager = LLM(str(llama_path), dtype=dtype, max_model_len=128, enforce_eager=True)
    runner = built.engine.runner  # type: ignore[attr-defined]
    assert isinstance(runner.decode_kernel, cpu_decode.CpuDecodeKernel)
    # the C kernel reads the cache in the model's dtype; the gather path needs fp32
    assert runner.kv_cache.keys[0].dtype == getattr(torch, dtype)
    assert eager.engine.runner.decode_kernel is None  # type: ignore[attr-defined]
    assert eager.engine.runner.kv_cache.keys[0].dtype == torch.float32  # type: ignore[attr-defined]
    assert _generate(built) == _generate(eager)


def test_without_the_c_kernel_the_compiled_one_then_the_gather_path(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch_runner, "load_kernel", lambda: None)
    llm = LLM(str(llama_path), dtype="float32", max_model_len=128)
    assert llm.engine.runner.decode_kernel is compiled_paged_decode_attention  # type: ignore[attr-defined]

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(runner_compile, "compiled_paged_decode_attention", broken)
    with caplog.at_level(logging.WARNING, logger=runner_compile.__name__):
        llm = LLM(str(llama_path), dtype="float32", max_model_len=128)
    assert llm.engine.runner.decode_kernel is None  # type: ignore[attr-defined]
    assert "no C++ compiler here" in caplog.text
    eager = LLM(str(llama_path), dtype="float32", max_model_len=128, enforce_eager=True)
    assert _generate(llm) == _generate(eager)


def test_a_kernel_that_does_not_build_is_reported_and_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Outside the tests' strict mode: a warning that names the slower path."""
    monkeypatch.delenv("TRIOLLM_STRICT_KERNELS")
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_decode.load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_build.__name__):
            assert cpu_decode.load_kernel() is None
        assert "building the CPU decode attention kernel failed" in caplog.text
        assert "torch's decode attention (compiled, else gathering) runs instead" in caplog.text
    finally:
        cpu_decode.load_kernel.cache_clear()


def test_the_kernel_builds_into_a_cache_keyed_by_the_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path))
    first = cpu_decode._build()
    assert first.parent == tmp_path / "kernels" and cpu_decode._build() == first
    monkeypatch.setattr(native_build, "cpu_signature", lambda: "model name: another CPU")
    assert cpu_decode._build() != first


@given(widths=st.lists(st.integers(1, 80), max_size=40), padding_blocks=st.integers(0, 40))
def test_decode_spans_cover_the_step_and_bound_each_rows_padding(
        widths: list[int], padding_blocks: int) -> None:
    widths = sorted(widths, reverse=True)
    spans = runner_batch.decode_spans(widths, padding_blocks)
    assert [i for start, end in spans for i in range(start, end)] == list(range(len(widths)))
    for start, end in spans:
        for width in widths[start:end]:
            assert (width * runner_batch._MAX_DECODE_PADDING >= widths[start]
                    or widths[start] - width <= padding_blocks)
        if end < len(widths):  # a group ends only where the next decode would break both
            next_width = widths[end]
            assert next_width * runner_batch._MAX_DECODE_PADDING < widths[start]
            assert widths[start] - next_width > padding_blocks
