"""``--kv-cache-dtype``: an 8-bit KV cache holds twice a bf16 cache's blocks in the same
memory, its attention stays within the format's precision of the unquantized cache's
(where a zeroed, swapped or misread cache does not), a model decodes with it as with the
unquantized cache, and values not built are refused by name."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from triollm import LLM, EngineArgs, SamplingParams
from triollm.cli import build_parser, engine_args_from_namespace
from triollm.lora.request import LoRARequest
from triollm.model.attention import compute
from triollm.model.attention.kernel import DecodeStepKernel
from triollm.model.attention.kv_storage import EIGHT_BIT_CACHE_DTYPES, write_slots
from triollm.model.attention.metadata import (
    DecodeGroup,
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
)
from triollm.model.attention.paged import paged_attention_forward
from triollm.model.cpu import decode as cpu_decode
from triollm.model.quantization.kv_cache_dtype import KV_CACHE_DTYPES

#: Mantissa bits of each 8-bit format: rounding to nearest errs by at most 2^-(m+1).
MANTISSA_BITS = {torch.float8_e5m2: 2, torch.float8_e4m3fn: 3}
BLOCK = 16


def _layer_outputs(cache_dtype: torch.dtype, portable: bool,
                   corrupt: str | None = None) -> torch.Tensor:
    """One attention layer (GQA, head size 64) for a step of decodes over contexts of
    up to 300 tokens: the contexts' keys and values written through the C kernel's
    one-call step into a cache of ``cache_dtype``, ``corrupt``-ed if asked, then the
    last tokens' attention read back through the kernel. ``[B, Hq, D]`` fp32."""
    kernel = cpu_decode.CpuDecodeKernel(ctypes.CDLL(str(cpu_decode._build(portable))))
    generator = torch.Generator().manual_seed(7)
    lens, kv_heads, q_heads, dim = [300, 77, 5], 2, 4, 64
    module = torch.nn.Module()
    cache = PagedKVCache({id(module): KVCacheSpec(kv_heads, dim)}, num_blocks=40,
                         block_size=BLOCK, dtype=cache_dtype, device=torch.device("cpu"))
    widths = [-(-n // BLOCK) for n in lens]
    blocks = torch.randperm(40, generator=generator).tolist()
    tables = []
    for width in widths:
        tables.append(blocks[:width] + [0] * (max(widths) - width))
        blocks = blocks[width:]
    block_tables, context_lens = torch.tensor(tables), torch.tensor(lens)
    # Every position of every context, written as decode steps write them.
    positions = [(row, p) for row, n in enumerate(lens) for p in range(n)]
    slots = torch.tensor([tables[row][p // BLOCK] * BLOCK + p % BLOCK for row, p in positions])
    keys = torch.randn(kv_heads, len(positions), dim, generator=generator)
    values = torch.randn(kv_heads, len(positions), dim, generator=generator)
    queries = torch.randn(q_heads, len(positions), dim, generator=generator)
    write_slots(cache.keys[0], slots, keys)
    write_slots(cache.values[0], slots, values)
    if corrupt == "zeroed":
        cache.keys[0].view(torch.uint8).zero_()
        cache.values[0].view(torch.uint8).zero_()
    elif corrupt == "keys read as values":
        cache.keys[0].copy_(cache.values[0])
    elif corrupt == "misread format":  # the other 8-bit format's bytes
        other = next(d for d in EIGHT_BIT_CACHE_DTYPES if d != cache_dtype)
        cache.keys[0] = cache.keys[0].view(other)
        cache.values[0] = cache.values[0].view(other)
    last = torch.tensor([sum(lens[:row + 1]) - 1 for row in range(len(lens))])
    group = DecodeGroup(0, len(lens), block_tables, context_lens)
    metadata = PagedAttentionMetadata(
        kv_cache=cache, slot_mapping=slots[last], decode_groups=[group],
        decode_kernel=kernel, decode_step=kernel.decode_step
        if isinstance(kernel, DecodeStepKernel) else None)
    out, _ = paged_attention_forward(
        module, queries[:, last][None], keys[:, last][None], values[:, last][None], None,
        scaling=dim ** -0.5, triollm_metadata=metadata)
    return out[0]  # [B, Hq, D]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The worst row's ``|got - expected| / |expected|``."""
    return float(((got - expected).norm(dim=-1) / expected.norm(dim=-1)).max())


@pytest.mark.parametrize("portable", [False, True], ids=["as-built", "portable"])
@pytest.mark.parametrize("cache_dtype", EIGHT_BIT_CACHE_DTYPES, ids=str)
def test_attention_over_an_eight_bit_cache_is_within_the_formats_precision(
        cache_dtype: torch.dtype, portable: bool) -> None:
    """Rounding each key and value to m mantissa bits errs by at most u = 2^-(m+1) of
    it; through the softmax that stays within 2u of each output row (measured: about
    u/2). A cache the kernel zeroes, whose keys it takes from the values, or whose bytes
    it reads as the other format, is off by far more."""
    exact = _layer_outputs(torch.float32, portable)
    bound = 2 * 2.0 ** -(MANTISSA_BITS[cache_dtype] + 1)
    assert _relative_error(_layer_outputs(cache_dtype, portable), exact) < bound
    for corrupt in ("zeroed", "keys read as values", "misread format"):
        broken = _layer_outputs(cache_dtype, portable, corrupt)
        assert _relative_error(broken, exact) > 2 * bound, corrupt


def test_an_eight_bit_cache_holds_twice_the_blocks_of_bf16_in_the_same_memory(
        llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    common: dict[str, Any] = dict(max_model_len=128, kv_cache_space_gb=2**-10,
                                  max_num_seqs=64)
    bf16 = LLM(str(llama_path), dtype="bfloat16", **common)
    with caplog.at_level(logging.INFO, logger="triollm.model.runners"):
        fp8 = LLM(str(llama_path), dtype="bfloat16", kv_cache_dtype="fp8_e5m2", **common)
    assert "KV cache float8_e5m2 (--kv-cache-dtype fp8_e5m2)" in caplog.text
    runners = [llm.engine.runner for llm in (bf16, fp8)]  # type: ignore[attr-defined]
    assert runners[0].kv_cache.keys[0].dtype == torch.bfloat16
    assert runners[1].kv_cache.keys[0].dtype == torch.float8_e5m2
    assert runners[1].num_kv_blocks == 2 * runners[0].num_kv_blocks
    assert fp8.engine.block_manager.num_blocks == runners[1].num_kv_blocks


PROMPTS = ["The gardener planted beans in the", "A river ran", "one two three four",
           "Numbers: 1 2 3 5 8 13"]


def _greedy_logprobs(llm: LLM) -> list[list[tuple[int, float]]]:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, logprobs=0,
                                                   ignore_eos=True), use_tqdm=False)
    return [[(token, lp[token].logprob) for token, lp in zip(
        o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)] for o in outputs]


def _worst_deviation(got: list[list[tuple[int, float]]],
                     expected: list[list[tuple[int, float]]]) -> float:
    """The largest difference of the greedy token's log-probability between two runs,
    over each prompt's steps up to the first where their tokens differ (included)."""
    worst = 0.0
    for run, reference in zip(got, expected, strict=True):
        for (token, logprob), (want, want_logprob) in zip(run, reference, strict=True):
            worst = max(worst, abs(logprob - want_logprob))
            if token != want:
                break
    return worst


def _quantized_llm(llama_path: Path, kv_cache_dtype: str, **extra: Any) -> LLM:
    """The tiny Llama in fp32, prefills chunked so that later chunks read the cache."""
    return LLM(str(llama_path), dtype="float32", max_model_len=256,
               num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype,
               max_num_batched_tokens=4, **extra)


@pytest.mark.parametrize(("kv_cache_dtype", "cache_dtype"), [
    ("fp8_e5m2", torch.float8_e5m2), ("fp8", torch.float8_e4m3fn)])
def test_greedy_decoding_over_an_eight_bit_cache_agrees_with_the_unquantized_one(
        llama_path: Path, llama_llm: LLM, kv_cache_dtype: str, cache_dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes through the C kernel's one-call step, prefill chunks reading the cache:
    while the tokens agree with the unquantized cache's, and at the first that does not
    (a near tie), the greedy token's log-probability is within 4u of it, u = 2^-(m+1)
    for the format's m mantissa bits (measured: about 2u on this sharp tiny model).
    A cache written as zeros is not (measured: 6u of e5m2)."""
    tolerance = 4 * 2.0 ** -(MANTISSA_BITS[cache_dtype] + 1)
    expected = _greedy_logprobs(llama_llm)
    got = _greedy_logprobs(_quantized_llm(llama_path, kv_cache_dtype))
    assert _worst_deviation(got, expected) < tolerance
    if cache_dtype == torch.float8_e5m2:
        monkeypatch.setattr(compute, "write_slots", lambda cache, slots, tensor: write_slots(
            cache, slots, torch.zeros_like(tensor)))
        broken = _quantized_llm(llama_path, kv_cache_dtype, enforce_eager=True)
        assert _worst_deviation(_greedy_logprobs(broken), expected) > tolerance


@pytest.mark.parametrize("value", ["int8_per_token_head", "bfloat16", "fp4", "int8"])
def test_a_kv_cache_dtype_not_built_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_dtype: '{value}' is not supported"):
        EngineArgs(kv_cache_dtype=value).create_engine_config()


@pytest.mark.parametrize("value", sorted(KV_CACHE_DTYPES))
def test_the_flag_reaches_the_engine_config(value: str, llama_path: Path) -> None:
    namespace = build_parser().parse_args(
        ["serve", str(llama_path), "--kv-cache-dtype", value])
    args = engine_args_from_namespace(namespace)
    assert args.kv_cache_dtype == value
    args.model = str(llama_path)
    assert args.create_engine_config().cache.cache_dtype == value


def test_a_pooling_model_refuses_an_eight_bit_cache(llama_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8_e5m2': a pooling model"):
        EngineArgs(model=str(llama_path), runner="pooling",
                   kv_cache_dtype="fp8_e5m2").create_engine_config()


def test_the_compiled_forward_reads_an_eight_bit_cache_as_the_eager_one(
        llama_path: Path) -> None:
    common: dict[str, Any] = dict(dtype="float32", max_model_len=128, cpu_threads=1,
                                  num_gpu_blocks_override=128, kv_cache_dtype="fp8_e5m2",
                                  max_num_batched_tokens=7)
    compiled = LLM(str(llama_path), optimization_level=2, **common)
    assert compiled.engine.runner.compiled  # type: ignore[attr-defined]
    eager = LLM(str(llama_path), **common)
    got, expected = _greedy_logprobs(compiled), _greedy_logprobs(eager)
    assert [[token for token, _ in run] for run in got] == [
        [token for token, _ in run] for run in expected]
    assert _worst_deviation(got, expected) < 1e-4


def test_an_eight_bit_cache_serves_lora_over_quantized_weights_with_prefix_hits(
        lora_models: dict[str, Path]) -> None:
    """int8 weights, an adapter on q/v, the cache in e5m2: a prompt asked again hits the
    prefix cache and gets the same answer from the cached (rounded) blocks."""
    llm = LLM(str(lora_models["llama"]), dtype="float32", max_model_len=128,
              num_gpu_blocks_override=64, kv_cache_dtype="fp8_e5m2", quantization="int8",
              enable_lora=True, max_lora_rank=8)
    adapter = LoRARequest("qv8", 1, str(lora_models["qv8"]))
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    answers = [llm.generate([prompt], greedy, lora_request=adapter, use_tqdm=False)[0]
               for _ in range(3)]
    assert llm.engine.statistics().prefix_cache_hits > 0
    assert answers[1].outputs[0].token_ids == answers[2].outputs[0].token_ids
