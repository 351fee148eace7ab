"""The model runner's side of constrained decoding: one ``SampleGrammar`` per sample
(its matcher, advanced by every token it samples, and its reasoning gate), and the
``MaskFiller`` that computes a step's allowed-token bitmask in a helper thread while the
model's forward runs (both backends compute masks with the GIL released)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from triollm.structured_output.bitmask import GrammarMask, allocate_bitmask
from triollm.structured_output.grammar import StructuredOutputRequest

__all__ = ["MaskFiller", "PendingMask", "SampleGrammar"]


class SampleGrammar:
    """One sample's constraint: its matcher stays in step with the sample's output
    tokens for its whole life (across preemption and recompute too: the runner keeps
    the tokens, so the matcher is never rolled back)."""

    __slots__ = ("active", "matcher", "request")

    def __init__(self, request: StructuredOutputRequest) -> None:
        self.request = request
        self.matcher = request.grammar.matcher()
        #: Whether the constraint applies to the next token (False while reasoning).
        self.active = request.constrained_from_start

    def accept(self, output_token_ids: Sequence[int]) -> str | None:
        """Take the last of ``output_token_ids`` (just sampled); the error that fails
        this sample if its grammar rejects it."""
        if not self.active:
            gate = self.request.reasoning
            self.active = gate is None or gate.ends_at(output_token_ids)
            return None
        token = output_token_ids[-1]
        if self.matcher.accept_token(token):
            return None
        return (f"structured outputs: the {self.request.grammar.backend} grammar "
                f"({self.request.grammar.kind}) rejected token {token}")

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of the draft tokens ``token_ids`` the grammar would accept next, in
        turn (0 while the constraint waits for the reasoning to end: a draft could
        cross that end)."""
        if not self.active:
            return 0
        return self.matcher.validate_tokens(token_ids)


@dataclass
class PendingMask:
    """A step's masks being computed; ``wait()`` gives them (None: no constrained
    row) and the rows whose matcher failed, with why."""

    future: Future[None] | None
    mask: GrammarMask | None
    errors: dict[int, str] = field(default_factory=dict)

    def wait(self) -> GrammarMask | None:
        if self.future is not None:
            self.future.result()
        if self.mask is None or not self.errors:
            return self.mask
        keep = [i for i, row in enumerate(self.mask.rows) if row not in self.errors]
        if not keep:
            return None
        return GrammarMask(self.mask.bitmask[keep], [self.mask.rows[i] for i in keep])


class MaskFiller:
    """Fills bitmasks for a runner whose logits are ``vocab_size`` wide, one helper
    thread, two buffers used in turn (a step's copy to the device may still read one
    while the next step fills the other)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self._pin = device.type == "cuda"
        self._buffers = [allocate_bitmask(8, vocab_size, pin_memory=self._pin)
                         for _ in range(2)]
        self._turn = 0
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: list[tuple[int, SampleGrammar]]) -> PendingMask:
        """Begin computing the masks of ``rows`` (sampling row, its grammar), each
        grammar's matcher current (the previous step's tokens accepted)."""
        active = [(row, grammar) for row, grammar in rows if grammar.active]
        if not active:
            return PendingMask(None, None)
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < len(active):
            buffer = allocate_bitmask(max(len(active), 2 * buffer.shape[0]), self.vocab_size,
                                      pin_memory=self._pin)
            self._buffers[self._turn] = buffer
        bitmask = buffer[:len(active)]
        pending = PendingMask(None, GrammarMask(bitmask, [row for row, _ in active]))

        def fill() -> None:
            for i, (row, grammar) in enumerate(active):
                try:
                    grammar.matcher.fill_bitmask(bitmask, i)
                except Exception as error:  # this sample's matcher: it fails alone
                    pending.errors[row] = f"structured outputs: computing the mask: {error!r}"

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="triollm-grammar")
        pending.future = self._pool.submit(fill)
        return pending

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
