"""The LM head of an on-the-fly quantized tied model (model/quantization/rescored_head.py)
against the alternatives, on a vocabulary-sized bf16 weight: ms per call (median) at
each row count for

- ``int8``: the int8 copy with a scale per row (the head's path for every row that is
  not a plain greedy one, and an untied head's only path);
- ``int4 ranked``: the int4 copy ranking the vocabulary, the candidates recomputed on
  the weight (the head's path for rows that want only the argmax);
- ``bf16``: every logit on the bf16 weight (AMX tiles where the CPU has them, as a
  bf16 model's tied head runs).

Then how closely each copy's logits follow the bf16 head's on random hidden states:
the error's root mean square over the logits' standard deviation, and how often the
greedy token is the bf16 head's. Weights are random, at a trained model's scale
(standard deviation ``hidden ** -0.5``), as benchmarks/quantization.py makes them.

    python benchmarks/lm_head.py
    python benchmarks/lm_head.py --shape llama-3.2-1b --rows 1 4
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn

from common import timed
from triollm.model.cpu.tied_head import tied_head_on_tiles
from triollm.model.quantization.lm_head import quantize_lm_head
from triollm.model.quantization.rescored_head import RescoredHead, argmax_rows
from vs_vllm import CONTAMINATED_CORES, LoadSampler

#: vocabulary, hidden
SHAPES = {"qwen2.5-0.5b": (151936, 896), "llama-3.2-1b": (128256, 2048)}


class TiedHeadModel(nn.Module):
    """An embedding and the LM head tied to it, as quantize_lm_head finds them."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        with torch.no_grad():
            self.embed.weight.normal_(0, hidden ** -0.5,
                                      generator=torch.Generator().manual_seed(0))
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
        self.lm_head.weight = self.embed.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def agreement(name: str, copy: torch.Tensor, full: torch.Tensor) -> str:
    error = (copy.float() - full.float()).pow(2).mean().sqrt() / full.float().std()
    same = (copy.argmax(-1) == full.argmax(-1)).float().mean()
    return f"{name}: error {float(error):.4f} of the spread, greedy token {100 * float(same):.1f}%"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    vocab, hidden = SHAPES[args.shape]
    model = TiedHeadModel(vocab, hidden)
    bf16 = tied_head_on_tiles(model.lm_head) or model.lm_head
    head = quantize_lm_head(model)
    assert isinstance(head, RescoredHead), "no int4 kernel takes the head on this machine"
    print(f"{args.shape} head ({vocab} x {hidden}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {head.extra_repr()}; ms per call, median "
          f"of {args.repeats}")
    print(f"{'rows':>5} {'int8':>8} {'int4 ranked':>12} {'bf16':>8} {'busy cores':>11}")
    generator = torch.Generator().manual_seed(1)
    for rows in args.rows:
        x = torch.randn(1, rows, hidden, generator=generator).bfloat16()
        load = LoadSampler(set())
        with argmax_rows([True] * rows):
            ranked = timed(functools.partial(head, x), args.repeats)
        copied = timed(functools.partial(head, x), args.repeats)
        full = timed(functools.partial(bf16, x), args.repeats)
        busy = load.others_cores()
        flag = " contaminated" if busy > CONTAMINATED_CORES else ""
        print(f"{rows:5d} {1000 * copied:8.3f} {1000 * ranked:12.3f} {1000 * full:8.3f} "
              f"{busy:10.2f}{flag}", flush=True)
    x = torch.randn(1, 256, hidden, generator=generator).bfloat16()
    full_logits = bf16(x)
    with argmax_rows([True] * 256):
        ranked_logits = head(x)
    print("over 256 random rows: " + "; ".join([
        agreement("int8 copy", head(x), full_logits),
        agreement("int4 copy alone", head.ranking(x[0]), full_logits[0]),
        agreement("int4 ranked", ranked_logits, full_logits)]))


if __name__ == "__main__":
    main()
