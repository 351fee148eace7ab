"""Linear layers alone, on the same weights: aten's ``linear`` on the loaded weights,
oneDNN's linear on weights packed once into its layout, and ``PackedLinear`` as the
engine builds it (``triollm.model.cpu.packed_linear``: for bf16 on a CPU with AVX512-BF16 the
kernel of ``triollm.model.cpu.gemm``, else oneDNN, so the last two columns then agree).

Every linear layer of the benchmarks' Llama (12 layers, hidden 768, the serving
benchmark's 512-token vocabulary), ``M`` rows of input each: ``M=1`` is a lone decode
step, 32-64 a busy decode batch, 512 a prefill chunk. Median of ``--repeats`` timings
of one pass over all layers.

    python benchmarks/packed_linear.py
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn

from common import timed
from triollm.model.cpu.gemm import load_gemm
from triollm.model.cpu.packed_linear import PackedLinear, _linear

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 768, 2048, 12, 512


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """``[out, in]`` weights of q, k, v, o, gate, up, down per layer, then the LM head."""
    layer = [(HIDDEN, HIDDEN)] * 4 + [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]
    shapes = layer * LAYERS + [(VOCAB, HIDDEN)]
    return [torch.randn(shape, dtype=dtype) * 0.02 for shape in shapes]


def run_aten(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    for weight in weights:
        nn.functional.linear(inputs[weight.shape[1]], weight)


def run_onednn(packed: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    for weight, width in packed:
        _linear(inputs[width], weight, None)


def run_packed(layers: list[PackedLinear], inputs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer(inputs[layer.in_features])


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 512])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
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
