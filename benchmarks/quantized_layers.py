"""Quantized linear layers alone, on the same random weights: bf16 ``PackedLinear`` as
the engine builds it, torch's int4/int8 ops (model/quantization/kernels.py) and
triollm's own int4/int8 kernel for this CPU (AVX512-BF16's or AVX2's, the one
``quantized_or_plain`` picks), per Qwen2.5-0.5B layer shape, ms per call (median of
``--repeats``), and the weight bytes each reads a second at one row. int4 is in groups
of ``--group-size``, int8 per channel (as ``--quantization int4``/``int8`` make them).
A layer timed alone is read from the CPU's caches after its first call; ``--token``
times instead one decode token's linear layers (the 7 of each of 24 layers, each a
copy of its own, so that they come from memory as in the engine) on every kernel this
CPU has, including each int4/int8 kernel below the one the engine picks, and on an AMX
CPU each AVX-512 kernel also kept on its own path at every row count ("no tiles": no AMX
tiles, no dequantizing for torch's ``linear``), taken in turn with the default; and per
layer shape, what one call takes and the GB/s of weights it reads (a small layer's call
pays the Python of the call and the start of its stream on fewer bytes).

    python benchmarks/quantized_layers.py
    python benchmarks/quantized_layers.py --rows 1 4 16 64 512 --repeats 50
    python benchmarks/quantized_layers.py --token --rows 1 4
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Iterator

import torch

from common import timed
from triollm.model.cpu.packed_linear import PackedLinear
from triollm.model.quantization.avx2_kernels import avx2_kernel_for
from triollm.model.quantization.avx512_kernels import (
    Avx512Gemm,
    avx512_kernel_for,
    load_avx512_gemm,
)
from triollm.model.quantization.kernels import Int4Kernel, Int8Kernel, QuantizedKernel
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.vnni_kernels import load_vnni_gemm, vnni_kernel_for

#: Qwen2.5-0.5B's linear layers, ``[out, in]``.
SHAPES = {"q/o": (896, 896), "gate/up": (4864, 896), "down": (896, 4864),
          "lm head": (151936, 896)}


#: One Qwen2.5-0.5B decoder layer's projections in call order (q, k, v, o, gate, up,
#: down) and its layer count.
TOKEN_LAYERS = [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896),
                (896, 4864)]
LAYERS = 24
#: The weights of one token's layers (each layer's share of a kernel's bytes is its share
#: of these).
TOKEN_WEIGHTS = LAYERS * sum(out * in_ for out, in_ in TOKEN_LAYERS)
KERNELS = {"vnni": vnni_kernel_for, "avx512": avx512_kernel_for, "avx2": avx2_kernel_for}


def ours(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedKernel | None:
    quantized = quantize_weight(weight, bits, group_size)
    return (vnni_kernel_for(quantized, torch.bfloat16)
            or avx512_kernel_for(quantized, torch.bfloat16)
            or avx2_kernel_for(quantized, torch.bfloat16))


def one_token(rows: list[int], repeats: int, group_size: int) -> None:
    """``--token``: ms for one decode token's layers per kernel, median over
    ``repeats`` passes taken in turn, and the GB/s of weights that makes."""
    passes: dict[str, list[torch.nn.Module | QuantizedKernel]] = {"bf16 packed": []}
    nbytes: dict[str, int] = {"bf16 packed": 0}
    for _ in range(LAYERS):
        for shape in TOKEN_LAYERS:
            weight = torch.randn(*shape) * shape[1] ** -0.5
            passes["bf16 packed"].append(PackedLinear(weight.bfloat16(), None))
            nbytes["bf16 packed"] += 2 * weight.numel()
            for bits, group in ((4, group_size), (8, -1)):
                quantized = quantize_weight(weight, bits, group)
                for name, kernel_for in KERNELS.items():
                    kernel = kernel_for(quantized, torch.bfloat16)
                    if kernel is not None:
                        passes.setdefault(f"int{bits} {name}", []).append(kernel)
                        nbytes[f"int{bits} {name}"] = nbytes.get(f"int{bits} {name}",
                                                                 0) + kernel.nbytes
    # on AMX CPUs, the kernel's own path at every row count besides the one it takes
    native = {"vnni": load_vnni_gemm(), "avx512": load_avx512_gemm()}
    for name in list(passes):
        gemm = native.get(name.rpartition(" ")[2])
        if isinstance(gemm, Avx512Gemm) and gemm.tiles_from is not None:
            passes[f"{name} no tiles"] = passes[name]
            nbytes[f"{name} no tiles"] = nbytes[name]
    for count in rows:
        inputs = {k: torch.randn(count, k).bfloat16() for k in {s[1] for s in TOKEN_LAYERS}}
        times: dict[str, list[float]] = {name: [] for name in passes}
        # per kernel and shape: seconds per pass, summed over the token's layers
        by_shape = {name: {shape: [0.0] * repeats for shape in TOKEN_LAYERS}
                    for name in passes}
        for repeat in range(repeats):
            for name, layers in passes.items():
                with _kernel_paths_off(native[name.split()[1]] if name.endswith(" no tiles")
                                       else None):
                    started = last = time.perf_counter()
                    for layer, shape in zip(layers, TOKEN_LAYERS * LAYERS, strict=True):
                        layer(inputs[shape[1]])
                        now = time.perf_counter()
                        by_shape[name][shape][repeat] += now - last
                        last = now
                    times[name].append(time.perf_counter() - started)
        for name, seconds in times.items():
            median = statistics.median(seconds[2:])
            shares = []
            for shape, spent in by_shape[name].items():
                calls = TOKEN_LAYERS.count(shape) * LAYERS
                share = statistics.median(spent[2:])
                layer_bytes = nbytes[name] * shape[0] * shape[1] / TOKEN_WEIGHTS
                shares.append(f"{shape[0]}x{shape[1]} {1e6 * share / calls:.0f} us "
                              f"({calls * layer_bytes / share / 1e9:.1f} GB/s)")
            print(f"rows {count:3d}  {name:12s} {1000 * median:8.2f} ms "
                  f"({nbytes[name] / median / 1e9:5.1f} GB/s); a call: "
                  + ", ".join(shares), flush=True)


@contextlib.contextmanager
def _kernel_paths_off(gemm: object) -> Iterator[None]:
    """With ``gemm`` (an ``Avx512Gemm``; None: nothing changes) computing every row count
    on its own kernel: no AMX tiles, no dequantizing for torch's ``linear``."""
    if not isinstance(gemm, Avx512Gemm):
        yield
        return
    saved = gemm.tiles_from, gemm.dequantize_int4_from, gemm.dequantize_int8_from
    gemm.tiles_from = gemm.dequantize_int4_from = gemm.dequantize_int8_from = None
    try:
        yield
    finally:
        gemm.tiles_from, gemm.dequantize_int4_from, gemm.dequantize_int8_from = saved


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--token", action="store_true",
                        help="one decode token's 168 layers, each from memory")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.token:
        one_token(args.rows, max(args.repeats // 2, 5), args.group_size)
        return
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
