"""Pooling models through the Python API: embeddings, classification and scores match
sentence-transformers on random-weight models, and pooling requests share the
scheduler's limits, priorities and abort paths."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import sentence_transformers

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Paged attention keeps the KV cache in fixed-size blocks, so memory is not wasted.",
    "a b c d e f g",
    "Structured concurrency: every task has an owner and a lifetime you can point to.",
    "hello again",
]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="session")
def bert_llm(pooling_models: dict[str, Path]) -> Any:
    from triollm import LLM

    return LLM(str(pooling_models["bert"]), dtype="float32", scheduling_policy="priority")


def reference_embeddings(path: Path, texts: list[str]) -> np.ndarray:
    model = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    return np.asarray(model.encode(texts, convert_to_numpy=True))


@pytest.mark.parametrize("kind", ["bert", "xlmr", "qwen2", "qwen3", "gemma2"])
def test_embeddings_match_sentence_transformers(pooling_models: dict[str, Path],
                                                kind: str) -> None:
    """gemma2: a sliding window of 24 tokens (the longest text is longer) and attention
    logits softcapped at 20."""
    from triollm import LLM

    path = pooling_models[kind]
    llm = LLM(str(path), dtype="float32")
    pooler = llm.engine.config.model.pooler
    assert llm.engine.config.model.runner == "pooling"  # detected from modules.json
    assert pooler is not None and pooler.source == "sentence-transformers modules.json"
    assert pooler.pooling_type == {"bert": "MEAN", "xlmr": "CLS"}.get(kind, "LAST")
    outputs = llm.embed(TEXTS, use_tqdm=False)
    ours = np.array([output.outputs.embedding for output in outputs])
    reference = reference_embeddings(path, TEXTS)
    assert ours.shape == reference.shape
    assert cosine_rows(ours, reference).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)
    assert [o.prompt_token_ids for o in outputs] == [
        llm.get_tokenizer().encode(text) for text in TEXTS]
    assert llm.engine.statistics().num_free_blocks == llm.engine.statistics().num_total_blocks


def test_encode_gives_tensors_and_ordering_survives_priorities(bert_llm: Any) -> None:
    from triollm import PoolingParams

    outputs = bert_llm.encode(TEXTS, PoolingParams(), use_tqdm=False,
                              priority=[5, 0, 3, 1, 4, 2])
    assert [tuple(o.outputs.data.shape) for o in outputs] == [(48,)] * len(TEXTS)
    single = [bert_llm.encode(text, use_tqdm=False)[0].outputs.data for text in TEXTS]
    for batched, alone in zip(outputs, single, strict=True):
        np.testing.assert_allclose(batched.outputs.data.numpy(), alone.numpy(), atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "xlmr", "qwen2"])
def test_a_step_filled_up_to_a_padded_row_count_pools_the_same(
        pooling_models: dict[str, Path], kind: str) -> None:
    """fp32 linears run on oneDNN, so a step's packed row is filled with filler prompts
    up to a row count packed_linear.py takes without a copy; the real prompts' vectors
    are those each gets alone (CLS, MEAN and LAST pooling; bidirectional and causal)."""
    from triollm import LLM
    from triollm.model.cpu.packed_linear import padded_rows

    llm = LLM(str(pooling_models[kind]), dtype="float32")
    tokenizer = llm.get_tokenizer()
    texts = [*TEXTS, "one more"]
    while (total := sum(len(tokenizer.encode(text)) for text in texts)) == padded_rows(total):
        texts[-1] += " word"
    assert total > 32  # so the step needs filling (below 33 every count is taken as is)
    batched = llm.embed(texts, use_tqdm=False)
    for output, text in zip(batched, texts, strict=True):
        alone = llm.embed(text, use_tqdm=False)[0].outputs.embedding
        np.testing.assert_allclose(output.outputs.embedding, alone, atol=1e-5)
    stats = llm.engine.statistics()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_pooling_params_are_honoured(bert_llm: Any, pooling_models: dict[str, Path]) -> None:
    from triollm import LLM, PoolingParams

    raw = bert_llm.encode(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False)
    normalized = bert_llm.encode(TEXTS[0], PoolingParams(normalize=True), use_tqdm=False)
    raw_vector = raw[0].outputs.data.numpy()
    assert abs(np.linalg.norm(raw_vector) - 1.0) > 1e-3
    np.testing.assert_allclose(normalized[0].outputs.data.numpy(),
                               raw_vector / np.linalg.norm(raw_vector), atol=1e-6)
    # truncation keeps the prompt's last tokens
    truncated = bert_llm.embed(TEXTS[2], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == bert_llm.get_tokenizer().encode(TEXTS[2])[-5:]
    with pytest.raises(ValueError, match="dimensions"):
        bert_llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="task"):
        bert_llm.classify(TEXTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        bert_llm.generate(TEXTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="use_activation"):
        PoolingParams(use_activation=1)  # type: ignore[arg-type]

    matryoshka = LLM(str(pooling_models["matryoshka"]), dtype="float32")
    full = matryoshka.embed(TEXTS[:2], use_tqdm=False)
    short = matryoshka.embed(TEXTS[:2], pooling_params=PoolingParams(dimensions=16),
                             use_tqdm=False)
    for whole, cut in zip(full, short, strict=True):
        head = np.array(whole.outputs.embedding[:16])
        np.testing.assert_allclose(cut.outputs.embedding, head / np.linalg.norm(head),
                                   atol=1e-6)
    with pytest.raises(ValueError, match=r"dimensions: must be in \[1, 64\]"):
        matryoshka.embed("x", pooling_params=PoolingParams(dimensions=65), use_tqdm=False)


def test_cross_encoder_scores_match_sentence_transformers(
        pooling_models: dict[str, Path]) -> None:
    from triollm import LLM

    path = pooling_models["cross"]
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.config.model.pooler is not None
    assert llm.engine.config.model.pooler.task == "classify"  # *ForSequenceClassification
    query, documents = TEXTS[0], TEXTS[1:]
    scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    reference = sentence_transformers.CrossEncoder(str(path), device="cpu").predict(
        [(query, document) for document in documents])
    np.testing.assert_allclose(scores, reference, atol=1e-5)
    zipped = llm.score(documents[:2], documents[2:4], use_tqdm=False)
    assert len(zipped) == 2
    with pytest.raises(ValueError, match="data_2"):
        llm.score(documents[:2], documents[:3], use_tqdm=False)


def test_classifier_probabilities_match_transformers(pooling_models: dict[str, Path]) -> None:
    import torch
    import transformers

    from triollm import LLM

    path = pooling_models["labels"]
    llm = LLM(str(path), dtype="float32")
    outputs = llm.classify(TEXTS, use_tqdm=False)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = llm.get_tokenizer()
    for text, output in zip(TEXTS, outputs, strict=True):
        with torch.inference_mode():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        np.testing.assert_allclose(output.outputs.probs, torch.softmax(logits, -1).numpy(),
                                   atol=1e-5)
        assert output.outputs.num_classes == 3
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.score("a", "b", use_tqdm=False)


def test_runner_resolution(pooling_models: dict[str, Path], llama_path: Path) -> None:
    from triollm import EngineArgs

    def resolved(**kwargs: Any) -> Any:
        return EngineArgs(**kwargs).create_engine_config().model

    assert resolved(model=str(llama_path)).runner == "generate"
    as_embedder = resolved(model=str(llama_path), task="embed")  # vLLM's older spelling
    assert as_embedder.runner == "pooling" and as_embedder.pooler.pooling_type == "LAST"
    assert resolved(model=str(llama_path), runner="pooling",
                    pooler_config='{"pooling_type": "mean"}').pooler.pooling_type == "MEAN"
    cross = resolved(model=str(pooling_models["cross"]))
    assert cross.runner == "pooling" and cross.pooler.task == "classify"
    assert resolved(model=str(pooling_models["bert"]), runner="pooling").max_model_len == 128
    for bad, field in [({"runner": "draft"}, "runner"), ({"task": "reward"}, "task"),
                       ({"runner": "pooling", "pooler_config": {"mode": 1}}, "pooler_config"),
                       ({"runner": "generate", "convert": "embed"}, "convert"),
                       ({"convert": "classify"}, "convert")]:
        with pytest.raises(ValueError, match=field):
            resolved(model=str(llama_path), **bad)


def test_a_generation_model_refuses_pooling(llama_llm: Any) -> None:
    with pytest.raises(ValueError, match=r"pooling_params: .* runner='generate'"):
        llama_llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="score"):
        llama_llm.score("a", "b", use_tqdm=False)


@pytest.mark.anyio
@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_async_encode_matches_and_leaves_nothing_behind(
        pooling_models: dict[str, Path], async_scheduling: bool) -> None:
    """Also with asynchronous scheduling, which admits prompts while a step computes and
    never schedules a pooled prompt twice."""
    from triollm import AsyncEngineArgs, AsyncLLMEngine, PoolingParams

    path = pooling_models["bert"]
    reference = reference_embeddings(path, TEXTS)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(path), dtype="float32", max_num_seqs=3, async_scheduling=async_scheduling))
    results: dict[int, Any] = {}
    async with engine:
        async def one(index: int) -> None:
            outputs = [o async for o in engine.encode(TEXTS[index], PoolingParams(),
                                                      f"embed-{index}")]
            assert len(outputs) == 1 and outputs[0].finished
            results[index] = outputs[0]

        async with anyio.create_task_group() as group:
            for index in range(len(TEXTS)):
                group.start_soon(one, index)
        ours = np.array([results[i].outputs.data.numpy() for i in range(len(TEXTS))])
        assert cosine_rows(ours, reference).min() >= 0.999

        # leaving early aborts; a cancelled caller leaves nothing either
        async with aclosing(engine.encode(TEXTS[0], None, "left")) as stream:
            async for _ in stream:
                break
        with anyio.move_on_after(0):
            async for _ in engine.encode(TEXTS[2], None, "cancelled"):
                pass
        with pytest.raises(ValueError, match="sampling_params"):
            async for _ in engine.generate("hi", None, "gen"):
                pass
        await engine.abort("nothing-by-this-name")
        stats = engine.statistics()
        assert stats.num_open_streams == 0 and stats.num_running == 0
        assert stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
