"""Linear layers alone: aten's ``linear`` on the loaded weights against oneDNN's linear
on weights packed once (``triollm.model.packed_linear``), on the same weights.

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
from triollm.model.packed_linear import PackedLinear

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 768, 2048, 12, 512


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """``[out, in]`` weights of q, k, v, o, gate, up, down per layer, then the LM head."""
    layer = [(HIDDEN, HIDDEN)] * 4 + [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]
    shapes = layer * LAYERS + [(VOCAB, HIDDEN)]
    return [torch.randn(shape, dtype=dtype) * 0.02 for shape in shapes]


def run_aten(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    for weight in weights:
        nn.functional.linear(inputs[weight.shape[1]], weight)


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
          f"{LAYERS * 7 + 1} linears of the benchmarks' Llama; median of {args.repeats}")
    print(f"{'dtype':>9} {'rows':>5} {'aten linear':>12} {'packed':>10} {'speed-up':>9}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        weights = model_weights(dtype)
        packed = [PackedLinear(weight, None) for weight in weights]
        for rows in args.rows:
            inputs = {width: torch.randn(rows, width, dtype=dtype)
                      for width in (HIDDEN, INTERMEDIATE)}
            aten = timed(functools.partial(run_aten, weights, inputs), args.repeats)
            onednn = timed(functools.partial(run_packed, packed, inputs), args.repeats)
            print(f"{dtype_name:>9} {rows:5d} {1000 * aten:9.2f} ms {1000 * onednn:7.2f} ms "
                  f"{aten / onednn:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
