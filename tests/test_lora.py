"""Multi-LoRA over real transformers models: greedy tokens in float32 equal
transformers + PEFT running each adapter alone, with adapters and the base model mixed in
the same steps, offline and through the async engine; adapters past ``max_loras`` served
in turn; adapters that do not fit refused naming why."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from helpers import peft_greedy
from triollm import LLM, AsyncEngineArgs, AsyncLLMEngine, LoRARequest, SamplingParams
from triollm.errors import LoRAAdapterError, LoRAAdapterNotFoundError

PROMPTS = ["Hello there, how", "The quick brown fox", "Once upon a time", "In the start"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def reference(base: Path, adapter: Path | None, prompts: Sequence[list[int]]) -> list[list[int]]:
    return peft_greedy(base, adapter, prompts, 8)


def token_prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


def lora(models: dict[str, Path], name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(models[name]))


@pytest.fixture(scope="module")
def lora_llm(lora_models: dict[str, Path]) -> LLM:
    return LLM(str(lora_models["llama"]), dtype="float32", enable_lora=True, max_loras=3,
               max_lora_rank=16, max_model_len=256, num_gpu_blocks_override=256)


def record_steps(llm: LLM) -> list[set[int | None]]:
    """The adapters of each step the engine runs from now on (None: the base model)."""
    steps: list[set[int | None]] = []
    schedule = llm.engine.schedule

    def recording() -> Any:
        output = schedule()
        steps.append({None if item.lora_request is None else item.lora_request.lora_int_id
                      for item in output.scheduled})
        return output

    llm.engine.schedule = recording  # type: ignore[method-assign]
    return steps


def test_adapters_and_the_base_mixed_in_one_batch_match_peft_alone(
        lora_llm: LLM, lora_models: dict[str, Path], tokenizer: Any) -> None:
    prompts = token_prompts(tokenizer)
    names = [None, "qv8", "all4", "mlp16"]
    adapters = {name: lora(lora_models, name, index) for index, name in enumerate(names)
                if name is not None}
    # every prompt under every adapter and the base, interleaved
    plan = [(prompt, name) for prompt in prompts for name in names]
    steps = record_steps(lora_llm)
    outputs = lora_llm.generate(
        [{"prompt_token_ids": p} for p, _ in plan], GREEDY, use_tqdm=False,
        lora_request=[None if name is None else adapters[name] for _, name in plan])
    expected = {name: reference(lora_models["llama"],
                                None if name is None else lora_models[name], prompts)
                for name in names}
    for (prompt, name), output in zip(plan, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == expected[name][prompts.index(prompt)], name
    assert len({tuple(tokens) for tokens in (expected[n][0] for n in names)}) == 4, \
        "the adapters should change the output"
    assert max(len(step) for step in steps) == 4  # three adapters and the base in one step


def test_more_adapters_than_max_loras_are_served_in_turn(
        lora_models: dict[str, Path], tokenizer: Any) -> None:
    """Four adapters and the base over max_loras=2 slots and max_cpu_loras=2 in host
    memory: steps never hold more than two adapters, adapters dropped from memory are
    read again, and every output is still each adapter's own."""
    llm = LLM(str(lora_models["llama"]), dtype="float32", enable_lora=True, max_loras=2,
              max_cpu_loras=2, max_lora_rank=16, max_model_len=256,
              num_gpu_blocks_override=256)
    prompts = token_prompts(tokenizer)[:2]
    names = ["qv8", "all4", "mlp16", "kv2", None]
    adapters = {name: lora(lora_models, name, index + 1) for index, name in enumerate(names)
                if name is not None}
    plan = [(prompt, name) for name in names for prompt in prompts]
    steps = record_steps(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in plan], GREEDY,
                           use_tqdm=False,
                           lora_request=[None if n is None else adapters[n] for _, n in plan])
    for (prompt, name), output in zip(plan, outputs, strict=True):
        expected = reference(lora_models["llama"],
                             None if name is None else lora_models[name], [prompt])[0]
        assert list(output.outputs[0].token_ids) == expected, name
    assert all(len(step - {None}) <= 2 for step in steps)
    assert any(None in step and len(step) == 3 for step in steps)
    runner: Any = llm.engine.runner
    assert len(runner.list_loras()) <= 3  # two in host memory (+ one only in its slot)


def test_a_fused_projection_takes_its_adapter(lora_models: dict[str, Path],
                                              tokenizer: Any) -> None:
    """GPT-2's attention is one Conv1D for q, k and v (c_attn): the adapter's B covers
    all three, as PEFT applies it."""
    llm = LLM(str(lora_models["gpt2"]), dtype="float32", enable_lora=True, max_loras=1,
              max_model_len=256, num_gpu_blocks_override=128)
    prompts = token_prompts(tokenizer)[:2]
    adapter = lora(lora_models, "gpt2_attn", 1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], GREEDY,
                           use_tqdm=False, lora_request=[adapter, adapter, None, None])
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got[:2] == reference(lora_models["gpt2"], lora_models["gpt2_attn"], prompts)
    assert got[2:] == reference(lora_models["gpt2"], None, prompts)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_take_adapters_on_every_projection(
        family: str, tiny_models: dict[str, Path], tokenizer: Any, tmp_path: Path) -> None:
    """Qwen2 (biased q/k/v) and Mistral (sliding window): an adapter on all seven
    projections beside the base model, as PEFT computes it."""
    from triollm.testing import build_lora_adapter

    base = tiny_models[family]
    adapter = build_lora_adapter(base, tmp_path / "adapter", rank=8, seed=11,
                                 target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"))
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_model_len=256,
              num_gpu_blocks_override=128)
    prompts = token_prompts(tokenizer)[:2]
    request = LoRARequest("a", 1, str(adapter))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], GREEDY,
                           use_tqdm=False, lora_request=[request, request, None, None])
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got[:2] == reference(base, adapter, prompts)
    assert got[2:] == reference(base, None, prompts)
    assert got[:2] != got[2:]


def test_prefix_cache_is_never_shared_between_adapters(
        lora_llm: LLM, lora_models: dict[str, Path], tokenizer: Any) -> None:
    prompt = tokenizer(" ".join(PROMPTS) * 3).input_ids[:100]
    qv8, all4 = lora(lora_models, "qv8", 1), lora(lora_models, "all4", 2)
    engine = lora_llm.engine
    lora_llm.reset_prefix_cache()
    runs = []
    for adapter in (qv8, qv8, all4, None):
        before = engine.statistics().prefix_cache_hits
        (output,) = lora_llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False,
                                      lora_request=adapter)
        runs.append((list(output.outputs[0].token_ids),
                     engine.statistics().prefix_cache_hits - before))
    assert [hits > 0 for _, hits in runs] == [False, True, False, False]
    assert runs[0][0] == runs[1][0] == reference(lora_models["llama"], lora_models["qv8"],
                                                 [prompt])[0]
    assert runs[2][0] == reference(lora_models["llama"], lora_models["all4"], [prompt])[0]
    assert runs[3][0] == reference(lora_models["llama"], None, [prompt])[0]


@pytest.mark.anyio
async def test_async_engine_mixes_adapters_and_adds_and_removes_them(
        lora_models: dict[str, Path], tokenizer: Any) -> None:
    args = AsyncEngineArgs(model=str(lora_models["llama"]), dtype="float32", enable_lora=True,
                           max_loras=2, max_model_len=256, num_gpu_blocks_override=256)
    prompts = token_prompts(tokenizer)
    qv8, all4 = lora(lora_models, "qv8", 1), lora(lora_models, "all4", 2)
    plan = [(prompt, adapter) for prompt in prompts for adapter in (qv8, all4, None)]
    results: dict[int, list[int]] = {}
    async with AsyncLLMEngine.from_engine_args(args) as engine:
        config = await engine.get_lora_config()
        assert config is not None and (config.max_loras, config.max_lora_rank) == (2, 16)
        assert await engine.add_lora(qv8) is True  # all4 is added by its first request
        assert await engine.add_lora(qv8) is False

        async def run(index: int) -> None:
            prompt, adapter = plan[index]
            async for output in engine.generate({"prompt_token_ids": prompt}, GREEDY,
                                                f"r{index}", lora_request=adapter):
                results[index] = list(output.outputs[0].token_ids)

        async with anyio.create_task_group() as tasks:
            for index in range(len(plan)):
                tasks.start_soon(run, index)
        assert await engine.list_loras() == {1, 2}

        # a client that leaves early leaves nothing behind
        async for _ in engine.generate({"prompt_token_ids": prompts[0]}, SamplingParams(
                max_tokens=50, ignore_eos=True), "early", lora_request=all4):
            break
        assert await engine.remove_lora(2) is True
        assert await engine.remove_lora(2) is False
        assert await engine.list_loras() == {1}
        with pytest.raises(LoRAAdapterError, match="max_lora_rank=16"):
            await engine.add_lora(lora(lora_models, "rank32", 3))
        for _ in range(100):
            stats = engine.statistics()
            if stats.num_running == stats.num_waiting == stats.num_open_streams == 0:
                break
            await anyio.sleep(0.01)
        assert stats.num_free_blocks == stats.num_total_blocks
    for index, (prompt, adapter) in enumerate(plan):
        path = None if adapter is None else Path(adapter.lora_path)
        assert results[index] == reference(lora_models["llama"], path, [prompt])[0]


def test_adapters_that_do_not_fit_are_refused_naming_why(
        lora_llm: LLM, lora_models: dict[str, Path], tmp_path: Path) -> None:
    engine = lora_llm.engine
    cases = [
        (lora(lora_models, "rank32", 11), LoRAAdapterError, re.escape(
            "rank 32 of 'model.layers.0.self_attn.q_proj' is above max_lora_rank=16")),
        (LoRARequest("gpt", 12, str(lora_models["gpt2_attn"])), LoRAAdapterError, re.escape(
            "target module 'transformer.h.0.attn.c_attn' is not an adaptable layer")),
        (lora(lora_models, "dora", 13), LoRAAdapterError, "DoRA adapters are not supported"),
        (LoRARequest("nowhere", 14, str(tmp_path / "missing")), LoRAAdapterNotFoundError,
         "no LoRA adapter at"),
    ]
    for request, error, message in cases:
        with pytest.raises(error, match=message):
            engine.add_lora(request)
        with pytest.raises(error):
            lora_llm.generate(["Hi"], GREEDY, use_tqdm=False, lora_request=request)
    assert not ({11, 12, 13, 14} & engine.list_loras())
    with pytest.raises(ValueError, match="lora_request: got 1 for 2 prompts"):
        lora_llm.generate(["a", "b"], GREEDY, use_tqdm=False,
                          lora_request=[lora(lora_models, "qv8", 1)])


def test_lora_settings_are_checked(lora_models: dict[str, Path], llama_llm: LLM,
                                   pooling_models: dict[str, Path]) -> None:
    base = str(lora_models["llama"])
    with pytest.raises(ValueError, match="lora_request: LoRA is not enabled"):
        llama_llm.generate(["Hi"], GREEDY, use_tqdm=False,
                           lora_request=lora(lora_models, "qv8", 1))
    with pytest.raises(ValueError, match="max_cpu_loras: 1 must be >= max_loras=2"):
        LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_loras: must be an integer >= 1"):
        LLM(base, enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras: needs enable_lora=True"):
        LLM(base, max_cpu_loras=4)
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters are served over "
                                         "generation models"):
        LLM(str(pooling_models["bert"]), enable_lora=True)
    with pytest.raises(ValueError, match="lora_target_modules: the model has no linear layer"):
        LLM(base, dtype="float32", enable_lora=True, lora_target_modules=["c_attn"],
            max_model_len=64)
    only_q = LLM(base, dtype="float32", enable_lora=True, lora_target_modules=["q_proj"],
                 max_model_len=64, num_gpu_blocks_override=32)
    with pytest.raises(LoRAAdapterError, match=re.escape(
            "'model.layers.0.self_attn.v_proj' is not an adaptable layer")):
        only_q.generate(["Hi"], GREEDY, use_tqdm=False, lora_request=lora(lora_models, "qv8", 1))


def test_bf16_adapters_over_a_bf16_model_stay_close(lora_models: dict[str, Path],
                                                    tokenizer: Any) -> None:
    """In bfloat16 the tokens may drift from float32 PEFT, but the adapter's first tokens
    are its own, not the base model's."""
    llm = LLM(str(lora_models["llama"]), dtype="bfloat16", enable_lora=True, max_loras=2,
              max_model_len=128, num_gpu_blocks_override=64)
    prompts = token_prompts(tokenizer)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=lora(lora_models, "all4", 1))
    expected = reference(lora_models["llama"], lora_models["all4"], prompts)
    firsts = [o.outputs[0].token_ids[0] for o in outputs]
    assert sum(f == e[0] for f, e in zip(firsts, expected, strict=True)) >= 3
