"""Pooling-step attention alone: the C kernel (model/cpu/varlen.py) against SDPA called
once per run of equal-length prompts (what model/attention/varlen.py calls where the kernel
does not apply), on the same packed row.

One attention layer of ``--heads`` heads over ``--prompts`` prompts of random lengths
in ``[8, 250]`` (seeded), q, k and v as views of one fused projection as transformers
hands them over; fp32 and bf16; median of ``--repeats`` timings of the whole layer's
call (SDPA's fp32 copies of bf16 inputs included, as the fallback makes them).

    python benchmarks/varlen_attention.py
    python benchmarks/varlen_attention.py --dims 32 64 128 --prompts 32
"""

from __future__ import annotations

import argparse

import torch

from common import timed
from triollm.model.attention.varlen import VarlenMetadata, varlen_attention_forward
from triollm.model.cpu.varlen import load_varlen_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    kernel = load_varlen_kernel()
    if kernel is None:
        raise SystemExit("no varlen attention kernel on this CPU (needs AVX-512)")
    generator = torch.Generator().manual_seed(args.seed)
    lengths = sorted(int(n) for n in torch.randint(8, 251, (args.prompts,),
                                                   generator=generator))
    module = torch.nn.Module()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one layer, "
          f"{args.heads} heads, {args.prompts} prompts of {min(lengths)}-{max(lengths)} "
          f"tokens ({sum(lengths)} in all)")
    print(f"{'head size':>9} {'dtype':>9} {'SDPA per prompt':>16} {'kernel':>10} {'speed-up':>9}")
    for dim in args.dims:
        for dtype in (torch.bfloat16, torch.float32):
            if dtype not in kernel.dtypes:
                continue
            fused = torch.randn(1, sum(lengths), 3, args.heads, dim,
                                generator=generator).to(dtype)
            q, k, v = (fused[:, :, i].transpose(1, 2) for i in range(3))
            times = {}
            for name, chosen in (("sdpa", None), ("kernel", kernel)):
                metadata = VarlenMetadata.from_lengths(lengths, chosen)
                times[name] = timed(
                    lambda metadata=metadata: varlen_attention_forward(  # type: ignore[misc]
                        module, q, k, v, None, scaling=dim ** -0.5,  # noqa: B023
                        triollm_metadata=metadata), args.repeats)
            print(f"{dim:>9} {str(dtype).removeprefix('torch.'):>9} "
                  f"{times['sdpa'] * 1e3:13.2f} ms {times['kernel'] * 1e3:7.2f} ms "
                  f"{times['sdpa'] / times['kernel']:8.2f}x")


if __name__ == "__main__":
    main()
