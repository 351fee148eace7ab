"""The C kernels' helper threads (model/cpu/helpers.py), used while the thread policy computes
on one thread beside busy cores: they give the same bits as the kernels on OpenMP, the
caller never waits for a helper that is slow (descheduled) mid-unit, a unit the caller
took back is never stored by the helper later, and ``drain_pools`` waits until no helper
reads memory a call pointed it at."""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm import LLM, SamplingParams
from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.cpu.build import load_pool
from triollm.model.cpu.decode import CpuDecodeKernel, load_kernel
from triollm.model.cpu.gemm import CpuGemm, load_gemm


@pytest.fixture
def helpers() -> Iterator[None]:
    """This thread's kernels may use helpers; reset afterwards."""
    yield
    cpu_helpers.set_spare_threads(0)


def _gemm() -> CpuGemm:
    gemm = load_gemm()
    if gemm is None:
        pytest.skip("no AVX512-BF16 on this CPU")
    return gemm


def _decode() -> CpuDecodeKernel:
    kernel = load_kernel()
    if kernel is None:
        pytest.skip("the decode kernel does not build here")
    return kernel


def _pool() -> ctypes.CDLL:
    """The one helper pool every pooled kernel links."""
    return load_pool()


def _statistics() -> list[int]:
    counts = (ctypes.c_int64 * 3)()
    _pool().triollm_pool_statistics(counts)
    return list(counts)


def _decode_on_helpers() -> CpuDecodeKernel:
    """The decode kernel where its calls go to helpers: only its AVX-512 path has units
    for them; the portable one computes on the calling thread."""
    kernel = _decode()
    if not kernel.vectorized(64):
        pytest.skip("decode attention runs on helpers only on its AVX-512 path")
    return kernel


def _decode_inputs(batch: int, kv_heads: int, groups: int, dim: int, dtype: torch.dtype,
                   seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    blocks, block_size = 48, 4
    lens = torch.randint(1, 40, (batch,), generator=generator)
    width = int(-(-lens.max() // block_size))
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:width]
                          for _ in range(batch)])
    keys = torch.randn(kv_heads, blocks, block_size, dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, blocks, block_size, dim, generator=generator).to(dtype)
    query = torch.randn(batch, kv_heads * groups, dim, generator=generator)
    return query, keys, values, tables, lens


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), blocks=st.integers(1, 9),
       pairs=st.one_of(st.integers(1, 70), st.sampled_from([16, 48])),  # 16k: AMX tiles
       with_bias=st.booleans(), count=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_gemm_with_helpers_gives_the_bits_of_openmp(rows: int, blocks: int, pairs: int,
                                                    with_bias: bool, count: int,
                                                    seed: int) -> None:
    gemm = _gemm()
    generator = torch.Generator().manual_seed(seed)
    packed = gemm.pack(torch.randn(16 * blocks, 2 * pairs, generator=generator).bfloat16())
    bias = torch.randn(16 * blocks, generator=generator) if with_bias else None
    x = torch.randn(rows, 2 * pairs, generator=generator).bfloat16()
    expected = gemm(x, packed, bias)
    cpu_helpers.set_spare_threads(count)
    try:
        got = gemm(x, packed, bias)
    finally:
        cpu_helpers.set_spare_threads(0)
    assert torch.equal(got, expected)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 12), kv_heads=st.integers(1, 4), groups=st.integers(1, 3),
       dim=st.sampled_from([8, 16, 48, 64, 128]), bf16=st.booleans(),
       window=st.sampled_from([0, 5]), count=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_decode_attention_with_helpers_gives_the_bits_of_openmp(
        batch: int, kv_heads: int, groups: int, dim: int, bf16: bool, window: int,
        count: int, seed: int) -> None:
    """Head sizes off the vector path (8) run on the calling thread alone."""
    kernel = _decode()
    query, keys, values, tables, lens = _decode_inputs(
        batch, kv_heads, groups, dim, torch.bfloat16 if bf16 else torch.float32, seed)
    expected = kernel(query, keys, values, tables, lens, 0.3, window or None, None)
    cpu_helpers.set_spare_threads(count)
    try:
        got = kernel(query, keys, values, tables, lens, 0.3, window or None, None)
    finally:
        cpu_helpers.set_spare_threads(0)
    assert torch.equal(got, expected)


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="helpers exist on Linux only")


def _until_a_helper_takes_a_unit(call: Callable[[], torch.Tensor]
                                 ) -> list[torch.Tensor]:
    """Calls (zeroing each output) until a helper, stalling after taking each unit, held
    one when the caller finished, so the caller took it back; the outputs. Each call
    asserts that it returned while that helper was still inside the job (stalled), that
    is without waiting for it."""
    outputs = []
    for _ in range(200):
        retaken = _statistics()[2]
        out = call()
        if _statistics()[2] > retaken:
            assert _pool().triollm_pool_busy() > 0, "the call waited for the stalled helper"
            out.zero_()
            outputs.append(out)
            return outputs
        out.zero_()
        outputs.append(out)
        time.sleep(0.005)  # lets the helpers go back to sleep between calls
    pytest.fail("no helper ever took a unit")


_STALL_US = 1_000_000  # long beside a call, so a helper stalled on a unit is still inside


@linux_only
@pytest.mark.parametrize("which", ["gemm", "decode"])
def test_a_stalled_helper_neither_holds_up_the_caller_nor_stores_late(
        which: str, helpers: None) -> None:
    """A helper that stops after taking each unit (as if descheduled): every call returns
    the right answer while it is still stalled, the unit it held is retaken by the
    caller, and what it computes on waking is never stored (the outputs, zeroed after
    each call, stay zero through ``drain_pools``)."""
    kernel: CpuGemm | CpuDecodeKernel = _gemm() if which == "gemm" else _decode_on_helpers()
    generator = torch.Generator().manual_seed(0)
    if isinstance(kernel, CpuGemm):
        gemm = kernel
        packed = gemm.pack(torch.randn(1024, 256, generator=generator).bfloat16())
        x = torch.randn(64, 256, generator=generator).bfloat16()
        expected = gemm(x, packed, None)

        def call() -> torch.Tensor:
            out = gemm(x, packed, None)
            assert torch.equal(out, expected)
            return out
    else:
        decode = kernel
        case = _decode_inputs(48, 4, 2, 64, torch.float32, 0)
        expected = decode(*case, 0.3, None, None)

        def call() -> torch.Tensor:
            out = decode(*case, 0.3, None, None)
            assert torch.equal(out, expected)
            return out
    _pool().triollm_pool_set_helper_delay(_STALL_US)
    try:
        cpu_helpers.set_spare_threads(1)
        outputs = _until_a_helper_takes_a_unit(call)
    finally:
        _pool().triollm_pool_set_helper_delay(0)
        cpu_helpers.drain_pools()
    assert _pool().triollm_pool_busy() == 0
    assert all(not out.any() for out in outputs), "a helper stored a unit it had lost"


@linux_only
def test_drain_waits_for_a_helper_inside_a_job(helpers: None) -> None:
    """Once a helper holds a unit it then lost (it stalls after taking it), drain
    returns only after the helper has left the job."""
    gemm = _gemm()
    packed = gemm.pack(torch.randn(1024, 256).bfloat16())
    x = torch.randn(64, 256).bfloat16()
    _pool().triollm_pool_set_helper_delay(_STALL_US)
    try:
        cpu_helpers.set_spare_threads(1)
        _until_a_helper_takes_a_unit(lambda: gemm(x, packed, None))
        inside = _pool().triollm_pool_busy()
        cpu_helpers.drain_pools()
        left = _pool().triollm_pool_busy()
    finally:
        _pool().triollm_pool_set_helper_delay(0)
    assert inside > 0 and left == 0, "drain returned while the helper still held the job"


@linux_only
def test_a_call_uses_no_more_helpers_than_its_thread_may(helpers: None) -> None:
    """Helpers made for an earlier call that wanted three stay out of a call whose
    thread may use one: with each helper stalling on the unit it takes, the first call
    any helper joins has exactly one unit taken back."""
    gemm = _gemm()
    packed = gemm.pack(torch.randn(1024, 256).bfloat16())
    x = torch.randn(64, 256).bfloat16()
    cpu_helpers.set_spare_threads(3)
    gemm(x, packed, None)  # makes three helpers
    cpu_helpers.drain_pools()
    _pool().triollm_pool_set_helper_delay(300_000)
    try:
        cpu_helpers.set_spare_threads(1)
        for _ in range(200):
            retaken = _statistics()[2]
            gemm(x, packed, None)
            taken_back = _statistics()[2] - retaken
            if taken_back:
                break
            time.sleep(0.005)
        else:
            pytest.fail("no helper ever took a unit")
    finally:
        _pool().triollm_pool_set_helper_delay(0)
        cpu_helpers.drain_pools()
    assert taken_back == 1, f"{taken_back} helpers joined a call that may use one"


def test_two_threads_calling_at_once_each_get_their_answer(helpers: None) -> None:
    """One caller at a time uses the pool; the other computes alone meanwhile."""
    gemm = _gemm()
    generator = torch.Generator().manual_seed(1)
    packed = gemm.pack(torch.randn(512, 256, generator=generator).bfloat16())
    inputs = [torch.randn(32, 256, generator=generator).bfloat16() for _ in range(2)]
    expected = [gemm(x, packed, None) for x in inputs]
    failures: list[int] = []

    def caller(index: int) -> None:
        cpu_helpers.set_spare_threads(1)
        for _ in range(200):
            if not torch.equal(gemm(inputs[index], packed, None), expected[index]):
                failures.append(index)

    threads = [threading.Thread(target=caller, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_greedy_tokens_are_the_same_with_helpers(llama_path: Path, helpers: None) -> None:
    """A whole model in bf16 (the GEMM kernel and decode attention both on helpers)."""
    llm = LLM(str(llama_path), dtype="bfloat16", max_model_len=128, cpu_threads=1)
    prompts = ["the quick brown fox", "a b c d e f", "hello"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    cpu_helpers.set_spare_threads(1)
    before = _statistics()[0]
    helped = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    config = json.loads((llama_path / "config.json").read_text())
    if _decode().vectorized(config["hidden_size"] // config["num_attention_heads"]):
        assert _statistics()[0] > before, "decode attention did not run on the pool"
    assert helped == alone
