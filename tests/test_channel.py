"""A request's channel delivers what the engine put, whatever the consumer's pace.

Behind a full buffer, DELTA outputs fold into one pending output and CUMULATIVE
outputs supersede each other; the consumer must still see exactly the concatenation
(DELTA) or the newest state (CUMULATIVE), in order, ending once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from triollm import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from triollm.engine.channel import RequestChannel


@dataclass(frozen=True)
class Piece:
    """One completion's share of one output."""

    index: int
    tokens: list[int]
    with_logprobs: bool


def make_output(pieces: list[Piece], finished: bool, step: int) -> RequestOutput:
    completions = [CompletionOutput(
        index=p.index, text="".join(f"<{t}>" for t in p.tokens), token_ids=list(p.tokens),
        cumulative_logprob=-float(step),
        logprobs=[{t: Logprob(-1.0)} for t in p.tokens] if p.with_logprobs else None,
        finish_reason="length" if finished else None) for p in pieces]
    return RequestOutput("r", "prompt", [1, 2], [None, {2: Logprob(-0.5)}] if step == 0
                         else None, completions, finished=finished)


async def read_to_end(channel: RequestChannel, received: list[RequestOutput]
                      ) -> list[RequestOutput]:
    """Read what is left until the stream ends; every output read, in order."""
    while True:
        try:
            received.append(await channel.get())
        except StopAsyncIteration:
            return received


pieces = st.lists(st.builds(Piece, index=st.integers(0, 2),
                            tokens=st.lists(st.integers(0, 99), max_size=3),
                            with_logprobs=st.booleans()),
                  min_size=1, max_size=3, unique_by=lambda p: p.index)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@given(steps=st.lists(pieces, min_size=1, max_size=30),
       reads=st.lists(st.integers(0, 4), min_size=30, max_size=30),
       buffer_size=st.integers(1, 3))
def test_delta_consumers_see_the_concatenation_at_any_pace(
        backend: str, steps: list[list[Piece]], reads: list[int], buffer_size: int) -> None:
    async def main() -> list[RequestOutput]:
        channel = RequestChannel("r", RequestOutputKind.DELTA, buffer_size, anyio.Event)
        received: list[RequestOutput] = []
        for step, (step_pieces, num_reads) in enumerate(zip(steps, reads, strict=False)):
            channel.put(make_output(step_pieces, step == len(steps) - 1, step))
            for _ in range(num_reads):  # the consumer reads now and then, or not at all
                if channel.ready and not channel.closed:
                    received.append(await channel.get())
        return await read_to_end(channel, received)

    received = anyio.run(main, backend=backend)
    for index in range(3):
        put = [p for step_pieces in steps for p in step_pieces if p.index == index]
        got = [c for output in received for c in output.outputs if c.index == index]
        assert [t for c in got for t in c.token_ids] == [t for p in put for t in p.tokens]
        assert "".join(c.text for c in got) == "".join(f"<{t}>" for p in put
                                                       for t in p.tokens)
        logprobs = [lp for c in got for lp in c.logprobs or []]
        assert len(logprobs) == sum(len(p.tokens) for p in put if p.with_logprobs)
    assert [o.finished for o in received] == [False] * (len(received) - 1) + [True]
    assert sum(o.prompt_logprobs is not None for o in received) == 1
    assert received[0].prompt_logprobs is not None


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@given(num_outputs=st.integers(1, 40), read_every=st.integers(1, 50))
def test_cumulative_consumers_see_the_newest_state_in_order(
        backend: str, num_outputs: int, read_every: int) -> None:
    async def main() -> list[RequestOutput]:
        channel = RequestChannel("r", RequestOutputKind.CUMULATIVE, 1, anyio.Event)
        received: list[RequestOutput] = []
        for step in range(num_outputs):
            channel.put(make_output([Piece(0, list(range(step + 1)), False)],
                                    step == num_outputs - 1, step))
            if step % read_every == 0:
                received.append(await channel.get())
        return await read_to_end(channel, received)

    received = anyio.run(main, backend=backend)
    lengths = [len(o.outputs[0].token_ids) for o in received]
    assert lengths == sorted(set(lengths)) and lengths[-1] == num_outputs
    assert received[-1].finished and not any(o.finished for o in received[:-1])


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@given(changes=st.lists(st.integers(0, 2), min_size=1, max_size=30),
       read_every=st.integers(1, 50))
def test_cumulative_samples_behind_a_full_buffer_keep_their_newest_state(
        backend: str, changes: list[int], read_every: int) -> None:
    # n > 1: each output carries only the samples that changed; a folded output must
    # keep every sample's newest state, not only the last output's samples.
    async def main() -> list[RequestOutput]:
        channel = RequestChannel("r", RequestOutputKind.CUMULATIVE, 1, anyio.Event)
        received: list[RequestOutput] = []
        lengths = [0, 0, 0]
        for step, index in enumerate(changes):
            lengths[index] += 1
            channel.put(make_output([Piece(index, list(range(lengths[index])), False)],
                                    step == len(changes) - 1, step))
            if step % read_every == 0:
                received.append(await channel.get())
        return await read_to_end(channel, received)

    received = anyio.run(main, backend=backend)
    newest: dict[int, int] = {}
    for output in received:
        for completion in output.outputs:
            assert len(completion.token_ids) >= newest.get(completion.index, 0)
            newest[completion.index] = len(completion.token_ids)
    assert newest == dict(Counter(changes))
    assert received[-1].finished


@pytest.mark.anyio
async def test_a_failed_channel_delivers_what_it_holds_then_raises() -> None:
    channel = RequestChannel("r", RequestOutputKind.DELTA, 1, anyio.Event)
    for step in range(3):
        channel.put(make_output([Piece(0, [step], False)], False, step))
    channel.fail(RuntimeError("engine died"))
    channel.put(make_output([Piece(0, [9], False)], True, 3))  # after the end: dropped
    assert (await channel.get()).outputs[0].token_ids == [0]
    assert (await channel.get()).outputs[0].token_ids == [1, 2]
    with pytest.raises(RuntimeError, match="engine died"):
        await channel.get()
