"""Quantized linear layers alone, on the same random weights: bf16 ``PackedLinear`` as
the engine builds it, torch's int4/int8 ops (model/quantization/kernels.py) and
triollm's own int4/int8 kernel for this CPU (AVX512-BF16's or AVX2's, the one
``quantized_or_plain`` picks), per Qwen2.5-0.5B layer shape, ms per call (median of
``--repeats``), and the weight bytes each reads a second at one row. int4 is in groups
of ``--group-size``, int8 per channel (as ``--quantization int4``/``int8`` make them).

    python benchmarks/quantized_layers.py
    python benchmarks/quantized_layers.py --rows 1 4 16 64 512 --repeats 50
"""

from __future__ import annotations

import argparse
import functools

import torch

from common import timed
from triollm.model.cpu.packed_linear import PackedLinear
from triollm.model.quantization.avx2_kernels import avx2_kernel_for
from triollm.model.quantization.avx512_kernels import avx512_kernel_for
from triollm.model.quantization.kernels import Int4Kernel, Int8Kernel, QuantizedKernel
from triollm.model.quantization.quantize import quantize_weight

#: Qwen2.5-0.5B's linear layers, ``[out, in]``.
SHAPES = {"q/o": (896, 896), "gate/up": (4864, 896), "down": (896, 4864),
          "lm head": (151936, 896)}


def ours(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedKernel | None:
    quantized = quantize_weight(weight, bits, group_size)
    return (avx512_kernel_for(quantized, torch.bfloat16)
            or avx2_kernel_for(quantized, torch.bfloat16))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.repeats}; int4 in groups of {args.group_size}, int8 per channel; ms per "
          "call (GB/s of weights read at one row)")
    columns = ["bf16 packed", "int4 torch", "int4 ours", "int8 torch", "int8 ours"]
    print(f"{'layer':>8} {'rows':>5} " + " ".join(f"{c:>18}" for c in columns))
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features) * in_features ** -0.5
        bf16 = weight.bfloat16()
        int4 = quantize_weight(weight, 4, args.group_size)
        int8 = quantize_weight(weight, 8, -1)
        layers: list[tuple[torch.nn.Module | QuantizedKernel | None, int]] = []
        packed = PackedLinear(bf16, None)
        layers.append((packed, bf16.nbytes))
        for kernel in (Int4Kernel.build(int4, torch.bfloat16),
                       ours(weight, 4, args.group_size),
                       Int8Kernel.build(int8, torch.bfloat16), ours(weight, 8, -1)):
            layers.append((kernel, 0 if kernel is None else kernel.nbytes))
        for rows in args.rows:
            x = torch.randn(rows, in_features).bfloat16()
            cells = []
            for layer, nbytes in layers:
                if layer is None:
                    cells.append(f"{'-':>18}")
                    continue
                seconds = timed(functools.partial(layer, x), args.repeats)
                rate = f" ({nbytes / seconds / 1e9:5.1f})" if rows == 1 else ""
                cells.append(f"{1000 * seconds:>10.3f}{rate:>8}")
            print(f"{name:>8} {rows:5d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
