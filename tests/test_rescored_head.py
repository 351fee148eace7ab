"""A tied LM head quantized on the fly (``RescoredHead``): the candidates hold each row's
leading logits; a row wanting only the argmax gets the full head's logits on its
candidates (so its greedy token) and the int4 copy's elsewhere, every other row the int8
copy's, each row as if alone in its batch; through the engine, greedy tokens are the
dequantized decoder's under the full head, logprobs under the int8 head, a seeded
request samples the same tokens whatever shares its steps, and tensor-parallel ranks
learn which rows want only the argmax."""

from __future__ import annotations

import functools
import math
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM

from helpers import transformers_greedy
from test_quantized_models import transformers_logprobs
from triollm import LLM, SamplingParams
from triollm.model.parallel.messages import decode_step, encode_step
from triollm.model.quantization.lm_head import HEAD_BITS, quantize_lm_head
from triollm.model.quantization.quantize import quantize_weight
from triollm.model.quantization.replace import quantizable_layers
from triollm.model.quantization.rescored_head import (
    CHUNK,
    CHUNKS,
    RescoredHead,
    argmax_rows,
    candidates,
)
from triollm.step import ScheduledRequest
from triollm.testing import tiny_config

VOCAB, HIDDEN = 5008, 128  # two int4 groups a row

VALUES = st.sampled_from([0.0, 1.0, 3.0, -2.0, math.inf, -math.inf])


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.sampled_from(
    [1, CHUNK, CHUNK * CHUNKS, CHUNK * CHUNKS + 1, 4099, 5003]),
    seed=st.integers(0, 2**16), plants=st.lists(st.tuples(
        st.integers(0, 3), st.integers(0, 5002), VALUES), max_size=40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_candidates_hold_each_rows_leading_logits(
        rows: int, vocab: int, seed: int, plants: list[tuple[int, int, float]],
        dtype: torch.dtype) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)
                         ).to(dtype)
    for row, column, value in plants:  # ties and infinities, within and across chunks
        logits[row % rows, column % vocab] = value
    index = candidates(logits)
    assert index.shape[0] == rows
    for row in range(rows):
        chosen = index[row].tolist()
        assert len(set(chosen)) == len(chosen) and all(0 <= i < vocab for i in chosen)
        leading = min(CHUNKS, vocab)
        threshold = logits[row].float().topk(leading).values[-1]
        assert set(torch.nonzero(logits[row].float() > threshold)[:, 0].tolist()) <= set(
            chosen)
        assert len(chosen) >= leading
        assert bool(logits[row, chosen].float().max() == logits[row].float().max())


class TiedModel(nn.Module):
    def __init__(self, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator)
                                    * HIDDEN ** -0.5)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=dtype)
        self.lm_head.weight = self.embed.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def rescored(bias: bool = False, dtype: torch.dtype = torch.float32
             ) -> tuple[RescoredHead, nn.Linear]:
    model = TiedModel(bias, dtype)
    full = model.lm_head
    head = quantize_lm_head(model)
    if not isinstance(head, RescoredHead):
        pytest.skip("no int4 kernel takes the head on this machine")
    assert model.lm_head is head and head.weight is model.embed.weight
    return head, full


def int8_logits(full: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, quantize_weight(full.weight, HEAD_BITS, -1).dequantize(),
                                full.bias)


@pytest.mark.parametrize("bias", [False, True])
def test_argmax_rows_get_the_full_heads_candidates_and_the_rest_the_int8_copy(
        bias: bool) -> None:
    head, full = rescored(bias)
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        with argmax_rows([True] * 5):
            got = head(x)[0]
        coarse = head.ranking(x[0]) + (0 if head.bias is None else head.bias)
        exact = full(x)[0]
        copied = head(x)[0]  # outside a step: every row on the int8 copy
    recomputed = torch.zeros_like(got, dtype=torch.bool).scatter_(1, candidates(coarse), True)
    torch.testing.assert_close(got[recomputed], exact[recomputed], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[~recomputed], coarse[~recomputed])
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(copied, int8_logits(full, x[0]), rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(marks=st.lists(st.booleans(), min_size=0, max_size=7))
def test_each_row_gets_what_it_would_alone(marks: list[bool]) -> None:
    head, _ = shared_head()
    x = torch.randn(1, len(marks), HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode(), argmax_rows(marks):
        together = head(x)
    assert together.shape == (1, len(marks), VOCAB)
    for i, mark in enumerate(marks):
        with torch.inference_mode(), argmax_rows([mark]):
            # to the kernels' rounding, which may vary with the rows in a call
            torch.testing.assert_close(head(x[:, i:i + 1])[0, 0], together[0, i],
                                       rtol=1e-5, atol=1e-5)


@functools.cache
def shared_head() -> tuple[RescoredHead, nn.Linear]:
    return rescored()


def test_the_greedy_token_is_the_full_heads_in_bfloat16() -> None:
    head, full = rescored(dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode(), argmax_rows([True] * 64):
        x = torch.randn(1, 64, HIDDEN, generator=generator).bfloat16()
        assert torch.equal(head(x).argmax(-1), full(x).argmax(-1))


def request(**params: Any) -> ScheduledRequest:
    return ScheduledRequest(request_id="r", token_ids=[5], start_position=7,
                            block_table=[0, 1], sample=True, prompt_token_ids=[1] * 7,
                            sampling_params=SamplingParams(**params))


@pytest.mark.parametrize("params", [
    {"temperature": 1.0}, {"temperature": 0, "logprobs": 0},
    {"temperature": 0, "prompt_logprobs": 1}, {"temperature": 0, "logit_bias": {3: 1.0}},
    {"temperature": 0, "allowed_token_ids": [3, 4]}, {"temperature": 0, "bad_words": ["x"]},
    {"temperature": 0, "min_tokens": 2}, {"temperature": 0, "repetition_penalty": 1.2},
    {"temperature": 0, "presence_penalty": 0.5},
    {"temperature": 0, "structured_outputs": {"choice": ["a", "b"]}},
])
def test_only_plain_greedy_requests_want_only_the_argmax(params: dict[str, Any]) -> None:
    if "structured_outputs" in params:
        from triollm.sampling_params import StructuredOutputsParams
        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    assert request(temperature=0, max_tokens=4).wants_only_the_argmax
    assert not request(**params).wants_only_the_argmax


def test_a_rank_learns_which_rows_want_only_the_argmax() -> None:
    sent = [request(temperature=0), request(temperature=0, logprobs=2), request()]
    received = decode_step(encode_step(sent, block_size=4))
    assert [i.wants_only_the_argmax for i in received] == [True, False, False]


# -- through the engine, on a tied model whose head both kernels take --------------------


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    path = tmp_path_factory.mktemp("tied")
    config = tiny_config("llama", 4096)
    config.hidden_size, config.tie_word_embeddings = HIDDEN, True
    config.head_dim = HIDDEN // config.num_attention_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.15)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def dequantized(path: Path, target: Path, head: str) -> Path:
    """``path``'s model with its decoder's layers int4-dequantized (group 128) and its
    head the full one (``head="full"``) or its int8 copy, in float32."""
    shutil.copytree(path, target)  # the tokenizer too
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in quantizable_layers(model):
            weight = modules[name].weight
            weight.copy_(quantize_weight(weight, 4, 128).dequantize())
        if head == "int8":
            model.lm_head.weight = nn.Parameter(
                quantize_weight(model.lm_head.weight, HEAD_BITS, -1).dequantize())
            model.config.tie_word_embeddings = False
    model.save_pretrained(target)
    return target


def tied_llm(path: Path, **args: Any) -> LLM:
    llm = LLM(str(path), quantization="int4", dtype="float32", max_model_len=256, **args)
    assert isinstance(llm.engine.runner.model.get_output_embeddings(), RescoredHead)
    return llm


PROMPTS = ["hello world", "the quick brown fox jumps over", "a"]


def ranked_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The threads of each ``RescoredHead`` call that ranked rows, from now on."""
    calls: list[int] = []
    ranked = RescoredHead._ranked

    def counted(self: RescoredHead, rows: torch.Tensor) -> torch.Tensor:
        calls.append(threading.get_ident())
        return ranked(self, rows)

    monkeypatch.setattr(RescoredHead, "_ranked", counted)
    return calls


def test_greedy_tokens_are_the_full_heads_and_logprobs_the_int8_heads(
        tied_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tied_llm(tied_model)
    calls = ranked_calls(monkeypatch)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8,
                                                   detokenize=False), use_tqdm=False)
    full = dequantized(tied_model, tmp_path / "full", "full")
    assert [list(o.outputs[0].token_ids) for o in outputs] == transformers_greedy(
        full, PROMPTS, 8)
    assert calls, "the greedy rows should have ranked"
    calls.clear()
    prompt = [5, 17, 42, 99, 7]
    reported = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=6, logprobs=0, ignore_eos=True, detokenize=False),
        use_tqdm=False)[0]
    tokens = list(reported.outputs[0].token_ids)
    assert reported.outputs[0].logprobs is not None
    got = [entry[token].logprob for entry, token in
           zip(reported.outputs[0].logprobs, tokens, strict=True)]
    expected = transformers_logprobs(dequantized(tied_model, tmp_path / "int8", "int8"),
                                     [*prompt, *tokens])[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-3
    assert not calls, "rows reporting logprobs should compute on the int8 copy"


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_steps(
        tied_model: Path) -> None:
    llm = tied_llm(tied_model)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                            detokenize=False)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)
    others = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             detokenize=False, **extra) for extra in ({}, {"logprobs": 1})]
    mixed = llm.generate(PROMPTS, [seeded, *others], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_chunked_prefill_step_that_samples_nothing_runs(tied_model: Path) -> None:
    """A step of prompt chunks keeps no logits: the head gets no rows."""
    prompt = {"prompt_token_ids": list(range(5, 70))}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    chunked = tied_llm(tied_model, max_num_batched_tokens=16, enable_chunked_prefill=True)
    whole = tied_llm(tied_model)
    assert (chunked.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == whole.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
