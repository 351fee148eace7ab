"""Logits to tokens, batched in torch, with vLLM's sampling parameters.

Order of operations (as vLLM): raw log-probabilities for the caller are taken from the
model's logits before anything else; then a constrained row's grammar mask applies
(structured outputs: every token its grammar forbids is masked), min_tokens masks the
stop tokens,
allowed_token_ids masks every other token, logit_bias is added, bad words are masked
and penalties apply;
greedy rows take the argmax and the rest are scaled by temperature, filtered by top-k,
top-p and min-p and sampled. Sampling uses the exponential race (``argmax(p / E)`` with
``E ~ Exp(1)``), so a seeded row draws its noise from its own generator and gets the
same token whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triollm.model.argmax import argmax
from triollm.sampling_params import SamplingParams
from triollm.step import TokenLogprobs
from triollm.structured_output.bitmask import GrammarMask, apply_bitmask

__all__ = ["SamplingRow", "sample", "sampling_probs", "token_logprobs"]


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None,
    grammar_mask: GrammarMask | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row of ``logits`` (``[N, vocab]``); ``grammar_mask`` holds
    the allowed tokens of the rows under a grammar."""
    logits = _fp32_copy(logits)
    wants_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None

    grammar_only = None
    if grammar_mask is not None:
        apply_bitmask(logits, grammar_mask.bitmask, grammar_mask.rows)
        grammar_only = _keep_grammar_rows(logits, rows, grammar_mask.rows)
    _apply_min_tokens(logits, rows)
    _apply_allowed_tokens_and_bias(logits, rows)
    _apply_bad_words(logits, rows)
    _apply_penalties(logits, rows)
    if grammar_only is not None:
        _restore_grammar_rows(logits, *grammar_only)

    tokens = argmax(logits)
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[index], [rows[i].params for i in random_rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=rows[i].generator or generator)
        # A zero draw would make 0 / 0 = NaN for a filtered-out token, and argmax
        # treats NaN as the largest value.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        tokens[index] = argmax(probs / noise)

    token_list = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        for i in wants_logprobs:
            logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], rows[i].params.logprobs)
    return token_list, logprobs


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distributions ``sample`` draws the (non-greedy) ``rows`` from, ``[N, vocab]``
    float32 summing to 1: for speculative decoding's rejection rule, whose requests
    have no grammar."""
    logits = _fp32_copy(logits)
    _apply_min_tokens(logits, rows)
    _apply_allowed_tokens_and_bias(logits, rows)
    _apply_bad_words(logits, rows)
    _apply_penalties(logits, rows)
    probs = _filtered_probs(logits, [row.params for row in rows])
    return probs / probs.sum(dim=-1, keepdim=True)


def token_logprobs(row_logprobs: torch.Tensor, token_id: int, top_k: int | None) -> TokenLogprobs:
    """The chosen token's log-probability and 1-based rank, then the ``top_k`` best."""
    chosen = row_logprobs[token_id]
    rank = int((row_logprobs > chosen).sum().item()) + 1
    token_ids = [token_id]
    values = [float(chosen.item())]
    ranks = [rank]
    if top_k:
        top_values, top_ids = torch.topk(row_logprobs, top_k)
        token_ids += top_ids.tolist()
        values += top_values.tolist()
        ranks += list(range(1, top_k + 1))
    return TokenLogprobs(token_ids=token_ids, logprobs=values, ranks=ranks)


def _keep_grammar_rows(logits: torch.Tensor, rows: list[SamplingRow], grammar_rows: list[int]
                       ) -> tuple[list[int], torch.Tensor] | None:
    """The grammar-masked logits of the constrained rows that other masks could empty
    (min_tokens, allowed_token_ids, bad words: e.g. a complete grammar allows only EOS,
    which min_tokens forbids)."""
    kept = [i for i in grammar_rows if _masks_more(rows[i])]
    return (kept, logits[kept].clone()) if kept else None


def _masks_more(row: SamplingRow) -> bool:
    params = row.params
    return (params.allowed_token_ids is not None or bool(params.bad_words_token_ids)
            or len(row.output_token_ids) < params.min_tokens)


def _restore_grammar_rows(logits: torch.Tensor, kept: list[int], saved: torch.Tensor) -> None:
    """A constrained row that the other masks left without any token takes its grammar's
    mask alone: the grammar wins."""
    emptied = torch.isneginf(logits[kept]).all(dim=-1).tolist()
    for j, i in enumerate(kept):
        if emptied[j]:
            logits[i] = saved[j]


def _fp32_copy(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in fp32, in a tensor of its own (the filters change rows in place): the
    conversion from another dtype is that copy."""
    return logits.clone() if logits.dtype == torch.float32 else logits.float()


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) < params.min_tokens and params.all_stop_token_ids:
            blocked = [t for t in params.all_stop_token_ids if t < logits.shape[-1]]
            logits[i, blocked] = float("-inf")


def _apply_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Ban the token that would complete a bad word given the output so far."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        output = row.output_token_ids
        for word in row.params.bad_words_token_ids:
            *prefix, last = word
            if last < vocab and (not prefix or output[len(output) - len(prefix):] == prefix):
                logits[i, last] = float("-inf")


def _apply_allowed_tokens_and_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    device = logits.device
    for i, row in enumerate(rows):
        params = row.params
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)
            kept = logits[i, allowed]
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype,
                                device=device)
            logits[i, ids] += bias


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    device = logits.device
    for i, row in enumerate(rows):
        params = row.params
        if not params.has_penalties:
            continue
        output = torch.tensor(row.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(row.prompt_token_ids, dtype=torch.long, device=device)
            seen[prompt[prompt < vocab]] = True
            penalised = torch.where(logits[i] > 0, logits[i] / params.repetition_penalty,
                                    logits[i] * params.repetition_penalty)
            logits[i] = torch.where(seen, penalised, logits[i])
        logits[i] -= params.frequency_penalty * counts
        logits[i] -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        remove = ranks >= torch.tensor(top_k, device=device)[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove |= mass_before >= torch.tensor(top_p, device=device)[:, None]
        remove[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
