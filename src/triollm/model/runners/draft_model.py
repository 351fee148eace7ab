"""Speculative decoding's ``draft_model`` method on the model's side: a small model of
the target's tokenizer that proposes each request's next draft tokens, run in the
model thread after the target's step.

Its paged KV cache has the target's blocks, addressed by the target's block tables,
so the target's block manager governs both: a block freed by a rollback, a
preemption, an abort or a finish is freed for the draft too, and a prefix-cached
block holds the draft's keys and values of its tokens wherever the request that
filled it proposed (one that never did, a prompt whose only output is one token say,
leaves the draft's half stale: the draft's proposals after it are worse, the outputs
the same). Past the target's table a proposing request writes its chain of drafts
into scratch blocks of its own.

The draft catches up lazily: per request it knows up to where its cache holds the
sequence's true tokens, and a proposing step first runs the tokens from there to the
sequence's end (one varlen forward for all proposing requests), then one decode per
further draft. A greedy request's drafts are the draft's argmax (a point mass); a
sampled request's are sampled from the draft's distribution under the request's own
sampling parameters, returned with it for the rejection rule
(model/draft_verify.py). Outputs never depend on the draft's cache, only the
acceptance rate does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from triollm.config import EngineConfig
from triollm.model.argmax import argmax
from triollm.model.attention.metadata import KVCacheSpec, PagedKVCache
from triollm.model.attention.paged import ATTENTION_NAME
from triollm.model.cpu.packed_linear import pack_linear_layers
from triollm.model.loader import load_hf_config, load_model
from triollm.model.runners.batch import DecodeAttention, prepare_batch, run_forward
from triollm.model.runners.setup import profile_kv_specs
from triollm.model.sampler import SamplingRow, sampling_probs
from triollm.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from triollm.structured_output.bitmask import allocate_bitmask, apply_bitmask
from triollm.structured_output.matchers import SampleGrammar

__all__ = ["DraftModel", "DraftRequest", "Proposal"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRequest:
    """One request that proposes after this step: its sequence so far (the step's
    accepted tokens included), the target's block table, and how to sample it."""

    request_id: str
    token_ids: list[int]
    block_table: list[int]
    num_proposals: int
    row: SamplingRow
    #: The request's grammar (None: unconstrained): the drafts follow its masks.
    grammar: SampleGrammar | None = None


@dataclass(frozen=True)
class Proposal:
    """Draft tokens and, for a sampled request, the draft's distribution each was drawn
    from (``[len(token_ids), vocab]`` float32; None: greedy, a point mass)."""

    token_ids: list[int]
    probs: torch.Tensor | None


class DraftModel:
    """The draft model and its KV cache; one instance per runner, used from its thread."""

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        spec = config.speculative
        if spec is None or spec.model is None:
            raise ValueError("speculative_config: no draft model configured")
        model_config = config.model
        self.device = model_config.device
        self.block_size = config.cache.block_size
        self.vocab_size = vocab_size
        hf_config = load_hf_config(spec.model, trust_remote_code=model_config.trust_remote_code)
        self.model = load_model(spec.model, hf_config, attn_implementation=ATTENTION_NAME,
                                dtype=model_config.dtype, device=self.device,
                                trust_remote_code=model_config.trust_remote_code)
        draft_vocab = int(self.model.get_output_embeddings().weight.shape[0])
        if draft_vocab > vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft model {spec.model!r} has "
                f"{draft_vocab} token ids, the target {model_config.model!r} {vocab_size}: "
                f"a draft model must share the target's tokenizer")
        self.draft_vocab = draft_vocab
        if self.device.type == "cpu":
            pack_linear_layers(self.model)
        self.specs: dict[int, KVCacheSpec] = profile_kv_specs(self.model, config)
        #: Scratch blocks per proposing request: its chain may run one block past its
        #: table's end, plus what its drafts fill.
        self._scratch_per_request = -(-spec.num_speculative_tokens // self.block_size) + 1
        self.max_proposers = min(spec.disable_by_batch_size, config.scheduler.max_num_seqs)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model_config.seed)
        #: Per request, how many of its sequence's first tokens the draft cache holds.
        self._computed: dict[str, int] = {}
        self._scratch_base = 0
        self.kv_cache: PagedKVCache | None = None
        self.attention = DecodeAttention()

    def allocate(self, num_blocks: int, cache_dtype: torch.dtype,
                 attention: DecodeAttention) -> None:
        """The cache: the target's ``num_blocks`` blocks, then the scratch blocks."""
        self._scratch_base = num_blocks
        total = num_blocks + self.max_proposers * self._scratch_per_request
        self.kv_cache = PagedKVCache(self.specs, total, self.block_size, cache_dtype,
                                     self.device)
        self.kv_cache.number_layers(self.model)
        # The one-call decode step is checked on the target's layers only.
        self.attention = DecodeAttention(attention.kernel, None, attention.padding_keys)

    def start(self, request_id: str, start_position: int) -> None:
        """A request's first step starts at ``start_position`` (past a prefix-cache hit,
        whose blocks hold the draft's keys and values too)."""
        self._computed[request_id] = start_position

    def drop(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the finished requests; a preempted one's blocks went, so the draft
        recomputes it all."""
        for request_id in scheduler_output.finished_request_ids:
            self._computed.pop(request_id, None)
        for request_id in scheduler_output.preempted_request_ids:
            if request_id in self._computed:
                self._computed[request_id] = 0

    def propose_after(self, items: list[ScheduledRequest], output: RunnerOutput,
                      sampling_row: Callable[[ScheduledRequest], SamplingRow],
                      grammar: Callable[[str], SampleGrammar | None]) -> dict[str, Proposal]:
        """After a step's sampling: the proposals of its items that ask for them
        (``num_proposals``) and sampled, also in ``output.draft_token_ids``, each cut at
        the first token its ``grammar`` forbids. Where the draft fails, nothing is
        proposed (the outputs never depend on it)."""
        requests = []
        for item in items:
            if item.num_proposals and item.request_id in output.sampled_token_ids \
                    and item.request_id not in output.failed:
                row = sampling_row(item)
                requests.append(DraftRequest(
                    item.request_id, row.prompt_token_ids + row.output_token_ids,
                    item.block_table, item.num_proposals, row, grammar(item.request_id)))
        if not requests:
            return {}
        try:
            proposals = self.propose(requests)
        except Exception:
            logger.warning("the draft model failed; no drafts this step", exc_info=True)
            return {}
        for request_id, proposal in proposals.items():
            constraint = grammar(request_id)
            if constraint is not None:
                valid = constraint.valid_prefix(proposal.token_ids)
                proposal = proposals[request_id] = Proposal(
                    proposal.token_ids[:valid],
                    None if proposal.probs is None else proposal.probs[:valid])
            output.draft_token_ids[request_id] = proposal.token_ids
        return proposals

    def propose(self, requests: list[DraftRequest]) -> dict[str, Proposal]:
        """Each request's next ``num_proposals`` draft tokens."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("the draft model's cache is not allocated")
        requests = requests[:self.max_proposers]
        tables = []
        items = []
        for slot, request in enumerate(requests):
            first = self._scratch_base + slot * self._scratch_per_request
            tables.append(request.block_table
                          + list(range(first, first + self._scratch_per_request)))
            length = len(request.token_ids)
            done = min(self._computed.get(request.request_id, 0), length - 1)
            items.append(_query(request.request_id, request.token_ids[done:], done,
                                tables[-1]))
            self._computed[request.request_id] = min(
                length, len(request.block_table) * self.block_size)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        wanted = [request.num_proposals for request in requests]
        #: Tokens each request's grammar took (given back at the end).
        advanced = [0] * len(requests)
        active = list(range(len(requests)))
        try:
            while active:
                logits = self._forward(items)
                self._choose(logits, [requests[i] for i in active],
                             [drafts[i] for i in active], [probs[i] for i in active])
                for i in active:
                    constraint = requests[i].grammar
                    if constraint is None or not constraint.active:
                        continue
                    if constraint.matcher.is_terminated():  # it takes nothing more
                        wanted[i] = len(drafts[i])
                        continue
                    if not constraint.matcher.accept_token(drafts[i][-1]):
                        drafts[i].pop()
                        del probs[i][len(drafts[i]):]
                        wanted[i] = len(drafts[i])
                        continue
                    advanced[i] += 1
                    if constraint.matcher.is_terminated():  # nothing past its end
                        wanted[i] = len(drafts[i])
                active = [i for i in active if len(drafts[i]) < wanted[i]]
                items = [_query(requests[i].request_id, drafts[i][-1:],
                                len(requests[i].token_ids) + len(drafts[i]) - 1, tables[i])
                         for i in active]
        finally:  # each matcher back where its request's output is
            for i, request in enumerate(requests):
                if advanced[i] and request.grammar is not None:
                    request.grammar.matcher.rollback(advanced[i])
        return {request.request_id: Proposal(
                    drafts[i], torch.stack(probs[i]) if probs[i] else None)
                for i, request in enumerate(requests)}

    def _forward(self, items: list[ScheduledRequest]) -> torch.Tensor:
        """The draft's logits after each of ``items``' last tokens, in their order."""
        assert self.kv_cache is not None
        # prepare_batch wants decodes first, longest context first (as the runner's).
        order = sorted(range(len(items)), key=lambda i: (items[i].num_tokens != 1,
                                                         -items[i].start_position))
        batch = prepare_batch([items[i] for i in order], self.kv_cache, self.attention,
                              self.device)
        logits = run_forward(self.model, batch.input_ids, batch.positions, batch.keep,
                             batch.metadata, compiled=False).float()
        rows = [0] * len(items)
        for row, owner in enumerate(batch.keep_owner):
            rows[order[owner]] = row
        return logits[rows]

    def _choose(self, logits: torch.Tensor, requests: list[DraftRequest],
                drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
        """Append each request's next draft: the argmax (greedy) or a sample."""
        if self.draft_vocab < self.vocab_size:  # token ids the draft cannot propose
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - self.draft_vocab),
                                             value=float("-inf"))
        constrained = [row for row, request in enumerate(requests)
                       if request.grammar is not None and request.grammar.active]
        if constrained:
            bitmask = allocate_bitmask(len(constrained), self.vocab_size)
            for i, row in enumerate(constrained):
                grammar = requests[row].grammar
                assert grammar is not None
                grammar.matcher.fill_bitmask(bitmask, i)
            apply_bitmask(logits, bitmask.to(logits.device), constrained)
        greedy = argmax(logits).tolist()
        for row, request in enumerate(requests):
            if request.row.params.is_greedy:
                drafts[row].append(greedy[row])
                continue
            q = sampling_probs(logits[row:row + 1], [request.row])[0]
            token = torch.multinomial(q, 1, generator=request.row.generator or self.generator)
            drafts[row].append(int(token.item()))
            probs[row].append(q)

    def shutdown(self) -> None:
        self._computed.clear()
        self.kv_cache = None
        del self.model


def _query(request_id: str, token_ids: list[int], start: int,
           table: list[int]) -> ScheduledRequest:
    """The draft's forward over ``token_ids`` from ``start``, keeping the last row."""
    return ScheduledRequest(request_id=request_id, token_ids=token_ids, start_position=start,
                            block_table=table, sample=True, prompt_token_ids=[],
                            sampling_params=None)
