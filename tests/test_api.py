"""The public surface: exports, the offline LLM API, the demo model."""

from __future__ import annotations

import pytest

import triollm
from triollm import LLM, SamplingParams


def test_exports_are_exactly_the_public_api() -> None:
    assert sorted(triollm.__all__) == sorted([
        "LLM", "AsyncEngineArgs", "AsyncLLMEngine", "CompletionOutput", "EngineArgs",
        "EngineClosedError", "EngineDeadError", "EngineError", "EngineStatistics", "Logprob",
        "ModelRunner", "PoolingParams", "RequestFailedError", "RequestMetrics", "RequestOutput",
        "RequestOutputKind", "RunnerOutput", "SamplingParams", "TextPrompt", "TokensPrompt",
        # pooling models, with vLLM's names
        "ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput",
        "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput", "ScoringOutput",
        "ScoringRequestOutput",
        # LoRA adapters (also at vLLM's path, triollm.lora.request)
        "LoRARequest",
    ])
    for name in triollm.__all__:
        assert getattr(triollm, name) is not None


def test_generate_returns_outputs_in_input_order_with_per_prompt_params(llama_llm: LLM
                                                                        ) -> None:
    llm = llama_llm
    prompts = ["one", "two two", {"prompt": "three"}, {"prompt_token_ids": [5, 6, 7]}]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 1, 4, 2)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 1, 4, 2]
    assert outputs[0].prompt == "one" and outputs[3].prompt_token_ids == [5, 6, 7]
    assert all(o.finished and o.metrics and o.metrics.finished_time for o in outputs)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2], use_tqdm=False)


def test_chat_uses_the_chat_template(llama_llm: LLM) -> None:
    llm = llama_llm
    (out,) = llm.chat([{"role": "user", "content": "hi"}],
                      SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert text == "<|user|>\nhi</s>\n<|assistant|>\n"
    assert len(out.outputs[0].token_ids) == 3


def test_demo_model_serves_offline_by_default() -> None:
    llm = LLM()
    assert llm.engine.config.model.model == "triollm/tiny-demo"
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    greedy = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    # The demo's random weights are seeded: a second instance writes the same tokens.
    again = LLM().generate("Hello", greedy, use_tqdm=False)
    assert again[0].outputs[0].token_ids == llm.generate(
        "Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_progress_bar_reports_tokens_per_second(llama_llm: LLM,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    llama_llm.generate(["a", "b"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=True)
    assert "toks/s" in capsys.readouterr().err
