"""Speculative decoding's verification: a request's draft tokens against the tokens the
target model samples itself at the same positions.

The target's token after each position is sampled exactly as a step without drafts
samples it (the same processed distribution, the same draws from the request's
generator, one position after the other), and the drafts are accepted while they equal
those tokens; the first that differs is replaced by the target's token, and after the
last draft the target's next token comes on top. For a draft that is one token, not a
distribution (prompt lookup), this is vLLM's rejection rule: draft ``x`` is accepted
with probability ``p(x)``, and otherwise the token is drawn from ``p`` with ``x``
removed and renormalised, which is how the target's token is distributed given that it
differs from ``x``. So the outputs keep the target's distribution exactly, greedy
outputs are the same token for token, and a seeded request samples the same tokens
with speculation as without.

That rule keeps the target's distribution whatever chose the drafts, as long as they
do not depend on the target's draws; a draft sampled from a draft model's distribution
``q`` (model/runners/draft_model.py) is accepted more often by vLLM's general rule
(``rejection_sample``): draft ``x`` is accepted with probability
``min(1, p(x) / q(x))``, and otherwise the token is drawn from ``max(p - q, 0)``
renormalised; past the last draft the target's next token is drawn from ``p``.
"""

from __future__ import annotations

import torch

from triollm.model.sampler import SamplingRow, sample, sampling_probs, token_logprobs
from triollm.step import RunnerOutput, ScheduledRequest, TokenLogprobs
from triollm.structured_output.bitmask import GrammarMask, allocate_bitmask
from triollm.structured_output.matchers import SampleGrammar

__all__ = ["continue_drafts", "rejection_sample", "verify_drafts"]


def verify_drafts(item: ScheduledRequest, logits: torch.Tensor, row: SamplingRow,
                  draft_probs: torch.Tensor | None, output: RunnerOutput,
                  generator: torch.Generator | None,
                  grammar: SampleGrammar | None = None) -> None:
    """A request's step with drafts, its first token sampled already (in ``output``
    and at the end of ``row.output_token_ids``): ``logits`` are the target's after
    each of the step's positions. With ``draft_probs`` (the distributions the drafts
    were drawn from) vLLM's general rule replaces that first token; otherwise the
    drafts are accepted while they equal the target's own samples. Under a
    ``grammar`` (which has taken the first token) the drafts are cut at the first it
    forbids, and each further token is sampled under the grammar's mask. The tokens
    past the first go to ``output.more_token_ids`` and ``row.output_token_ids``."""
    request_id = item.request_id
    drafts = item.token_ids[-item.num_draft_tokens:]
    try:
        if grammar is not None:
            if output.sampled_token_ids[request_id] != drafts[0]:
                return
            drafts = drafts[:1 + grammar.valid_prefix(drafts[1:])]
            tokens, logprobs = continue_constrained(logits[1:len(drafts) + 1], drafts[1:],
                                                    row, generator, grammar)
        elif draft_probs is not None:
            tokens, logprobs = rejection_sample(logits, drafts, draft_probs[:len(drafts)],
                                                row, generator)
            row.output_token_ids[-1] = output.sampled_token_ids[request_id] = tokens[0]
            if logprobs[0] is not None:
                output.logprobs[request_id] = logprobs[0]
            tokens, logprobs = tokens[1:], logprobs[1:]
            row.output_token_ids.extend(tokens)
        elif output.sampled_token_ids[request_id] == drafts[0]:
            tokens, logprobs = continue_drafts(logits[1:], drafts[1:], row, generator)
            row.output_token_ids.extend(tokens)
        else:
            return
    except Exception as error:
        output.failed[request_id] = f"verifying draft tokens: {error!r}"
        return
    if tokens:
        output.more_token_ids[request_id] = tokens
        output.more_logprobs[request_id] = [lp for lp in logprobs if lp is not None]


def continue_constrained(logits: torch.Tensor, drafts: list[int], row: SamplingRow,
                         generator: torch.Generator | None, grammar: SampleGrammar
                         ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """``continue_drafts`` under a grammar: one position after the other, each token
    sampled under the mask of the grammar that took the tokens before it (and appended
    to ``row.output_token_ids``); ``ValueError`` where the grammar rejects one."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    bitmask = allocate_bitmask(1, logits.shape[-1])
    for j in range(logits.shape[0]):
        mask = None
        if grammar.active:
            grammar.matcher.fill_bitmask(bitmask, 0)
            mask = GrammarMask(bitmask.to(logits.device), [0])
        [token], [token_lp] = sample(logits[j:j + 1], [row], generator, mask)
        row.output_token_ids.append(token)
        rejected = grammar.accept(row.output_token_ids)
        if rejected is not None:
            raise ValueError(rejected)
        tokens.append(token)
        logprobs.append(token_lp)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens, logprobs


def continue_drafts(logits: torch.Tensor, drafts: list[int], row: SamplingRow,
                    generator: torch.Generator | None
                    ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The tokens after a step's first sampled token, which equalled the first draft:
    ``drafts`` are the further drafts and ``logits`` (``len(drafts) + 1`` rows) the
    model's logits after each of the positions that follow it. Stops at the first
    token that differs from its draft."""
    if row.params.is_greedy:  # no draws: every row at once
        tokens, logprobs = sample(logits, [row] * logits.shape[0], generator)
        for j, draft in enumerate(drafts):
            if tokens[j] != draft:
                return tokens[:j + 1], logprobs[:j + 1]
        return tokens, logprobs
    tokens = []
    logprobs = []
    for j in range(logits.shape[0]):
        [token], [token_lp] = sample(logits[j:j + 1], [row], generator)
        tokens.append(token)
        logprobs.append(token_lp)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens, logprobs


def rejection_sample(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor,
                     row: SamplingRow, generator: torch.Generator | None
                     ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """A sampled request's tokens for a step with ``drafts`` drawn from ``draft_probs``
    (``[len(drafts), vocab]``): ``logits`` are the target's after the position before
    the first draft and after each draft (``len(drafts) + 1`` rows). The accepted
    drafts, then the target's token (a rejected draft's replacement or, past them all,
    its next token)."""
    target = sampling_probs(logits, [row] * logits.shape[0])
    draws = torch.rand(len(drafts), generator=row.generator or generator,
                       device=logits.device).tolist()
    tokens: list[int] = []
    for j, draft in enumerate(drafts):
        p, q = target[j], draft_probs[j]
        if draws[j] * float(q[draft]) <= float(p[draft]):
            tokens.append(draft)
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: p itself
            residual = p
        tokens.append(_draw(residual, row, generator))
        break
    else:
        tokens.append(_draw(target[len(drafts)], row, generator))
    logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
    if row.params.logprobs is not None:
        raw = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
        logprobs = [token_logprobs(raw[j], token, row.params.logprobs)
                    for j, token in enumerate(tokens)]
    return tokens, logprobs


def _draw(weights: torch.Tensor, row: SamplingRow, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=row.generator or generator).item())
