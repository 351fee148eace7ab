"""Helpers shared by the tests."""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import psutil
import pytest

from triollm import SamplingParams

if TYPE_CHECKING:
    from triollm import AsyncLLMEngine


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


@dataclass
class MidStreamFault:
    """What ``fault_a_rank_mid_stream`` saw: the whole greedy request's tokens, the
    rank process it signalled (set before the signal), and each long stream's error."""

    tokens: list[int] = field(default_factory=list)
    rank: psutil.Process | None = None
    errors: dict[int, BaseException] = field(default_factory=dict)


async def fault_a_rank_mid_stream(engine: AsyncLLMEngine, prompt: str,
                                  greedy: SamplingParams,
                                  find_rank: Callable[[], psutil.Process],
                                  fault: signal.Signals, seen: MidStreamFault) -> None:
    """Run ``engine``; decode ``prompt`` whole with ``greedy``; then, while three long
    streams run, send ``fault`` to the rank process ``find_rank`` names. The engine's
    crash ends the run (its ``BaseExceptionGroup`` is expected here); ``seen`` holds
    what happened, also when an assertion stops this early."""
    from triollm.errors import EngineDeadError

    streaming: set[int] = set()
    all_streaming = anyio.Event()

    async def consume(i: int) -> None:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        try:
            async for _ in engine.generate(prompt, params, f"long-{i}"):
                streaming.add(i)
                if len(streaming) == 3:
                    all_streaming.set()
        except EngineDeadError as error:
            seen.errors[i] = error

    with pytest.raises(BaseExceptionGroup):
        async with anyio.create_task_group() as outer:
            await outer.start(engine.run)
            async for output in engine.generate(prompt, greedy, "whole"):
                seen.tokens = list(output.outputs[0].token_ids)
            seen.rank = find_rank()
            async with anyio.create_task_group() as consumers:
                for i in range(3):
                    consumers.start_soon(consume, i)
                await all_streaming.wait()
                os.kill(seen.rank.pid, fault)


def finish_and_abort_a_mix(core: Any, prompts: Sequence[Any]) -> None:
    """Requests of different lengths on an ``EngineCore``, three of them aborted a few
    steps in; after all end, every KV block is free again."""
    for index, prompt in enumerate(prompts):
        core.add_request(f"mix-{index}", prompt, SamplingParams(
            temperature=0, max_tokens=10 + 5 * index, ignore_eos=True))
    for _ in range(6):
        core.step()
    core.abort_request(["mix-1", "mix-4", "mix-6"])
    while core.has_unfinished_requests():
        core.step()
    stats = core.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks


def graph_of_calls(op: Callable[..., Any], inputs: list[int], handles: list[int]) -> Any:
    """An FX graph calling ``op(x<input>, handle, 16)`` for each pair, in order (the
    linear-layer ops a compiled forward fuses by group)."""
    import torch

    graph = torch.fx.Graph()
    sources = [graph.placeholder(f"x{i}") for i in range(max(inputs) + 1)]
    outputs = [graph.call_function(op, (sources[i], handle, 16))
               for i, handle in zip(inputs, handles, strict=True)]
    graph.output(tuple(outputs))
    return graph


def assert_grouping_keeps_outputs(config: Any, steps: int, grouped: tuple[list[int], Any],
                                  plain: tuple[list[int], Any], head: list[int]) -> None:
    """A compiled Llama's run with q/k/v and gate/up grouped against one without: each
    ``(calls, completion)``, the calls being each linear call's output width in order.
    Grouped, a layer makes 4 calls (then ``head``'s, per step), ungrouped 7; both give
    the same tokens and logprobs."""
    heads = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    layers = config.num_hidden_layers
    per_layer = [heads + 2 * kv, config.hidden_size, 2 * config.intermediate_size,
                 config.hidden_size]
    assert grouped[0] == [*per_layer * layers, *head] * steps
    assert len(plain[0]) == (7 * layers + len(head)) * steps
    assert grouped[1].token_ids == plain[1].token_ids
    assert grouped[1].logprobs == plain[1].logprobs


def bf16_compiled_llm(path: Path, **kwargs: Any) -> Any:
    """The tiny model at ``path`` in bf16, compiled (-O2) on one thread, as the tests of a
    compiled forward's linear-layer calls run it; ``kwargs``: more ``LLM`` arguments."""
    from triollm import LLM

    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, num_gpu_blocks_override=256,
              optimization_level=2, cpu_threads=1, **kwargs)
    assert llm.engine.runner.compiled, "the model should have compiled"
    return llm
