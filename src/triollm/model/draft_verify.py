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
"""

from __future__ import annotations

import torch

from triollm.model.sampler import SamplingRow, sample
from triollm.step import TokenLogprobs

__all__ = ["continue_drafts"]


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
