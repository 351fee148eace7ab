"""The built-in tool parsers' shared shape: a parser reads the whole text so far into a
``Scan`` (its content and its calls, each as far as it is sure of), and streaming sends
the difference from what it sent before. A whole output is the same read with
``final=True``, so what a stream sends adds up to what ``extract_tool_calls`` returns,
however the text was cut into deltas."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from triollm.tool_parsers.abstract import ToolParser
from triollm.tool_parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

__all__ = ["CallScan", "IncrementalToolParser", "Scan", "ScanMemo", "join_content",
           "tag_overlap", "tagged_regions"]

logger = logging.getLogger(__name__)


@dataclass
class CallScan:
    """One tool call as far as the text shows it."""

    #: The function's name, once all of it is known (never a part of it).
    name: str | None = None
    #: The arguments' JSON text as far as it is sure: a later read only extends it.
    arguments: str = ""
    #: The arguments are whole.
    complete: bool = False


@dataclass
class Scan:
    """What a parser reads in a text: the content to show (only ever extended by a
    later read of a longer text), the calls, and whether a whole output failed to parse
    (``malformed``: then all of it is content)."""

    content: str = ""
    calls: list[CallScan] = field(default_factory=list)
    malformed: bool = False


class ScanMemo:
    """What a parser read of a streamed text's finished calls, kept while the text only
    grows: each delta then reads only the calls still open, not all of them again (a
    long answer of many calls would cost time in the square of its length)."""

    __slots__ = ("_items", "_request", "_text")

    def __init__(self) -> None:
        self._text = ""
        self._request: Any = None
        self._items: dict[Any, Any] = {}

    def reads_of(self, text: str, request: Any) -> dict[Any, Any]:
        """The reads kept for ``text`` (by where each finished call starts): none when
        ``text`` does not extend the last one or is another request's."""
        if request is not self._request or not text.startswith(self._text):
            self._items = {}
            self._request = request
        self._text = text
        return self._items


def tag_overlap(text: str, tags: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of one of
    ``tags`` (held back while streaming until the next delta tells)."""
    best = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:size]):
                best = size
                break
    return best


def join_content(closed: Sequence[str], tail: str, *, any_call: bool, final: bool,
                 tags: Sequence[str]) -> str:
    """The content of a text whose parts outside the calls are ``closed`` (each followed
    by a call) and ``tail`` (after the last call, or all the text when there is none).

    Beside calls, a part of whitespace alone is dropped (the blank lines between calls).
    With no call, a whole output is all content. While streaming (not ``final``) the
    tail's end that could start one of ``tags`` waits, as does a tail of whitespace alone.
    """
    parts = [part for part in closed if part.strip()]
    if final:
        if any_call or closed:
            if tail.strip():
                parts.append(tail)
        else:
            parts.append(tail)
        return "".join(parts)
    tail = tail[:len(tail) - tag_overlap(tail, tags)]
    if tail.strip():
        parts.append(tail)
    return "".join(parts)


def tagged_regions(text: str, start_tag: str, end_tag: str, *, final: bool,
                   reads: dict[Any, Any] | None = None
                   ) -> tuple[list[str], list[tuple[str, bool]], str]:
    """Split ``text`` at ``start_tag ... end_tag`` pairs: the parts before each region,
    the regions (their inner text, and whether their end tag came), and the text after
    the last closed region. An unclosed region runs to the end of the text; while
    streaming, without an end that could be the start of ``end_tag``. With ``reads``
    (``ScanMemo.reads_of``) the closed regions of a shorter text are not split again."""
    pos, before, regions = 0, [], []
    if reads is not None and _REGIONS in reads:
        pos, kept_before, kept_regions = reads[_REGIONS]
        before, regions = list(kept_before), list(kept_regions)
    while True:
        opened = text.find(start_tag, pos)
        if opened == -1:
            _keep_regions(reads, pos, before, regions)
            return before, regions, text[pos:]
        inner = opened + len(start_tag)
        closed = text.find(end_tag, inner)
        if closed == -1:
            _keep_regions(reads, pos, before, regions)
            before.append(text[pos:opened])
            body = text[inner:]
            if not final:
                body = body[:len(body) - tag_overlap(body, (end_tag,))]
            regions.append((body, False))
            return before, regions, ""
        before.append(text[pos:opened])
        regions.append((text[inner:closed], True))
        pos = closed + len(end_tag)


#: The key of ``tagged_regions``' closed regions in a ``ScanMemo``.
_REGIONS = "tagged regions"


def _keep_regions(reads: dict[Any, Any] | None, pos: int, before: list[str],
                  regions: list[tuple[str, bool]]) -> None:
    if reads is not None and (_REGIONS not in reads or reads[_REGIONS][0] != pos):
        reads[_REGIONS] = (pos, tuple(before), tuple(regions))


class IncrementalToolParser(ToolParser):
    """A tool parser defined by ``scan``; streaming and whole extraction follow.

    While streaming, ``prev_tool_call_arr[i]`` is ``{"name": ..., "arguments": <the
    arguments' JSON text sent so far>}`` and ``streamed_args_for_tool[i]`` that same text.
    """

    #: The format's markers are special tokens in some vocabularies: a request with
    #: tools keeps special tokens in its text.
    keep_special_tokens = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._sent_content = ""
        #: For ``scan``: reads of finished calls, by where they start.
        self.memo = ScanMemo()

    def adjust_request(self, request: Any) -> Any:
        if (self.keep_special_tokens and getattr(request, "tools", None)
                and getattr(request, "tool_choice", None) != "none"):
            try:
                request.skip_special_tokens = False
            except (AttributeError, ValueError):  # a frozen request keeps its own
                pass
        return request

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        """Read ``text`` (the whole output when ``final``)."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        """The id of a new tool call."""
        return make_tool_call_id()

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        try:
            scan = self.scan(model_output, final=True, request=request)
            calls = [self._whole_call(call) for call in scan.calls]
        except Exception:  # a model's text is never a reason to fail the request
            logger.debug("tool calls not parsed; the output stays content", exc_info=True)
            scan, calls = Scan(malformed=True), []
        if scan.malformed or not calls or any(call is None for call in calls):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[],
                                                content=model_output)
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=[call for call in calls if call is not None],
            content=scan.content or None)

    def _whole_call(self, call: CallScan) -> ToolCall | None:
        if call.name is None or not call.complete:
            return None
        try:
            arguments = json.dumps(json.loads(call.arguments), ensure_ascii=False)
        except ValueError:
            return None
        return ToolCall(id=self.new_call_id(),
                        function=FunctionCall(name=call.name, arguments=arguments))

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        try:
            scan = self.scan(current_text, final=False, request=request)
        except Exception:
            logger.debug("tool-call stream not parsed; waiting for more", exc_info=True)
            return None
        return self._send(scan.content, scan.calls)

    def finish_streaming(self, current_text: str, request: Any) -> DeltaMessage | None:
        try:
            scan = self.scan(current_text, final=True, request=request)
        except Exception:
            logger.debug("tool calls not parsed; the output stays content", exc_info=True)
            scan = Scan(malformed=True)
        if scan.malformed and not self.prev_tool_call_arr:
            return self._send(current_text, [])
        return self._send(scan.content, [] if scan.malformed else scan.calls)

    def _send(self, content: str, calls: list[CallScan]) -> DeltaMessage | None:
        new_content = None
        if len(content) > len(self._sent_content) and content.startswith(self._sent_content):
            new_content = content[len(self._sent_content):]
            self._sent_content = content
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(calls):
            if index == len(self.prev_tool_call_arr):
                if call.name is None:
                    break
                self.prev_tool_call_arr.append({"name": call.name, "arguments": ""})
                self.streamed_args_for_tool.append("")
                self.current_tool_id = index
                self.current_tool_name_sent = True
                deltas.append(DeltaToolCall(
                    index=index, id=self.new_call_id(), type="function",
                    function=DeltaFunctionCall(name=call.name, arguments="")))
            sent = self.streamed_args_for_tool[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                    arguments=call.arguments[len(sent):])))
                self.streamed_args_for_tool[index] = call.arguments
                self.prev_tool_call_arr[index]["arguments"] = call.arguments
        if new_content is None and not deltas:
            return None
        return DeltaMessage(content=new_content, tool_calls=deltas)
