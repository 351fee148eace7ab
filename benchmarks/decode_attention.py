"""Decode attention alone: the compiled kernel that reads KV blocks in place against
gathering the blocks and calling SDPA (the ``enforce_eager`` path), on the same cache.

One attention layer of the benchmarks' Llama (12 heads of 64, fp32 cache as on CPU,
16-token blocks), ``B`` single-token queries over contexts of ``L`` tokens in blocks
scattered over a 4,096-block cache. Median of ``--repeats`` timings of each call.

    python benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import functools

import torch

from common import timed
from triollm.model.attention import (
    DecodeGroup,
    KVCacheSpec,
    PagedAttentionMetadata,
    PagedKVCache,
    compiled_paged_decode_attention,
    paged_attention_forward,
)

HEADS, DIM, BLOCK, BLOCKS = 12, 64, 16, 4096


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
    args = parser.parse_args()
    torch.manual_seed(0)
    module = torch.nn.Module()
    cache = PagedKVCache({id(module): KVCacheSpec(HEADS, DIM)}, BLOCKS, BLOCK, torch.float32,
                         torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one layer, "
          f"{HEADS} heads x {DIM}, fp32 cache; median of {args.repeats}")
    print(f"{'batch x context':>16} {'gather + SDPA':>14} {'compiled':>10} {'speed-up':>9}")
    for shape in args.shapes:
        batch, context = map(int, shape.split("x"))
        width = -(-context // BLOCK)
        order = torch.randperm(BLOCKS)[:batch * width]
        group = DecodeGroup(0, batch, order.view(batch, width), torch.full((batch,), context))
        query = torch.randn(1, HEADS, batch, DIM)
        key = torch.randn(1, HEADS, batch, DIM)
        value = torch.randn(1, HEADS, batch, DIM)
        slots = group.block_tables[:, -1] * BLOCK + (context - 1) % BLOCK
        results = {}
        for label, kernel in (("gather", None), ("compiled", compiled_paged_decode_attention)):
            metadata = PagedAttentionMetadata(kv_cache=cache, slot_mapping=slots,
                                              decode_groups=[group], decode_kernel=kernel)

            results[label] = timed(functools.partial(
                _forward, module, query, key, value, metadata), args.repeats)
        print(f"{shape:>16} {results['gather'] * 1e3:11.3f} ms {results['compiled'] * 1e3:7.3f} ms"
              f" {results['gather'] / results['compiled']:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
