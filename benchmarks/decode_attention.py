"""Decode attention alone: the C kernel (model/cpu/decode.py, over an fp32, a bf16 and
an 8-bit e5m2 cache (``--kv-cache-dtype fp8_e5m2``), and its portable path over the
bf16 cache: what CPUs without AVX-512 run, the kernel as it was before its one-pass
path) and the compiled kernel, which read KV blocks in place, against gathering the
blocks and calling SDPA (the ``enforce_eager`` path), on the same cache.

One attention layer of the benchmarks' Llama (12 heads of 64, 16-token blocks), ``B``
single-token queries over contexts of ``L`` tokens in blocks scattered over a
``--blocks`` cache (4,096 by default); the whole layer's call (cache write included), as
the model makes it. Median of ``--repeats`` timings of each call.

    python benchmarks/decode_attention.py
    python benchmarks/decode_attention.py --mixed 304,160,64 300,200,120,50

``--mixed`` times a step's decodes of mixed context lengths through the compiled kernel,
grouped as the runner does (one call per group) with and without the padding allowance
the runner gives the kernel (``_KERNEL_PADDING_KEYS``).
"""

from __future__ import annotations

import argparse
import ctypes
import functools

import torch

from common import timed
from triollm.model.attention.kernel import DecodeStepKernel
from triollm.model.attention.metadata import (
    DecodeGroup,
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
)
from triollm.model.attention.paged import paged_attention_forward
from triollm.model.attention.torch_decode import compiled_paged_decode_attention
from triollm.model.cpu import decode as cpu_decode
from triollm.model.runners import batch as runner_batch
from triollm.model.runners import compile as runner_compile

HEADS, DIM, BLOCK = 12, 64, 16


@torch.inference_mode()
def _forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, metadata: PagedAttentionMetadata) -> object:
    return paged_attention_forward(module, query, key, value, None, triollm_metadata=metadata)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1x256", "4x256", "16x256", "32x192",
                                                        "48x320", "64x512"],
                        help="BATCHxCONTEXT pairs")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=4096,
                        help="blocks in the cache (4096: 200 MB, read from memory; 640: "
                             "30 MB, about what a small model's cache holds, in L3 here)")
    parser.add_argument("--mixed", nargs="+", metavar="CTX,CTX,...",
                        help="instead: one step's decodes with these context lengths")
    args = parser.parse_args()
    torch.manual_seed(0)
    module = torch.nn.Module()
    blocks = args.blocks
    cache = PagedKVCache({id(module): KVCacheSpec(HEADS, DIM)}, blocks, BLOCK, torch.float32,
                         torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    bf16_cache = PagedKVCache({id(module): KVCacheSpec(HEADS, DIM)}, blocks, BLOCK,
                              torch.bfloat16, torch.device("cpu"))
    bf16_cache.keys[0].copy_(cache.keys[0])
    bf16_cache.values[0].copy_(cache.values[0])
    fp8_cache = PagedKVCache({id(module): KVCacheSpec(HEADS, DIM)}, blocks, BLOCK,
                             torch.float8_e5m2, torch.device("cpu"))
    fp8_cache.keys[0].copy_(cache.keys[0])
    fp8_cache.values[0].copy_(cache.values[0])
    kernel = cpu_decode.load_kernel()
    if kernel is None:
        raise SystemExit("the C decode kernel did not build here (see the warning above)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one layer, "
          f"{HEADS} heads x {DIM}; median of {args.repeats}")
    if args.mixed:
        mixed(module, cache, args.mixed, args.repeats, blocks)
        return
    portable = cpu_decode.CpuDecodeKernel(ctypes.CDLL(str(cpu_decode._build(portable=True))))
    print(f"{'batch x context':>16} {'gather + SDPA':>14} {'compiled':>10} {'C fp32':>10} "
          f"{'C bf16':>10} {'C e5m2':>10} {'portable bf16':>14} {'C bf16 vs compiled':>19} "
          f"{'vs portable':>12} {'e5m2 vs bf16':>13}")
    for shape in args.shapes:
        batch, context = map(int, shape.split("x"))
        width = -(-context // BLOCK)
        order = torch.randperm(blocks)[:batch * width]
        group = DecodeGroup(0, batch, order.view(batch, width), torch.full((batch,), context))
        query = torch.randn(1, HEADS, batch, DIM)
        key = torch.randn(1, HEADS, batch, DIM)
        value = torch.randn(1, HEADS, batch, DIM)
        slots = group.block_tables[:, -1] * BLOCK + (context - 1) % BLOCK
        results = {}
        for label, each, on in (("gather", None, cache),
                                ("compiled", compiled_paged_decode_attention, cache),
                                ("C fp32", kernel, cache), ("C bf16", kernel, bf16_cache),
                                ("C e5m2", kernel, fp8_cache),
                                ("portable", portable, bf16_cache)):
            step = each.decode_step if isinstance(each, DecodeStepKernel) else None
            metadata = PagedAttentionMetadata(kv_cache=on, slot_mapping=slots,
                                              decode_groups=[group], decode_kernel=each,
                                              decode_step=step)
            results[label] = timed(functools.partial(
                _forward, module, query, key, value, metadata), args.repeats)
        print(f"{shape:>16} {results['gather'] * 1e3:11.3f} ms {results['compiled'] * 1e3:7.3f} ms"
              f" {results['C fp32'] * 1e3:7.3f} ms {results['C bf16'] * 1e3:7.3f} ms"
              f" {results['C e5m2'] * 1e3:7.3f} ms {results['portable'] * 1e3:11.3f} ms"
              f" {results['compiled'] / results['C bf16']:18.2f}x"
              f" {results['portable'] / results['C bf16']:11.2f}x"
              f" {results['C bf16'] / results['C e5m2']:12.2f}x", flush=True)


def mixed(module: torch.nn.Module, cache: PagedKVCache, steps: list[str], repeats: int,
          blocks: int) -> None:
    print(f"{'contexts':>24} {'25% rule':>16} {'with allowance':>20} {'speed-up':>9}")
    for step in steps:
        contexts = sorted((int(c) for c in step.split(",")), reverse=True)
        widths = [-(-c // BLOCK) for c in contexts]
        order = torch.randperm(blocks)[:sum(widths)].tolist()
        tables = [order[sum(widths[:i]):sum(widths[:i + 1])] for i in range(len(widths))]
        batch = len(contexts)
        query, key, value = (torch.randn(1, HEADS, batch, DIM) for _ in range(3))
        slots = torch.tensor([t[-1] * BLOCK + (c - 1) % BLOCK
                              for t, c in zip(tables, contexts, strict=True)])
        results = {}
        for label, padding_blocks in (("rule", 0),
                                      ("allowance", runner_compile._KERNEL_PADDING_KEYS // BLOCK)):
            spans = runner_batch.decode_spans(widths, padding_blocks)
            groups = [DecodeGroup(start, end, torch.tensor(
                [t + [0] * (widths[start] - len(t)) for t in tables[start:end]]),
                torch.tensor(contexts[start:end])) for start, end in spans]
            metadata = PagedAttentionMetadata(kv_cache=cache, slot_mapping=slots,
                                              decode_groups=groups,
                                              decode_kernel=compiled_paged_decode_attention)
            results[label] = (len(spans), timed(functools.partial(
                _forward, module, query, key, value, metadata), repeats))
        (rule_calls, rule_time), (calls, time) = results["rule"], results["allowance"]
        print(f"{step:>24} {rule_time * 1e3:7.3f} ms ({rule_calls} calls) {time * 1e3:9.3f} ms "
              f"({calls} calls) {rule_time / time:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
