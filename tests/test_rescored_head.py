"""The LM head of an on-the-fly quantized model ranks the vocabulary on an int4 copy and
recomputes the leading candidates on its own weight: the candidates hold each row's
leading logits, their logits (and so the greedy token) are the full head's, the others
the copy's; a step reporting logprobs, and more rows than the copy ranks, get every
logit in full; the op's registry lets go of a head that is gone."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from test_quantized_models import dequantized_copy, quantized_llm, transformers_logprobs
from triollm import SamplingParams
from triollm.model.parallel.messages import decode_step, encode_step
from triollm.model.quantization import rescored_head
from triollm.model.quantization.lm_head import quantize_lm_head
from triollm.model.quantization.rescored_head import (
    CHUNK,
    CHUNKS,
    RescoredHead,
    candidates,
    exact_logits,
)
from triollm.model.runners.batch import prepare_batch
from triollm.step import ScheduledRequest

VOCAB, HIDDEN = 5003, 64  # not a multiple of CHUNK: a tail of columns past the chunks

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
        above = set(torch.nonzero(logits[row].float() > threshold)[:, 0].tolist())
        assert above <= set(chosen)
        assert len(chosen) >= leading
        assert int(torch.argmax(logits[row])) in chosen or bool(
            logits[row, chosen].max() == logits[row].max())


class TiedModel(nn.Module):
    def __init__(self, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.1)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=dtype)
        self.lm_head.weight = self.embed.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def rescored(bias: bool = False, dtype: torch.dtype = torch.float32
             ) -> tuple[RescoredHead, nn.Linear]:
    model = TiedModel(bias, dtype)
    reference = model.lm_head
    head = quantize_lm_head(model)
    if head is None:
        pytest.skip("no int4 kernel on this machine")
    assert model.lm_head is head and head.weight is model.embed.weight
    return head, reference


@pytest.mark.parametrize("bias", [False, True])
def test_candidates_get_the_full_heads_logits_and_the_rest_the_copys(bias: bool) -> None:
    head, reference = rescored(bias)
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = head(x)[0]
        full = reference(x)[0]
        coarse = head._compute.coarse(x[0]) + (0 if head.bias is None else head.bias)
    index = candidates(coarse)
    recomputed = torch.zeros_like(got, dtype=torch.bool).scatter_(1, index, True)
    torch.testing.assert_close(got[recomputed], full[recomputed], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[~recomputed], coarse[~recomputed])
    assert not torch.allclose(coarse, full, atol=1e-3), "the copy should be rounded"
    assert torch.equal(got.argmax(-1), full.argmax(-1))


def test_the_greedy_token_is_the_full_heads_over_many_rows_in_bfloat16() -> None:
    head, reference = rescored(dtype=torch.bfloat16)
    x = torch.randn(1, 8, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        for _ in range(8):
            x = torch.randn_like(x)
            assert torch.equal(head(x).argmax(-1), reference(x).argmax(-1))


def test_a_step_reporting_logprobs_and_many_or_no_rows_get_every_logit_in_full() -> None:
    head, reference = rescored()
    few = torch.randn(1, 3, HIDDEN)
    many = torch.randn(1, head._compute.max_rows + 1, HIDDEN)
    with torch.inference_mode():
        with exact_logits(True):
            torch.testing.assert_close(head(few), reference(few))
        assert not torch.allclose(head(few), reference(few), atol=1e-3)
        torch.testing.assert_close(head(many), reference(many))
        assert head(torch.randn(1, 0, HIDDEN)).shape == (1, 0, VOCAB)


def test_a_compiled_graph_calls_the_head_as_one_op() -> None:
    head, _ = rescored(bias=True)
    x = torch.randn(1, 3, HIDDEN)
    with torch.inference_mode():
        eager = head(x)
        compiled = torch.compile(head, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), eager)
        with exact_logits(True):  # read when the op runs, not when it was traced
            torch.testing.assert_close(compiled(x), head(x))
            assert not torch.allclose(compiled(x), eager)


def test_the_registry_lets_go_of_a_head_that_is_gone() -> None:
    head, _ = rescored()
    handle = head.handle
    assert handle in rescored_head._registered
    del head
    gc.collect()
    assert handle not in rescored_head._registered


def test_a_rank_learns_which_steps_report_logprobs() -> None:
    def item(logprobs: int | None) -> ScheduledRequest:
        return ScheduledRequest(
            request_id="r", token_ids=[5], start_position=7, block_table=[0, 1],
            sample=True, prompt_token_ids=[1] * 7,
            sampling_params=SamplingParams(logprobs=logprobs))

    for logprobs in (None, 0, 3):
        sent = [item(None), item(logprobs)]
        received = decode_step(encode_step(sent, block_size=4))
        assert [i.wants_logprobs for i in received] == [i.wants_logprobs for i in sent]
        assert any(i.wants_logprobs for i in received) == (logprobs is not None)


def test_prepare_batch_asks_for_exact_logits_where_a_request_reports_logprobs(
        llama_path: Path) -> None:
    llm = quantized_llm(llama_path, "int4")
    runner = llm.engine.runner

    def batch_for(params: SamplingParams) -> bool:
        step = ScheduledRequest(request_id="r", token_ids=[5], start_position=3,
                                block_table=[0], sample=True, prompt_token_ids=[1, 2, 3],
                                sampling_params=params)
        return prepare_batch([step], runner.kv_cache, runner.decode_attention,
                             runner.device).exact_logits

    assert not batch_for(SamplingParams())
    assert batch_for(SamplingParams(logprobs=2))


def test_decode_logprobs_are_the_full_heads(tiny_models: dict[str, Path],
                                            tmp_path: Path, tokenizer: object) -> None:
    """Each sampled token's logprob, in float32, is the dequantized decoder's under the
    model's own head, token by token."""
    path = tiny_models["qwen2"]
    llm = quantized_llm(path, "int4")
    prompt = [5, 17, 42, 99, 7, 300, 12]
    output = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=6, logprobs=0,
                                         ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert output.logprobs is not None
    got = [entry[token].logprob for entry, token in
           zip(output.logprobs, output.token_ids, strict=True)]
    expected = transformers_logprobs(dequantized_copy(path, tmp_path / "copy", "int4", 128),
                                     [*prompt, *output.token_ids])[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-3


def test_a_chunked_prefill_step_that_samples_nothing_runs(llama_path: Path) -> None:
    """A step of prompt chunks keeps no logits: the head gets no rows."""
    prompt = {"prompt_token_ids": list(range(5, 70))}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chunked = quantized_llm(llama_path, "int4", max_num_batched_tokens=16,
                            enable_chunked_prefill=True)
    whole = quantized_llm(llama_path, "int4")
    assert (chunked.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == whole.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
