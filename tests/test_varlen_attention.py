"""Prompt attention for pooling steps: the C kernel (model/cpu/varlen.py) agrees with
SDPA run one prompt at a time, for any mix of prompt lengths, head layouts and strides;
the attention interface takes SDPA where the kernel does not apply; and an embedding
model gives the same vectors with the kernel as without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.model.attention.varlen import VarlenMetadata, varlen_attention_forward
from triollm.model.cpu import build as native_build
from triollm.model.cpu import malloc as cpu_malloc
from triollm.model.cpu.varlen import VarlenKernel, load_varlen_kernel, packed_sdpa


def _kernel_for(dtype: torch.dtype) -> VarlenKernel:
    kernel = load_varlen_kernel()
    if kernel is None or dtype not in kernel.dtypes:
        pytest.skip(f"no varlen attention kernel for {dtype} on this CPU")
    return kernel


def test_the_kernel_loads_where_the_cpu_has_avx512() -> None:
    kernel = load_varlen_kernel()
    flags = native_build.cpu_flags()
    assert (kernel is not None) == ("avx512f" in flags)
    if kernel is not None:
        assert (torch.bfloat16 in kernel.dtypes) == ("avx512_bf16" in flags)


def _inputs(lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as ``[1, heads, T, dim]`` views of one fused projection, as transformers'
    attention modules hand them over (token stride across all heads)."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(1, sum(lengths), (heads + 2 * kv_heads) * dim,
                        generator=generator).to(dtype)
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return tuple(t.unflatten(-1, (-1, dim)).transpose(1, 2)  # type: ignore[return-value]
                 for t in (q, k, v))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       dim=st.sampled_from([16, 32, 48, 64, 80]), kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
def test_kernel_matches_sdpa_per_prompt(lengths: list[int], dim: int, kv_heads: int,
                                        group: int, causal: bool, dtype: torch.dtype,
                                        seed: int) -> None:
    kernel = _kernel_for(dtype)
    heads = kv_heads * group
    q, k, v = _inputs(lengths, heads, kv_heads, dim, dtype, seed)
    metadata = VarlenMetadata.from_lengths(lengths)
    starts, lens = metadata.span_tensors()
    got = kernel(q, k, v, starts, lens, dim ** -0.5, causal)
    assert got.dtype == dtype and got.shape == (1, sum(lengths), heads, dim)
    expected = packed_sdpa(q, k, v, lengths, dim ** -0.5, causal)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_interface_uses_the_kernel_or_sdpa_alike(dtype: torch.dtype) -> None:
    """The same call through transformers' attention interface, with the kernel and
    with it unavailable (SDPA per run of equal lengths), gives the same output; head
    sizes the kernel does not take go to SDPA."""
    _kernel_for(dtype)
    module = torch.nn.Module()
    module.is_causal = True  # type: ignore[assignment]
    lengths = [3, 9, 9, 20]
    for dim in (32, 8):
        q, k, v = _inputs(lengths, 4, 2, dim, dtype, seed=dim)
        outputs = []
        for kernel in (load_varlen_kernel(), None):
            metadata = VarlenMetadata.from_lengths(lengths, kernel)
            out, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.2,
                                              triollm_metadata=metadata)
            assert metadata.num_calls == 1
            outputs.append(out.float())
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outputs[0], outputs[1], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embeddings_are_the_same_without_the_kernel(pooling_models: dict[str, Path],
                                                    dtype: str) -> None:
    """An encoder (bidirectional) and a decoder embedder (causal, grouped-query heads)
    give the same embeddings on the kernel as under ``enforce_eager``, which keeps to
    SDPA as CPUs without AVX-512 do."""
    from triollm import LLM

    _kernel_for(getattr(torch, dtype))
    texts = ["a short one", "a somewhat longer text than the first of them, to be sure",
             "x", "the same length as the next", "the same length as the last"]
    for kind in ("bert", "qwen2"):
        embeddings = []
        for eager in (False, True):
            llm = LLM(str(pooling_models[kind]), dtype=dtype, enforce_eager=eager)
            assert (llm.engine.runner.varlen_kernel is None) == eager
            embeddings.append(np.array([output.outputs.embedding
                                        for output in llm.embed(texts, use_tqdm=False)]))
            del llm
        cosine = (embeddings[0] * embeddings[1]).sum(1)
        assert cosine.min() >= (0.99999 if dtype == "float32" else 0.999), (kind, cosine)


def test_freed_step_buffers_stay_with_the_process() -> None:
    """After ``keep_freed_memory`` a 16 MiB tensor comes from the heap, not from a fresh
    mmap (whose pages would fault in again at every step)."""
    ctypes = pytest.importorskip("ctypes")
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("not glibc 2.33+")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo2
    assert cpu_malloc.keep_freed_memory()
    before = mallinfo2().hblkhd
    buffer = torch.empty(16 * 1024 * 1024, dtype=torch.uint8)
    buffer.fill_(1)
    assert mallinfo2().hblkhd - before < 1024 * 1024  # not an mmapped block
    del buffer


def test_softcapped_logits_and_windows_are_honoured_or_refused() -> None:
    """Gemma-style logit softcapping with a causal sliding window gives what the eager
    formula gives per prompt (and not what plain attention gives); a bidirectional
    sliding window is refused, not ignored."""
    from triollm.errors import UnsupportedModelError

    module = torch.nn.Module()
    module.is_causal = True  # type: ignore[assignment]
    lengths, window, softcap = [5, 30, 30], 8, 0.5
    q, k, v = _inputs(lengths, 4, 2, 16, torch.float32, seed=3)
    q = q * 4  # scores well beyond the cap, so capping changes them
    metadata = VarlenMetadata.from_lengths(lengths, load_varlen_kernel())
    got, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.25,
                                      sliding_window=window, softcap=softcap,
                                      triollm_metadata=metadata)
    parts, start = [], 0
    for length in lengths:
        part = slice(start, start + length)
        keys, values = (t[:, :, part].repeat_interleave(2, dim=1) for t in (k, v))
        scores = q[:, :, part] @ keys.transpose(-1, -2) * 0.25
        scores = softcap * torch.tanh(scores / softcap)
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        scores = scores.masked_fill(~((distance >= 0) & (distance < window)), float("-inf"))
        parts.append((torch.softmax(scores, dim=-1) @ values).transpose(1, 2))
        start += length
    expected = torch.cat(parts, dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    uncapped, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.25,
                                           sliding_window=window,
                                           triollm_metadata=metadata)
    assert not torch.allclose(uncapped, expected, atol=1e-3)

    module.is_causal = False  # type: ignore[assignment]
    with pytest.raises(UnsupportedModelError, match="sliding window of 8"):
        varlen_attention_forward(module, q, k, v, None, sliding_window=window,
                                 triollm_metadata=metadata)
