"""One choice's text read into reasoning, content and tool calls: whole, or delta by
delta while it streams (one ``ChoiceReader`` per choice, as parsers keep state)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from triollm.server.chat_parsing.plan import ChatParsing
from triollm.server.protocol import DeltaMessage
from triollm.tool_parsers import ToolParser
from triollm.tool_parsers.constrained import NamedToolCallParser, RequiredToolCallParser
from triollm.tool_parsers.tool_choice import tool_calls_from_output
from triollm.tool_parsers.types import DeltaFunctionCall, DeltaToolCall, ToolCall

__all__ = ["ChoiceReader", "ReadChoice"]


@dataclass
class ReadChoice:
    """A whole choice: its reasoning (None without one or when left out), the content
    around its tool calls, and the calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: Whether the finish reason becomes ``tool_calls`` when the model stopped (vLLM:
    #: auto and required choices that called a tool; a named choice keeps ``stop``).
    called: bool = False


class ChoiceReader:
    """Reads one choice of one request by ``plan``; ``prompt_token_ids`` tell whether
    the prompt already closed the reasoning (``enable_thinking: false``)."""

    def __init__(self, plan: ChatParsing, prompt_token_ids: Sequence[int]) -> None:
        self.plan = plan
        tokenizer = plan.tokenizer
        self.reasoning = (plan.reasoning_parser(
            tokenizer, chat_template_kwargs=plan.request.chat_template_kwargs)
            if plan.reasoning_parser else None)
        self.tools: ToolParser | None = None
        if plan.tool_choice == "auto" and plan.tool_parser is not None:
            self.tools = plan.tool_parser(tokenizer)
        elif plan.tool_choice == "required":
            self.tools = RequiredToolCallParser(tokenizer)
        elif plan.tool_choice == "named":
            self.tools = NamedToolCallParser(tokenizer, plan.named or "")
        self.in_reasoning = (self.reasoning is not None
                             and not self.reasoning.is_reasoning_end(list(prompt_token_ids)))
        self.text = ""
        self.token_ids: list[int] = []
        self.content_text = ""
        self.content_ids: list[int] = []
        #: Tool-call fragments were sent (the stream's finish reason becomes tool_calls).
        self.streamed_calls = False

    # -- a whole choice ------------------------------------------------------------------

    def read(self, text: str) -> ReadChoice:
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None and self.in_reasoning:
            reasoning, content = self.reasoning.extract_reasoning(text, self.plan.request)
        if not self.plan.include_reasoning:
            reasoning = None
        choice = self.plan.tool_choice
        if choice == "auto" and self.tools is not None:
            found = self.tools.extract_tool_calls(content or "", self.plan.request)
            if found.tools_called:
                return ReadChoice(reasoning, found.content,
                                  self._kept(found.tool_calls), called=True)
            return ReadChoice(reasoning, content)
        if choice in ("named", "required"):
            calls = tool_calls_from_output(content or "", self.plan.request.tool_choice)
            if not calls:  # cut short by max_tokens: the text is all there is
                return ReadChoice(reasoning, content)
            return ReadChoice(reasoning, "", self._kept(calls), called=choice == "required")
        return ReadChoice(reasoning, content)

    def _kept(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.plan.parallel_tool_calls else calls[:1]

    # -- a stream ------------------------------------------------------------------------

    def delta(self, text: str, token_ids: Sequence[int]) -> DeltaMessage | None:
        """What the choice's newest ``text`` (from ``token_ids``) adds; None: nothing to
        send yet."""
        previous_text, previous_ids = self.text, list(self.token_ids)
        self.text += text
        self.token_ids.extend(token_ids)
        reasoning_text = None
        content, content_ids = text, list(token_ids)
        if self.reasoning is not None and self.in_reasoning:
            split = self.reasoning.extract_reasoning_streaming(
                previous_text, self.text, text, previous_ids, self.token_ids, token_ids)
            reasoning_text = split.reasoning_content if split is not None else None
            content = split.content or "" if split is not None else ""
            if content or self.reasoning.is_reasoning_end(list(token_ids)):
                self.in_reasoning = False
                content_ids = self.reasoning.extract_content_ids(list(token_ids))
            else:
                content_ids = []
        delta = DeltaMessage()
        if reasoning_text and self.plan.include_reasoning:
            delta.reasoning = delta.reasoning_content = reasoning_text
        if content or content_ids:
            self._read_content(content, content_ids, delta)
        if delta.tool_calls:
            self.streamed_calls = True
        empty = (delta.content is None and delta.reasoning is None and not delta.tool_calls)
        return None if empty else delta

    def _read_content(self, text: str, token_ids: list[int], delta: DeltaMessage) -> None:
        previous_text, previous_ids = self.content_text, list(self.content_ids)
        self.content_text += text
        self.content_ids.extend(token_ids)
        if self.tools is None:
            delta.content = text
            return
        found = self.tools.extract_tool_calls_streaming(
            previous_text, self.content_text, text, previous_ids, self.content_ids,
            token_ids, self.plan.request)
        if found is not None:
            delta.content = found.content
            calls = [call for call in found.tool_calls
                     if self.plan.parallel_tool_calls or call.index == 0]
            delta.tool_calls = calls or None

    def finish(self) -> DeltaMessage | None:
        """At the end of a stream: what the tool parser held back (text that could have
        opened a call, a call's last fragment). A parser that does not say (one written
        for vLLM) is asked as vLLM does: the arguments it parsed but has not streamed."""
        tools = self.tools
        if tools is None or self.in_reasoning:
            return None
        held = tools.finish_streaming(self.content_text, self.plan.request)
        if held is not None:
            delta = DeltaMessage(content=held.content)
            calls = [call for call in held.tool_calls
                     if self.plan.parallel_tool_calls or call.index == 0]
            delta.tool_calls = calls or None
            if calls:
                self.streamed_calls = True
            return delta if delta.content is not None or calls else None
        return self._unsent_arguments()

    def _unsent_arguments(self) -> DeltaMessage | None:
        tools = self.tools
        if tools is None or not tools.prev_tool_call_arr or not self.streamed_calls:
            return None
        index = len(tools.prev_tool_call_arr) - 1
        if index >= len(tools.streamed_args_for_tool):
            return None
        arguments = tools.prev_tool_call_arr[index].get("arguments", {})
        expected = (arguments if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False))
        sent = tools.streamed_args_for_tool[index]
        if not expected.startswith(sent) or expected == sent:
            return None
        if not self.plan.parallel_tool_calls and index != 0:
            return None
        return DeltaMessage(tool_calls=[DeltaToolCall(
            index=index, function=DeltaFunctionCall(arguments=expected[len(sent):]))])
