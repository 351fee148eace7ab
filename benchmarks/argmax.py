"""The sampler's argmax (model/argmax.py) against torch's ``argmax``, over rows of a
vocabulary's logits in fp32 as the sampler holds them: ms per call (median), and the
ratio, per row count, with how busy the rest of the machine was.

    python benchmarks/argmax.py
    python benchmarks/argmax.py --vocab 128256 --rows 1 16
"""

from __future__ import annotations

import argparse
import functools

import torch

from common import timed
from triollm.model.argmax import argmax
from vs_vllm import CONTAMINATED_CORES, LoadSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocabulary "
          f"{args.vocab}; ms per call, median of {args.repeats}")
    print(f"{'rows':>5} {'torch':>9} {'triollm':>9} {'ratio':>6} {'busy cores':>11}")
    generator = torch.Generator().manual_seed(0)
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=generator)
        assert torch.equal(argmax(logits), torch.argmax(logits, dim=-1))
        load = LoadSampler(set())
        theirs = timed(functools.partial(torch.argmax, logits, dim=-1), args.repeats)
        ours = timed(functools.partial(argmax, logits), args.repeats)
        busy = load.others_cores()
        flag = " contaminated" if busy > CONTAMINATED_CORES else ""
        print(f"{rows:5d} {1000 * theirs:9.3f} {1000 * ours:9.3f} {theirs / ours:5.1f}x "
              f"{busy:10.2f}{flag}", flush=True)


if __name__ == "__main__":
    main()
