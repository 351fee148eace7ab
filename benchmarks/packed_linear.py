"""Linear layers alone, on the same weights: aten's ``linear`` on the loaded weights,
oneDNN's linear on weights packed once into its layout, and ``PackedLinear`` as the
engine builds it (``triollm.model.cpu.packed_linear``: for bf16 on a CPU with AVX512-BF16 the
kernel of ``triollm.model.cpu.gemm``, with AVX2 alone where oneDNN cannot pack bf16 that
of ``triollm.model.cpu.gemm_avx2``, else oneDNN, so the last two columns then agree).

Every linear layer of the benchmarks' Llama (12 layers, hidden 768, the serving
benchmark's 512-token vocabulary), ``M`` rows of input each: ``M=1`` is a lone decode
step, 32-64 a busy decode batch, 512 a prefill chunk. Median of ``--repeats`` timings
of one pass over all layers.

``--shapes qwen0.5b`` times each of Qwen2.5-0.5B's layer shapes alone instead (q/o,
k/v, gate/up, down and the 151,936-token LM head): aten bf16, aten fp32 and
``PackedLinear`` on bf16. ``--shapes qwen0.5b-token`` times one decode token's bf16
layers of that shape (each a copy of its own, so that they stream from memory as in the
engine). On a CPU with AMX every mode adds a column with the bf16 kernel kept off its
AMX tiles (``vdpbf16ps`` alone), timed in turn with the tiles, and ``qwen0.5b`` one
with the row-major kernel a tied LM head runs on (tied_head.py: the weight as loaded,
not packed).

    python benchmarks/packed_linear.py
    python benchmarks/packed_linear.py --shapes qwen0.5b --rows 1 4 16 64 512
    python benchmarks/packed_linear.py --shapes qwen0.5b-token --rows 1 4 8 16 64
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from common import timed
from triollm.model.cpu.gemm import load_gemm
from triollm.model.cpu.gemm_avx2 import load_avx2_gemm
from triollm.model.cpu.packed_linear import PackedLinear, _bf16_gemm, _linear

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 768, 2048, 12, 512
#: One Qwen2.5-0.5B decoder layer's projections (q, k, v, o, gate, up, down), and its
#: layer count.
TOKEN_LAYERS_05B = [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896),
                    (4864, 896), (896, 4864)]
LAYERS_05B = 24
#: Qwen2.5-0.5B's linear layers, ``[out, in]``.
QWEN_SHAPES = {"q/o": (896, 896), "k/v": (128, 896), "gate/up": (4864, 896),
               "down": (896, 4864), "lm head": (151936, 896)}


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """``[out, in]`` weights of q, k, v, o, gate, up, down per layer, then the LM head."""
    layer = [(HIDDEN, HIDDEN)] * 4 + [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]
    shapes = layer * LAYERS + [(VOCAB, HIDDEN)]
    return [torch.randn(shape, dtype=dtype) * 0.02 for shape in shapes]


def run_aten(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    for weight in weights:
        nn.functional.linear(inputs[weight.shape[1]], weight)


def run_onednn(packed: list[tuple[torch.Tensor, int]], inputs: dict[int, torch.Tensor]
               ) -> None:
    for weight, width in packed:
        _linear(inputs[width], weight, None)


def run_packed(layers: list[PackedLinear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer(inputs[layer.in_features])


def _ms(call: Callable[[], object], repeats: int) -> str:
    return f"{1000 * timed(call, repeats):9.2f}"


def _without_tiles(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with the bf16 kernel kept off its AMX tiles."""
    gemm = load_gemm()
    assert gemm is not None

    def run() -> object:
        before = gemm.use_tiles_from(0)
        try:
            return call()
        finally:
            gemm.use_tiles_from(before)
    return run


def _has_tiles() -> bool:
    gemm = load_gemm()
    return gemm is not None and gemm.has_tiles


def token_pass(rows_list: list[int], repeats: int) -> None:
    """``--shapes qwen0.5b-token``: ms for one decode token's bf16 layers, with the
    kernel on its AMX tiles and off them, median over ``repeats`` passes taken in turn,
    and the GB/s of weights that makes."""
    layers = [PackedLinear((torch.randn(*shape) * shape[1] ** -0.5).bfloat16(), None)
              for _ in range(LAYERS_05B) for shape in TOKEN_LAYERS_05B]
    nbytes = sum(layer.packed_weight.nbytes for layer in layers)
    tiles = _has_tiles()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{len(layers)} layers, {nbytes / 2**20:.0f} MiB; median of {repeats}; AMX "
          f"tiles {'on and off in turn' if tiles else 'not available'}")
    for rows in rows_list:
        inputs = {width: torch.randn(rows, width).bfloat16() for width in (896, 4864)}
        one_pass = functools.partial(run_packed, layers, inputs)
        passes: dict[str, Callable[[], object]] = {"packed": one_pass}
        if tiles:
            passes = {"tiles": one_pass, "vdpbf16ps": _without_tiles(one_pass)}
        times: dict[str, list[float]] = {name: [] for name in passes}
        for _ in range(repeats):
            for name, call in passes.items():
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(seconds) for name, seconds in times.items()}
        cells = "  ".join(f"{name} {1000 * median:7.2f} ms ({nbytes / median / 1e9:4.1f} "
                          f"GB/s)" for name, median in medians.items())
        ratio = (f"  vdpbf16ps/tiles {medians['vdpbf16ps'] / medians['tiles']:.2f}x"
                 if tiles else "")
        print(f"rows {rows:3d}  {cells}{ratio}", flush=True)


def per_shape(rows_list: list[int], repeats: int) -> None:
    """Each of Qwen2.5-0.5B's layer shapes alone, in ms per call."""
    kernel = _bf16_gemm()
    ours_name = ("AVX512-BF16 kernel" if kernel is load_gemm() and kernel else
                 "AVX2 kernel" if kernel is load_avx2_gemm() and kernel else "oneDNN")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{repeats}; bf16 PackedLinear on {ours_name}")
    tiles = _has_tiles()
    print(f"{'layer':>8} {'rows':>5} {'aten bf16':>9} {'aten fp32':>9} {'triollm':>9}"
          + (f" {'no tiles':>9} {'row-major':>9}" if tiles else "") + "   (ms)")
    for name, (out_features, in_features) in QWEN_SHAPES.items():
        weight = torch.randn(out_features, in_features) * in_features ** -0.5
        bf16 = weight.bfloat16()
        packed = PackedLinear(bf16, None)
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            xb = x.bfloat16()
            aten = _ms(functools.partial(nn.functional.linear, xb, bf16), repeats)
            fp32 = _ms(functools.partial(nn.functional.linear, x, weight), repeats)
            ours = _ms(functools.partial(packed, xb), repeats)
            off = ""
            if tiles:
                gemm = load_gemm()
                assert gemm is not None
                off = (" " + _ms(_without_tiles(functools.partial(packed, xb)), repeats)
                       + " " + _ms(functools.partial(gemm.row_major, xb, bf16, None),
                                   repeats))
            print(f"{name:>8} {rows:5d} {aten} {fp32} {ours}{off}", flush=True)
        del packed


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=["llama", "qwen0.5b", "qwen0.5b-token"],
                        default="llama")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 512])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.shapes == "qwen0.5b":
        per_shape(args.rows, args.repeats)
        return
    if args.shapes == "qwen0.5b-token":
        token_pass(args.rows, args.repeats)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; all "
          f"{LAYERS * 7 + 1} linears of the benchmarks' Llama; median of {args.repeats}; "
          f"AVX512-BF16 kernel {'loaded' if load_gemm() else 'not available'}")
    print(f"{'dtype':>9} {'rows':>5} {'aten linear':>12} {'oneDNN':>10} {'triollm':>10} "
          f"{'vs aten':>8} {'vs oneDNN':>9}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        weights = model_weights(dtype)
        onednn_weights = [(torch.ops.mkldnn._reorder_linear_weight(weight), weight.shape[1])
                          for weight in weights]
        packed = [PackedLinear(weight, None) for weight in weights]
        for rows in args.rows:
            inputs = {width: torch.randn(rows, width, dtype=dtype)
                      for width in (HIDDEN, INTERMEDIATE)}
            aten = timed(functools.partial(run_aten, weights, inputs), args.repeats)
            onednn = timed(functools.partial(run_onednn, onednn_weights, inputs),
                           args.repeats)
            ours = timed(functools.partial(run_packed, packed, inputs), args.repeats)
            print(f"{dtype_name:>9} {rows:5d} {1000 * aten:9.2f} ms {1000 * onednn:7.2f} ms "
                  f"{1000 * ours:7.2f} ms {aten / ours:7.2f}x {onednn / ours:8.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
