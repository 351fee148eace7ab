"""What the serving-side benchmarks share: their model and how they summarise latencies.

The benchmarks run as scripts (``python benchmarks/NAME.py``), so this directory is on
``sys.path`` and they import this module as ``common``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def save_llama(directory: str, *, max_position_embeddings: int = 1024,
               pad_token_id: int | None = None) -> None:
    """Save the benchmarks' random-weight Llama (12 layers, hidden 768, ~85M parameters,
    bf16, seed 0) with the test tokenizer, so every benchmark measures the same model."""
    import torch
    import transformers

    from triollm.testing import train_test_tokenizer

    tokenizer = train_test_tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2,
        pad_token_id=pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if pad_token_id is not None:
        model.generation_config.pad_token_id = pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def timed(call: Callable[[], object], repeats: int) -> float:
    """The median time of ``repeats`` calls of ``call``, after three warm-up calls."""
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q=0.99``: p99)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def percentiles(values: list[float]) -> str:
    """Mean, median and p99 of latencies in seconds, printed in milliseconds."""
    if not values:
        return "      n/a"
    return (f"mean {1000 * statistics.fmean(values):8.1f}  median "
            f"{1000 * statistics.median(values):8.1f}  p99 "
            f"{1000 * quantile(values, 0.99):8.1f} ms")
