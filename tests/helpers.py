"""Helpers shared by the tests."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio


async def run_ticker(lateness: list[float], period: float = 0.001) -> None:
    """Sleep ``period`` in a loop forever, recording how late each wake-up was."""
    while True:
        start = time.perf_counter()
        await anyio.sleep(period)
        lateness.append(time.perf_counter() - start - period)


def peft_greedy(base: Path, adapter: Path | None, prompts: Sequence[list[int]],
                max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers (+ PEFT with ``adapter`` alone; None: the base
    model) in float32, a full forward per token."""
    return _peft_greedy(str(base), None if adapter is None else str(adapter),
                        tuple(tuple(p) for p in prompts), max_tokens)


@functools.cache
def _peft_greedy(base: str, adapter: str | None, prompts: tuple[tuple[int, ...], ...],
                 max_tokens: int) -> list[list[int]]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            new: list[int] = []
            for _ in range(max_tokens):
                token = int(model(ids).logits[0, -1].argmax())
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            results.append(new)
    return results


def transformers_greedy(path: Path, prompts: Sequence[str], max_tokens: int,
                        stop_at_eos: bool = True) -> list[list[int]]:
    """Greedy tokens of stock transformers ``generate`` in float32 (eager attention) on
    each prompt alone; with ``stop_at_eos``, each cut after its first EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    from triollm.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                 dtype=torch.float32)
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        generated = out[0, ids.shape[1]:].tolist()
        if stop_at_eos and tokenizer.eos_token_id in generated:
            generated = generated[: generated.index(tokenizer.eos_token_id) + 1]
        results.append(generated)
    return results
